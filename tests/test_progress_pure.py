"""A request's token loop as state (no process, no model, no loop): ``state.Progress`` changed by
``StepPlanned``, ``RequestFed`` and ``StepBroke`` through ``apply``, and the two rules of
``rules.progress`` that the loop (``shells.requests``) carries out: plan the next step, and make
a step's outcome into events and the next command."""

from __future__ import annotations

import pytest

from edgepipe.cluster.rules import progress as P
from edgepipe.cluster.state import state as S

pytestmark = pytest.mark.pure

PROMPT, GENERATED = [1, 2, 3], [7, 8, 9]
SETTINGS = P.ProgressSettings(max_wait_s=30.0)


def _fold(state: S.ClusterState, *events) -> S.ClusterState:
    for event in events:
        state = S.apply(state, event)
    return state


def _fed_on(plan: int, now: float = 1.0) -> S.ClusterState:
    """r1 started at 0 and was fed on ``plan`` at ``now``: its prompt and three tokens (6 positions)."""
    state = _fold(S.ClusterState(), S.RequestStarted("r1", 40, 0.0))
    planned = P.plan_step(state, "r1", plan, PROMPT, [])
    return _fold(state, planned.event, S.RequestFed("r1", "r1.0", plan, 5, now))


def test_a_request_starts_with_its_first_id_and_is_fed_where_its_step_went():
    state = _fold(S.ClusterState(), S.RequestStarted("r1", 40, 2.5))
    assert state.requests["r1"].progress == S.Progress("r1.0", last_progress=2.5)
    planned = P.plan_step(state, "r1", 3, PROMPT, [])
    assert planned.step.feed == PROMPT and planned.drop is None and not planned.rewind  # the prompt, once
    state = _fold(state, planned.event)
    assert state.requests["r1"].progress.sent_plan == 3
    fed = _fold(state, *P.after_step(state, "r1", P.Yielded(3, 3), 4.0, SETTINGS)[0]).requests["r1"]
    assert (fed.plan, fed.kv_len, fed.progress.fed_plan, fed.progress.last_progress) == (3, 3, 3, 4.0)


def test_on_the_plan_that_holds_its_kv_it_resumes_with_its_last_token():
    planned = P.plan_step(_fed_on(3), "r1", 3, PROMPT, GENERATED)
    assert planned.step.feed == [9] and planned.step.seq is None and planned.drop is None and not planned.rewind


def test_its_kv_moved_to_a_new_plan_it_resumes_there_and_forgets_what_the_old_stage_ran_ahead():
    """A stage that fed itself (the direct path) may have run one step past the coordinator's
    count when the switch moved its KV: the first step on the new plan forgets it (``rewind``)
    instead of being refused and replayed."""
    moved = _fold(_fed_on(3), S.KvMoved("r1", 4))
    planned = P.plan_step(moved, "r1", 4, PROMPT, GENERATED)
    assert planned.step.seq is None and planned.step.feed == [9] and planned.step.fed_plan == 4  # no replay
    assert planned.rewind and planned.event.rewind
    after = _fold(moved, planned.event, S.RequestFed("r1", "r1.0", 4, 6, 2.0))
    assert not P.plan_step(after, "r1", 4, PROMPT, GENERATED + [10]).rewind  # once only


def test_on_another_plan_it_replays_under_a_new_id_and_the_old_one_is_dropped():
    planned = P.plan_step(_fed_on(3), "r1", 5, PROMPT, GENERATED)
    assert planned.drop == ("r1.0", 3) and planned.step.seq == "r1.1" and planned.step.feed == PROMPT + GENERATED
    assert planned.event.replay and not planned.rewind
    state = _fold(_fed_on(3), planned.event)
    assert (state.requests["r1"].progress.seq, state.requests["r1"].progress.epoch) == ("r1.1", 1)


def test_a_broken_step_pauses_retries_with_a_growing_backoff_and_replays():
    state = _fold(_fed_on(3), S.KvMoved("r1", 4))
    events, commands = P.after_step(state, "r1", P.Broke(6, "worker w2 lost"), 5.0, SETTINGS)
    assert [type(e) for e in events] == [S.RequestPaused, P.StepBroke, S.KvMoved]
    assert commands == (P.Retry(P.RETRY_STEP_S),)
    state = _fold(state, *events)
    q = state.requests["r1"]
    assert q.paused == (5.0, 6) and q.migrated_to is None and q.progress.fed_plan == -1 and q.progress.breaks == 1
    events, commands = P.after_step(state, "r1", P.Broke(6, "still lost"), 5.1, SETTINGS)
    assert S.RequestPaused not in map(type, events) and commands == (P.Retry(2 * P.RETRY_STEP_S),)  # one pause per token
    state = _fold(state, *events)
    planned = P.plan_step(state, "r1", 3, PROMPT, GENERATED)  # the KV it had is no longer known whole: replay
    assert planned.step.seq == "r1.1" and planned.step.feed == PROMPT + GENERATED and planned.drop == ("r1.0", -1)
    fed = _fold(state, planned.event, S.RequestFed("r1", "r1.1", 3, 6, 6.0)).requests["r1"]
    assert fed.paused is None and fed.recovered == (5.0, 6) and fed.progress.breaks == 0


