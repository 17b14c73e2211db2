"""The step path as plain decisions (no process, no model, no loop): the in-flight steps are
``ClusterState.steps`` (``step_book``), and ``core.handle`` decides which step a TOKEN or ERROR
frame settles, whom a timed-out step blames, and what a lost plan fails."""

from __future__ import annotations

import pytest

from edgepipe.cluster.rules import core, membership
from edgepipe.cluster.shells import narrate
from edgepipe.cluster.state import state as S, step_book as SB
from edgepipe.cluster.state.batching import LaneItem
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A
from edgepipe.net.messages import Error, ErrorCode, Hello, Token

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

CONFIG = core.Config(membership.LivenessSettings(), prefix_block=2)
PLAN = Deployment(4, (A("w1", 0, 4), A("w2", 4, 8)))


def _up() -> S.ClusterState:
    state = S.ClusterState()
    for name in ("w1", "w2", "w3"):
        state = S.apply(state, S.WorkerJoined(name, name, Hello.from_fields({"memory_bytes": 1 << 30}), 0.0))
    return S.apply(state, S.Committed(PLAN, 0.0))


def _ponged(state: S.ClusterState, now: float, **computed: int) -> S.ClusterState:
    for wid, rows in computed.items():
        state = S.apply(state, S.Ponged(wid, 0.01, {"computed": rows}, now))
    return state


def _asked(state: S.ClusterState, seq: str, step: int = 0, plan: int = 4, now: float = 1.0) -> tuple[S.ClusterState, int]:
    step_id = state.steps.next_id
    handled = core.handle(state, core.StepAsked(seq, step, plan, seq.split(".")[0], ("w1", "w2"), now), CONFIG)
    return handled.state, step_id


def _token(seqs_steps: list[tuple[str, int]], tokens: list[int], plan: int = 4, **extra) -> Token:
    return Token(plan, [{"seq": s, "step": n, "rid": s.split(".")[0]} for s, n in seqs_steps], tokens,
                 [["w1", 0.01, 1, 4, 2], ["w2", 0.02, 1, 4, 2]], **extra)


def test_a_token_frame_settles_the_steps_it_names_and_nothing_else():
    state, a = _asked(_up(), "r1.0", step=3)
    state, b = _asked(state, "r2.0", step=0)
    heard = core.handle(state, core.TokenHeard("w2", _token([("r1.0", 3), ("r2.0", 0), ("r9.0", 0)], [11, 12, 13],
                                                            verified=[[5, 11], None, None]), 2.0), CONFIG)
    timings = [["w1", 0.01, 1, 4, 2], ["w2", 0.02, 1, 4, 2]]
    assert heard.commands == (core.SettleStep(a, core.StepResult(11, timings, True, None, [5, 11])),
                              core.SettleStep(b, core.StepResult(12, timings, False, None, None)))  # stage times counted once
    assert heard.events == (SB.StepEnded(a, SB.StepEnd.TOKEN, 2.0), SB.StepEnded(b, SB.StepEnd.TOKEN, 2.0))
    assert not heard.state.steps.inflight
    # late, duplicated, of another step or of another plan: nothing settles
    for stray in (_token([("r1.0", 2)], [1]), _token([("r1.0", 3)], [1], plan=5)):
        assert core.handle(state, core.TokenHeard("w2", stray, 2.0), CONFIG).commands == ()
    assert core.handle(heard.state, core.TokenHeard("w2", _token([("r1.0", 3)], [1]), 2.1), CONFIG).commands == ()


def test_a_token_from_a_stage_that_is_not_the_last_is_noted_and_ignored():
    state, _ = _asked(_up(), "r1.0")
    heard = core.handle(state, core.TokenHeard("w1", _token([("r1.0", 0)], [7]), 2.0), CONFIG)
    why = "token frame for plan 4 from a stage that is not its last"
    assert heard.events == (S.Noted(S.NoteKind.IGNORED, {"worker": "w1", "why": why}, 2.0),) and heard.commands == ()
    assert heard.state.steps == state.steps
    assert narrate.entry(heard.events[0], heard.state, None, 1.0) == {"t": 1.0, "kind": "ignored", "worker": "w1", "why": why}


