"""The coordinator's remaining ledgers as state (no process, no model, no loop): typed dashboard
notes, the "up" line read from ``Committed``."""

from __future__ import annotations

import pytest

from edgepipe.cluster.shells import narrate
from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

PLAN = Deployment(4, (A("w1", 0, 4), A("w2", 4, 8)), "w2 joined", {"tpot_s": 0.02, "objective": "latency"})


def test_a_note_has_one_of_the_listed_kinds():
    assert S.NoteKind("refused") is S.NoteKind.REFUSED
    with pytest.raises(ValueError):
        S.NoteKind("refusd")  # a misspelt kind fails where it is written, not on the dashboard
    assert "up" not in {k.value for k in S.NoteKind}  # a plan serving is its Committed, not a note
    line = narrate.entry(S.Noted(S.NoteKind.REFUSED, {"peer": "10.0.0.2", "reason": "wrong token"}, 1.0), S.ClusterState(), None, 5.0)
    assert line == {"t": 5.0, "kind": "refused", "peer": "10.0.0.2", "reason": "wrong token"}
    assert S.apply(S.ClusterState(), S.Noted(S.NoteKind.RESUME, {}, 1.0)) == S.ClusterState()


def test_no_call_site_notes_a_kind_by_its_value():
    """Every note names a ``NoteKind`` member, so a misspelt kind fails where it is written; a call
    site passing a kind by its value (``note("spare_failed", ...)``) is found here."""
    import pathlib
    import re

    import edgepipe

    named = {m.group(1) for f in pathlib.Path(edgepipe.__file__).parent.rglob("*.py")
             for m in re.finditer(r'\.(?:event|note|on_event)\(\s*"([a-z_]+)"', f.read_text())}
    assert not named, f"kinds passed by value: {sorted(named)}"


def test_the_up_line_is_read_from_the_commit():
    timings = S.UpTimings(1.25, 0.5, 2048, replaced=3, moved={"quiesce_s": 0.1, "kv_moved": 2, "kv_recomputed": 0})
    state = S.apply(S.ClusterState(), S.Committed(PLAN, 9.0, timings))
    assert state.active == PLAN and state.phase is S.Phase.UP  # the timings change nothing else
    assert state == S.apply(S.ClusterState(), S.Committed(PLAN, 9.0))
    line = narrate.entry(S.Committed(PLAN, 9.0, timings), state, None, 100.0)
    assert line == {"t": 100.0, "kind": "up", "plan": 4, "prepare_s": 1.25, "paused_s": 0.5, "fetched_bytes": 2048,
                    "predicted": {"tpot_s": 0.02, "objective": "latency"}, "replaced": 3, "quiesce_s": 0.1, "kv_moved": 2,
                    "kv_recomputed": 0}
    assert narrate.describe(line) == "plan 4 serving: 20 ms/token predicted, objective latency"
    assert narrate.entry(S.Committed(PLAN, 9.0), state, None, 100.0) is None  # a commit without timings: no line


# -- the prefix cache's bookkeeping, as state ------------------------------------------------------
import random  # noqa: E402

from edgepipe.cluster.state import prefix, prefix_book as PB
from edgepipe.net.messages import Hello  # noqa: E402


def _up(*plans: Deployment) -> S.ClusterState:
    state = S.ClusterState()
    for name in ("w1", "w2"):
        state = S.apply(state, S.WorkerJoined(name, name, Hello.from_fields({"memory_bytes": 1 << 30}), 0.0))
    for dep in plans:
        state = S.apply(state, S.Committed(dep, 1.0))
    return state


def _prefill(state: S.ClusterState, rid: str, ids: list[int], room: int = 8, reuse: bool = True):
    event = PB.decide(state.prefix, state.active.plan_id, rid, ids, room, 2, reuse)
    return S.apply(state, event), event