def test_no_token_for_the_longest_wait_fails_the_request_in_one_line():
    events, commands = P.after_step(_fed_on(3, now=1.0), "r1", P.Broke(6, "no plan"), 1.0 + SETTINGS.max_wait_s, SETTINGS)
    assert events == () and commands == (P.Fail("no token for 30 s: no plan"),)


def test_a_broken_step_that_resumed_from_a_checkpoint_voids_it():
    state = _fold(_fed_on(3), S.KvMoved("r1", None))
    resume = S.Resume(5, "r1.c1", 4)
    state = _fold(state, S.StepPlanned("r1", 5, "r1.c1", 1, 5, True, resume, True))
    events, _ = P.after_step(state, "r1", P.Broke(6, "lost"), 2.0, SETTINGS)
    assert S.CheckpointVoid in map(type, events)


def test_rejected_drafts_are_forgotten_by_the_next_decode_step_only():
    state = _fold(_fed_on(3), S.RequestFed("r1", "r1.0", 3, 6, 2.0, rewind=True))
    assert P.plan_step(state, "r1", 3, PROMPT, GENERATED).rewind
    assert not P.plan_step(state, "r1", 5, PROMPT, GENERATED).rewind  # a replay leaves no drafts behind


# -- one decision for every sequence between steps -------------------------------------------------
WAITS = P.WaitSettings(capacity_wait_s=10.0, max_wait_s=30.0)


def _two_waiting() -> tuple[S.ClusterState, tuple[P.Waiting, ...]]:
    """r1 fed on plan 1 (its prompt and three tokens), r2 just started at 0."""
    state = _fold(_fed_on(1), S.RequestStarted("r2", 40, 0.0))
    return state, (P.Waiting("r1", PROMPT, GENERATED), P.Waiting("r2", [4, 5], []))


def test_on_a_usable_plan_every_waiting_sequence_gets_its_next_step_in_one_decision():
    state, waiting = _two_waiting()
    decisions = P.schedule(state, waiting, 1, None, None, 2.0, WAITS)
    assert [type(d) for d in decisions] == [P.StartStep, P.StartStep]
    r1, r2 = (d.planned for d in decisions)
    assert r1.step.feed == [9] and r1.step.seq is None  # resumes on the plan that holds its KV
    assert r2.step.feed == [4, 5] and r2.event.plan == 1  # its prompt, as one prefill


def test_on_another_plan_each_sequence_is_replayed_and_a_new_one_starts():
    state, waiting = _two_waiting()
    r1, r2 = (d.planned for d in P.schedule(state, waiting, 2, None, None, 2.0, WAITS))
    assert r1.drop == ("r1.0", 1) and r1.step.feed == PROMPT + GENERATED and r1.step.seq == "r1.1"
    assert r2.drop is None and r2.step.feed == [4, 5]


def test_without_a_plan_sequences_wait_until_their_bound_then_fail_in_one_line():
    state, waiting = _two_waiting()
    assert P.schedule(state, waiting, None, None, None, 20.0, WAITS) == ()  # not up yet: both wait
    lacking = P.schedule(state, waiting, None, None, "the workers hold 1 GiB of 2", 20.0, WAITS)
    assert [(d.rid, type(d)) for d in lacking] == [("r1", P.FailRequest), ("r2", P.FailRequest)]
    assert all("lacks capacity" in d.why and "\n" not in d.why for d in lacking)
    late = P.schedule(state, waiting, None, None, None, 30.5, WAITS)  # r1's wait counts from its last token (1.0)
    assert [d.rid for d in late] == ["r2"] and "not up" in late[0].why


def test_once_the_coordinator_halted_every_waiting_sequence_fails_with_its_reason():
    state, waiting = _two_waiting()
    decisions = P.schedule(state, waiting, 1, "the coordinator stopped", None, 2.0, WAITS)
    assert decisions == (P.FailRequest("r1", "the coordinator stopped"), P.FailRequest("r2", "the coordinator stopped"))