def test_an_error_frame_fails_its_step_for_a_retry_or_for_good():
    state, a = _asked(_up(), "r1.0", step=2)
    corrupt = core.handle(state, core.ErrorHeard("w2", Error("non-finite input", ErrorCode.CORRUPT_INPUT, "r1.0", 2), 3.0), CONFIG)
    assert corrupt.commands == (core.FailStep(a, "non-finite input", final=False),)  # the sender is at fault: a new plan
    assert corrupt.events == (SB.StepEnded(a, SB.StepEnd.FAILED, 3.0),
                              S.Noted(S.NoteKind.INVALID_FRAME, {"worker": "w2", "why": "non-finite input"}, 3.0))
    context = core.handle(state, core.ErrorHeard("w1", Error("too long", ErrorCode.CONTEXT, "r1.0"), 3.0), CONFIG)
    assert context.commands == (core.FailStep(a, "worker w1: too long", final=True),)  # no step named: its step in flight
    for stray in (Error("old", ErrorCode.CONTEXT, "r1.0", 1), Error("who", ErrorCode.CONTEXT, "r5.0", 2), Error("none", ErrorCode.INTERNAL)):
        assert core.handle(state, core.ErrorHeard("w1", stray, 3.0), CONFIG) == core.Handled(state)


def test_a_lost_plan_fails_its_steps_and_only_those():
    state, a = _asked(_up(), "r1.0")
    state, b = _asked(state, "r2.0", plan=5)
    state, c = _asked(state, "r3.0")
    lost = core.handle(state, core.StepsLost(4, "worker w2 disconnected", 4.0), CONFIG)
    assert lost.commands == (core.FailStep(a, "worker w2 disconnected", False), core.FailStep(c, "worker w2 disconnected", False))
    assert list(lost.state.steps.inflight) == [b]
    stopping = core.handle(state, core.StepsLost(None, "the coordinator stopped", 4.0, final=True), CONFIG)
    assert [cmd.step_id for cmd in stopping.commands] == [a, b, c] and all(cmd.final for cmd in stopping.commands)
    unsent = core.handle(state, core.StepsLost(None, "worker w1 is gone", 4.0, step_ids=(c, 99)), CONFIG)
    assert unsent.commands == (core.FailStep(c, "worker w1 is gone", False),) and set(unsent.state.steps.inflight) == {a, b}


def test_a_timed_out_step_blames_the_stage_that_computed_nothing_while_it_answered_pings():
    sent = _ponged(_up(), 0.5, w1=10, w2=20)
    state, a = _asked(sent, "r1.0", now=1.0)
    why = "computed nothing for r1.0 step 0 in 5.0 s while answering pings"
    # alone on its plan: w1 passed it on (its count moved), w2 did not although it answered pings since
    dropped = core.handle(_ponged(state, 5.5, w1=11, w2=20), core.StepTimedOut(a, 5.0, 6.0), CONFIG)
    assert dropped.commands == (core.Quarantine("w2", why),) and dropped.events == (SB.StepEnded(a, SB.StepEnd.TIMED_OUT, 6.0),)
    assert core.handle(_ponged(state, 5.5, w1=10, w2=20), core.StepTimedOut(a, 5.0, 6.0), CONFIG).commands == (core.Quarantine("w1", why),)
    # silent since the step went out: membership's business, no blame here (the step just retries)
    assert core.handle(state, core.StepTimedOut(a, 5.0, 6.0), CONFIG).commands == ()
    # not alone: w1's count may have moved for the other step, so w2 cannot be told to have starved...
    crowded, b = _asked(state, "r2.0", now=1.1)
    assert core.handle(_ponged(crowded, 5.5, w1=11, w2=20), core.StepTimedOut(a, 5.0, 6.0), CONFIG).commands == ()
    # ...nor when another step was sent on its plan after it (and ended meanwhile)
    later = core.handle(crowded, core.StepGivenUp(b, 1.2), CONFIG).state
    assert SB.alone(later.steps, later.steps.inflight[a]) is False
    # but a first stage that computed nothing at all is at fault either way
    assert core.handle(_ponged(crowded, 5.5, w1=10, w2=20), core.StepTimedOut(a, 5.0, 6.0), CONFIG).commands == (core.Quarantine("w1", why),)
    # a step no longer in flight (its token came first) blames no one
    assert core.handle(dropped.state, core.StepTimedOut(a, 5.0, 6.5), CONFIG) == core.Handled(dropped.state)