def test_the_book_replays_what_the_decisions_left():
    """``prefix.record`` rebuilds from a decision alone the cache ``prefix.prefill`` left, over
    seeded prompts that share prefixes, evict and save (so an event log replays the cache)."""
    rng = random.Random(7)
    cache, replayed = prefix.PrefixCache(plan=1), prefix.PrefixCache(plan=1)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for i in range(60):
        ids = rng.choice(stems)[: rng.randrange(2, 12)] + [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
        rid = f"r{i}"
        cache, decision = prefix.prefill(cache, ids, rid, room=rng.randrange(0, 6), block=2, reuse=rng.random() < 0.8)
        parents = tuple(cache.blocks[name].parent for _, name in decision.save)
        replayed = prefix.record(replayed, rid, decision, parents)
        assert replayed == cache and list(replayed.blocks) == list(cache.blocks), i
        if rng.random() < 0.7:
            cache, replayed = prefix.commit(cache, rid), prefix.commit(replayed, rid)


def test_a_hit_counts_a_failed_frame_drops_the_cache_and_says_so():
    state, first = _prefill(_up(PLAN), "r1", list(range(9)))
    assert first.plan == 4 and first.decision.save and not first.decision.reuse
    state = S.apply(state, PB.PrefixDone("r1", True))
    assert state.prefix.counts.saved_blocks == len(first.decision.save) and not state.prefix.cache.pending
    state, second = _prefill(state, "r2", list(range(9)))  # the same prompt: its blocks are reused
    assert second.decision.reuse and state.prefix.counts.hits == 1 and state.prefix.counts.prefills == 2
    assert state.prefix.counts.reused_positions == second.decision.reused_positions > 0
    held = len(state.prefix.cache.blocks)
    failed = S.apply(state, PB.PrefixDone("r2", False))  # some stages may have applied it, others not
    assert not failed.prefix.cache.blocks and failed.prefix.cache.epoch == state.prefix.cache.epoch + 1
    assert failed.prefix.counts.dropped == 1 and failed.prefix.last_drop == (held, "the prefill of r2 failed part-way")
    line = narrate.entry(PB.PrefixDone("r2", False), failed, None, 3.0)
    assert line == {"t": 3.0, "kind": "prefix_dropped", "blocks": held, "why": "the prefill of r2 failed part-way"}
    late = S.apply(failed, PB.PrefixDone("r2", False))  # late or duplicated: nothing more, and no second line
    assert late.prefix.counts == failed.prefix.counts and narrate.entry(PB.PrefixDone("r2", False), late, None, 4.0) is None
    _, off = _prefill(state, "r3", list(range(9)), reuse=False)  # prompt logprobs: every position computed
    assert not off.decision.reuse
    assert PB.decide(state.prefix, 4, "r4", [1], 8, 2, True) is None  # nothing to cache


def test_a_switch_or_a_lost_plan_invalidates_the_cache():
    state, _ = _prefill(_up(PLAN), "r1", list(range(9)))
    state = S.apply(state, PB.PrefixDone("r1", True))
    assert state.prefix.cache.plan == 4 and state.prefix.cache.blocks
    other = Deployment(5, (A("w2", 0, 4), A("w1", 4, 8)))
    switched = S.apply(state, S.Committed(other, 2.0))
    assert switched.prefix.cache.plan == 5 and not switched.prefix.cache.blocks and switched.prefix.counts.dropped == 1
    assert S.apply(state, S.Committed(PLAN, 2.0)).prefix == state.prefix  # the same plan again: kept
    lost = S.apply(state, S.WorkerLost("w2", "disconnected", 2.0))  # a recovery: the plan is gone with its stage
    assert lost.active is None and not lost.prefix.cache.blocks and lost.prefix.cache.plan is None
    _, after = _prefill(S.apply(lost, S.Committed(other, 3.0)), "r2", list(range(9)))
    assert not after.decision.reuse and after.decision.epoch > state.prefix.cache.epoch  # the stages clear their store


def test_the_cache_is_off_where_reuse_is_not_known_to_be_exact():
    from types import SimpleNamespace as NS

    state = _up(PLAN)
    assert PB.why_off(state.workers, [NS(kv_window=0)], PLAN, 64) is None
    assert PB.why_off(state.workers, [NS(kv_window=0)], PLAN, 0) == "turned off"
    assert PB.why_off(state.workers, [NS(kv_window=0), NS(kv_window=128)], PLAN, 64) == "sliding-window layers"
    gpu = S.apply(state, S.WorkerJoined("w2", "w2", Hello.from_fields({"memory_bytes": 1 << 30, "device": "gpu"}), 0.0))
    assert PB.why_off(gpu.workers, [NS(kv_window=0)], PLAN, 64) == "stage on w2 (gpu)"


# -- KV moves at a switch: decided from the state, in flight as state -------------------------------
from types import SimpleNamespace as NS  # noqa: E402

from edgepipe.cluster.rules import kv_moves
from edgepipe.cluster.rules.deploy import KvCopy  # noqa: E402

UNITS = [NS(kv_bytes_per_token=1000) for _ in range(8)]
OLD, NEW = Deployment(1, (A("w1", 0, 4), A("w2", 4, 8))), Deployment(2, (A("w1", 0, 5), A("w2", 5, 8)))


class Profile:
    """What ``kv_moves.plan`` reads of ``profiling.ClusterProfile``: links and stage speeds."""

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth

    def link_of(self, worker_id):
        return 0.001, self.bandwidth

    def unit_cost(self, start, end):
        return 0.01 * (end - start)

    def of(self, worker_id):
        return NS(speed=1.0, overhead_s=0.0)


def _serving(relay: bool = False) -> S.ClusterState:
    state = S.ClusterState()
    for name in ("w1", "w2"):
        browser = {"kind": "browser"} if relay and name == "w2" else {}  # a browser's activations are relayed
        state = S.apply(state, S.WorkerJoined(name, name, Hello.from_fields({"memory_bytes": 1 << 30, **browser}), 0.0))
    state = S.apply(state, S.Committed(OLD, 1.0))
    for rid, kv_len in (("r1", 100), ("r2", 0), ("r3", 40)):
        state = S.apply(state, S.RequestStarted(rid, 200))
        if kv_len:
            state = S.apply(state, S.RequestFed(rid, f"{rid}.0", 1, kv_len))
    return state


def test_live_sequences_move_their_changed_layers_when_that_beats_replaying_them():
    moves = kv_moves.plan(_serving(), OLD, NEW, UNITS, Profile(bandwidth=1e9))
    # every stage of the new plan gets its layers' KV: kept ones copied into its new plan, unit 4 from w2 to w1
    copies = (KvCopy("w1", "w1", 0, 4), KvCopy("w2", "w1", 4, 5), KvCopy("w2", "w2", 5, 8))
    assert moves.copies == tuple((rid, cp) for rid in ("r1", "r3") for cp in copies) and moves.replay == ()
    assert moves.moved_bytes == (100 + 40) * 8 * 1000 and moves.timeout_s == pytest.approx(10.0 + 3 * 1_120_000 / 1e9)
    slow = kv_moves.plan(_serving(), OLD, NEW, UNITS, Profile(bandwidth=10.0))  # 14 kB/s-hours: replay is cheaper
    assert slow.copies == () and slow.replay == ("r1", "r3")
    relayed = kv_moves.plan(_serving(relay=True), OLD, NEW, UNITS, Profile(bandwidth=1e9))
    assert relayed.relayed and relayed.replay == ("r1", "r3")
    assert kv_moves.plan(_up(OLD), OLD, NEW, UNITS, Profile(1e9)) is None  # nothing live: nothing to decide
    # a sequence arrived whole only if every copy of it was acknowledged
    ids = tuple(range(1, 7))
    assert kv_moves.settled(moves, {1: True, 2: True, 3: True, 4: True, 5: False, 6: True}, ids) == (["r1"], ["r3"])
    assert kv_moves.settled(moves, {m: True for m in ids}, ids) == (["r1", "r3"], [])
    assert kv_moves.settled(slow, {}, ()) == ([], ["r1", "r3"])


def test_moves_in_flight_are_state():
    state = _serving()
    sent = [kv_moves.KvMoveSent(m, rid, "w2", "w1", 2, 4, 5) for m, rid in ((1, "r1"), (2, "r3"))]
    for event in sent:
        state = S.apply(state, event)
    assert dict(state.moves) == {1: sent[0], 2: sent[1]}
    state = S.apply(state, kv_moves.KvMoveEnded(1, True))
    assert list(state.moves) == [2]
    assert S.apply(state, kv_moves.KvMoveEnded(1, False)) == state  # late or duplicated: nothing
    assert not S.apply(state, kv_moves.KvMoveEnded(2, False)).moves
    assert narrate.entry(sent[0], state, None, 1.0) is None  # no dashboard line of its own (the up line counts them)


# -- a heartbeat's verdicts: suspect, lose, abandon (membership.beat) --------------------------------
from edgepipe.cluster.rules import membership


def _beating(spare: bool) -> S.ClusterState:
    state = S.ClusterState()
    for name in ("w1", "w2", "w3"):  # each declares a 1 GiB budget (so whether the others hold the model can be told)
        hello = Hello.from_fields({"memory_bytes": 1 << 30, "emulation": {"memory_budget": 1 << 30}})
        state = S.apply(state, S.WorkerJoined(name, name, hello, 0.0))
    state = S.apply(state, S.Committed(Deployment(4, (A("w1", 0, 4), A("w2", 4, 8))), 0.0))
    if spare:  # a prepared plan that avoids w2
        state = S.apply(state, S.SpareChosen((A("w1", 0, 4), A("w3", 4, 8))))
    for name in ("w1", "w3"):
        state = S.apply(state, S.Heard(name, 2.9))
    return state


def test_a_heartbeat_suspects_loses_and_abandons_as_plain_decisions():
    settings = membership.LivenessSettings()
    beat = membership.beat(_beating(spare=True), 2.5, 3.0, settings, replay_s=0.5, lacking=lambda state: None)
    assert beat.events == (S.Suspected("w2", 3.0), S.PlanAbandoned(4, "plan 4: stage w2 went silent", 3.0))
    assert beat.abandoned == 4 and beat.replan and beat.lose == ()
    # no spare that avoids it, or workers that could not hold the model: wait for it instead
    waits = membership.beat(_beating(spare=False), 2.5, 3.0, settings, 0.5, lacking=lambda state: None)
    assert waits.events == (S.Suspected("w2", 3.0),) and waits.abandoned is None and not waits.replan
    short = membership.beat(_beating(spare=True), 2.5, 3.0, settings, 0.5, lacking=lambda state: "8 GB short")
    assert short.abandoned is None
    # the capacity check sees this beat's suspicion (a suspected worker holds nothing for a new plan)
    seen = []
    membership.beat(_beating(spare=True), 2.5, 3.0, settings, 0.5, lacking=lambda state: seen.append(state.workers["w2"]) or None)
    assert seen[0].suspected_since == 3.0
    lost = membership.beat(_beating(spare=True), 10.5, 11.0, settings, 0.5, lacking=lambda state: None)
    assert [v.worker_id for v in lost.lose] == ["w2"]  # silent 11 s: out; the others (8.1 s) only suspected
    assert lost.events == (S.Suspected("w1", 11.0), S.Suspected("w3", 11.0)) and lost.abandoned is None
    quarantined = S.apply(_beating(spare=False), S.Misbehaved("w3", "dropped a step", 1.0))
    assert membership.beat(quarantined, 60.5, 61.5, settings, 0.5, lambda state: None).replan  # its time out ended


# -- resume or replay, from the state (progress.next_step) -------------------------------------------
from edgepipe.cluster.rules.progress import NextStep, next_step  # noqa: E402

PROMPT, GENERATED = [1, 2, 3], [7, 8, 9]


def _running(migrated_to=None, resume=None) -> S.ClusterState:
    info = S.RequestInfo("r1", 32, "r1.0", plan=3, kv_len=5, migrated_to=migrated_to, resume=resume)
    return S.ClusterState(requests=S._frozen({"r1": info}))


def test_a_sequence_resumes_where_its_kv_is_and_replays_elsewhere():
    assert next_step(_running(), "r1", 3, 3, PROMPT, GENERATED, 0) == NextStep(None, 0, 3, [9], None)
    assert next_step(_running(migrated_to=4), "r1", 3, 4, PROMPT, GENERATED, 0) == NextStep(None, 0, 4, [9], None)  # moved with its layers
    # another plan: everything again under a new id, the prompt as a prefill then each token as a step
    assert next_step(_running(), "r1", 3, 4, PROMPT, GENERATED, 0) == NextStep("r1.1", 1, 3, PROMPT + GENERATED, 3)
    assert next_step(_running(), "r1", -1, 3, PROMPT, GENERATED, 2) == NextStep("r1.3", 3, -1, PROMPT + GENERATED, 3)  # a broken step
    assert next_step(_running(), "r1", None, 3, PROMPT, [], 0) == NextStep(None, 0, None, PROMPT, None)  # the first step


def test_a_checkpoint_on_the_plan_that_came_up_saves_replaying_what_it_holds():
    held = S.Resume(4, "r1.c2", 4)  # plan 4 holds its KV up to position 4 as r1.c2
    step = next_step(_running(resume=held), "r1", 3, 4, PROMPT, GENERATED, 1)
    assert step == NextStep("r1.c2", 2, 4, [8, 9], 1, held)  # tokens after it, each as its own decode step
    assert next_step(_running(resume=held), "r1", 3, 5, PROMPT, GENERATED, 1).resume is None  # a checkpoint on another plan
    assert next_step(_running(resume=S.Resume(4, "r1.c3", 6)), "r1", 3, 4, PROMPT, GENERATED, 1).resume is None  # holds the last token
    assert next_step(_running(resume=held), "r1", 4, 4, PROMPT, GENERATED, 1).seq is None  # fed there already: no resume


# -- the coordinator's core: inputs in, events and commands out (core.handle) ------------------------
from edgepipe.cluster.rules import core
from edgepipe.cluster.state import measurements as Mm

CONFIG = core.Config(membership.LivenessSettings(), prefix_block=2)


def test_the_core_turns_inputs_into_events_and_commands():
    state = _beating(spare=True)
    due = core.handle(state, core.HeartbeatDue(2.5, 3.0, 0.5, weight_bytes=1 << 20, kv_bytes=1 << 10), CONFIG)
    assert due.events == (S.Suspected("w2", 3.0), S.PlanAbandoned(4, "plan 4: stage w2 went silent", 3.0))
    assert due.commands == (core.FailPlan(4, "plan 4: stage w2 went silent"), core.Replan(), core.PingAll(3.0))
    starved = core.handle(state, core.HeartbeatDue(2.5, 3.0, 0.5, weight_bytes=1 << 40, kv_bytes=0), CONFIG)
    assert starved.commands == (core.PingAll(3.0),)  # the others could not hold the model: wait for w2
    later = core.handle(state, core.HeartbeatDue(10.5, 11.0, 0.5, 1 << 20, 0), CONFIG)
    assert core.LoseWorker("w2", "silent for 11.0 s (suspected, probed, no answer)") in later.commands
    pong = core.handle(state, core.PongHeard("w1", 2.95, {"computed": 3}, 3.0), CONFIG)
    assert pong.commands == (core.Measure(Mm.HeartbeatRtt("w1", pytest.approx(0.05))),) and pong.state.workers["w1"].stats["computed"] == 3
    assert core.handle(state, core.PongHeard("w1", 9.0, {}, 3.0), CONFIG).commands == ()  # a clock from the future: no rtt
    assert core.handle(state, core.FrameHeard("w1", 2.92), CONFIG).events == ()  # 20 ms after the last: nothing new
    assert core.handle(state, core.FrameHeard("w2", 3.0), CONFIG).events == (S.Heard("w2", 3.0),)
    served = core.handle(_up(PLAN), core.PrefillAsked(4, "r1", list(range(9)), True, 8), CONFIG)
    assert [type(c) for c in served.commands] == [core.CarryPrefix] and served.state.prefix.cache.pending
    assert core.handle(served.state, core.PrefillEnded("r1", True), CONFIG).state.prefix.counts.saved_blocks == 4


def test_what_the_core_returns_is_the_state_its_events_make():
    """A shell emits the core's events one by one (the log and the dashboard see them): folding
    them over the state it handed in gives the state ``handle`` returned, input after input."""
    state = _beating(spare=True)
    inputs = [core.FrameHeard("w1", 2.95), core.PongHeard("w3", 2.9, {"queue": 0}, 2.96), core.HeartbeatDue(2.5, 3.0, 0.5, 1 << 20, 0),
              core.PrefillAsked(5, "r1", list(range(7)), True, 4), core.PrefillEnded("r1", False), core.HeartbeatDue(10.5, 11.0, 0.5, 1, 0)]
    for given in inputs:
        handled = core.handle(state, given, CONFIG)
        folded = state
        for event in handled.events:
            folded = S.apply(folded, event)
        assert folded == handled.state, given
        state = handled.state


def test_a_switch_that_changes_no_layer_keeps_every_kv_where_it_is():
    same = Deployment(2, OLD.stages)  # a new plan id, every stage's worker and range unchanged
    moves = kv_moves.plan(_serving(), OLD, same, UNITS, Profile(bandwidth=10.0))
    assert moves.copies == () and moves.replay == () and moves.stay == ("r1", "r3") and moves.moved_bytes == 0