def test_the_step_table_is_its_events_folded_and_replays():
    """A sequence has one step in flight (a new one replaces an older one still listed); the end
    of a step not in flight changes nothing; what ``handle`` returns is its events folded, so a
    log of them replays into the same table; step events get no dashboard line."""
    state = _up()
    inputs = [core.StepAsked("r1.0", 0, 4, "r1", ("w1", "w2"), 1.0), core.StepAsked("r2.0", 0, 4, "r2", ("w1", "w2"), 1.1),
              core.TokenHeard("w2", _token([("r1.0", 0)], [5]), 1.5), core.StepAsked("r1.0", 1, 4, "r1", ("w1", "w2"), 1.6),
              core.StepAsked("r1.0", 2, 4, "r1", ("w1", "w2"), 1.7), core.StepGivenUp(2, 2.0), core.StepTimedOut(2, 5.0, 6.0)]
    log = []
    for given in inputs:
        handled = core.handle(state, given, CONFIG)
        folded = state
        for event in handled.events:
            folded = S.apply(folded, event)
            assert narrate.entry(event, folded, None, 0.0) is None
        assert folded == handled.state, given
        log += handled.events
        state = handled.state
    assert [(f.seq, f.step) for f in state.steps.inflight.values()] == [("r1.0", 2)]  # r1's step 1 replaced, r2's given up
    assert state.steps.sent_on == {4: 4} and state.steps.next_id == 5
    replayed = _up()
    for event in log:
        replayed = S.apply(replayed, event)
    assert replayed == state


def test_decode_steps_wait_for_their_lane_and_go_out_together_as_commands():
    """The lanes are state too: a decode step asks for its lane (``LaneAsked``), the core answers
    with the batch to send (``SendBatch``, by step id) or a timer for the lane's late members
    (``ArmLane``); a lane event that changes nothing makes no event."""
    state, a = _asked(_up(), "r1.0")
    first = core.handle(state, SB.LaneAsked(LaneItem("r1", 4, a), 2), CONFIG)
    assert first.commands == (core.SendBatch((a,)),) and first.state.steps.lanes.lane_of == {"r1": 0}  # alone: at once
    state, b = _asked(first.state, "r2.0")
    second = core.handle(state, SB.LaneAsked(LaneItem("r2", 4, b), 1), CONFIG)
    assert second.commands == ()  # one lane (one stage now): r2 waits while r1's step flies
    back = core.handle(second.state, SB.LaneReturned("r1"), CONFIG)
    assert back.commands == (core.ArmLane(0, 1),)  # r1 has not asked again: the lane waits for it, bounded
    state, c = _asked(back.state, "r1.0", step=1)
    both = core.handle(state, SB.LaneAsked(LaneItem("r1", 4, c), 1), CONFIG)
    assert both.commands == (core.SendBatch((b, c)),) and both.events == (SB.LaneAsked(LaneItem("r1", 4, c), 1),)
    assert core.handle(both.state, SB.LaneExpired(0, 1), CONFIG) == core.Handled(both.state)  # a stale timer: nothing
    assert core.handle(both.state, SB.LaneLeft("r9"), CONFIG) == core.Handled(both.state)  # not in a lane: nothing
    left = core.handle(core.handle(both.state, SB.LaneReturned("r1"), CONFIG).state, SB.LaneLeft("r1"), CONFIG)
    assert left.state.steps.lanes.lane_of == {"r2": 0} and narrate.entry(left.events[0], left.state, None, 0.0) is None
