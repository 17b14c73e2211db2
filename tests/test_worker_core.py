"""The worker core as plain functions: events in, state and commands out (no process, no model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgepipe.net.messages import Activate, Drop, ErrorCode, KvExport, Load, NextHop, Probe, parse
from edgepipe.net.protocol import Message, MessageType as T, ProtocolError, decode, encode
from edgepipe.worker import core

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

NEXT = NextHop("worker", "w9", "ws://10.0.0.9:7000", False, "s3cret")
HEAD = NextHop("coordinator")


def _load(plan=1, start=0, end=2, graph="g-0-2", nxt=NEXT, keep=(1,), **kw) -> Load:
    return Load(plan, start, end, graph, [f"f{u}" for u in range(start, end)], nxt, list(keep), max_context=64, kv_bytes_per_token=10, **kw)


def _session(graph="g-0-2", first=True, last=False, layers=(0, 1)) -> core.Session:
    return core.Session(graph, first, last, 0 if first else 8, layers, 100)


def _with_stage(state=None, load=None, session=None) -> core.WorkerState:
    state = state or core.WorkerState("n0", worker_id="w1", joins=1)
    load = load or _load()
    state, cmds = core.handle(state, core.Fetched(load, 0, 1000))
    assert [type(c) for c in cmds][-1] is core.BuildSession
    state, cmds = core.handle(state, core.Built(load, session or _session(load.graph), 1000, 0, 0.1, False))
    assert cmds[-1].msg.type is T.LOADED and cmds[-1].msg["ok"] is True
    return state


def _forward(plan=1, seqs=("a",), pos=0, x=None) -> Message:
    x = np.array([[5, 6]] * len(seqs), np.int64) if x is None else x
    return parse(Message(T.FORWARD, {"plan": plan, "batch": [{"seq": s, "step": 0, "pos": pos} for s in seqs]}, {"x": x}))


def _errors(cmds) -> list[tuple[str, str]]:
    return [(c.msg["code"], c.msg["seq"]) for c in cmds if isinstance(c, core.SendControl) and c.msg.type is T.ERROR]


def test_a_frame_for_a_plan_it_does_not_hold_is_refused_per_sequence():
    state = core.WorkerState("n0", worker_id="w1")
    _, cmds = core.handle(state, _forward(plan=7, seqs=("a", "b")))
    assert _errors(cmds) == [("no_stage", "a"), ("no_stage", "b")]


def test_a_frame_that_does_not_start_where_the_kv_ends_is_refused():
    state = _with_stage()
    _, cmds = core.handle(state, _forward(pos=3))
    assert _errors(cmds) == [("corrupt_input", "a")]
    _, cmds = core.handle(state, _forward(pos=0))
    assert [type(c) for c in cmds] == [core.RunStage] and cmds[0].inline is False  # a prefill runs in the thread


def test_activations_that_are_not_finite_are_corrupt_input():
    load = _load(start=2, end=4, graph="g-2-4")
    state = _with_stage(load=load, session=_session("g-2-4", first=False, layers=(2, 3)))
    x = np.full((1, 2, 8), np.nan, np.float32)
    _, cmds = core.handle(state, _forward(x=x))
    assert _errors(cmds) == [("corrupt_input", "a")]


def test_computed_output_goes_to_the_next_stage_with_its_secret_and_the_kv_length_is_tracked():
    state = _with_stage()
    fwd = _forward()
    state, cmds = core.handle(state, core.Computed(fwd, np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins, {"a": 2}))
    assert state.length("g-0-2", "a") == 2 and state.computed == 1
    (send,) = cmds
    assert isinstance(send, core.SendPeer) and send.url == NEXT.url and send.secret == "s3cret" and send.about is fwd
    assert send.msg["timings"][-1][0] == "w1" and send.msg["timings"][-1][2] == 2
    _, cmds = core.handle(state, _forward(pos=2))  # the next frame starts where the KV ends
    assert isinstance(cmds[0], core.RunStage)


def test_half_precision_activations_and_emulated_slowdown():
    state = replace(_with_stage(), activation_dtype="float16", slowdown=3.0, misreport=2.0)
    (run,) = core.handle(state, _forward())[1]
    assert isinstance(run, core.RunStage) and run.out_dtype == "float16"  # the compute casts (worker.runners), the core decides
    _, cmds = core.handle(state, core.Computed(_forward(), np.ones((1, 2, 8), np.float16), 0.1, None, 2, state.joins, {"a": 2}))
    wait, send = cmds
    assert isinstance(wait, core.Wait) and wait.seconds == pytest.approx(0.2)
    assert send.msg.tensors["x"].dtype == np.float16 and send.msg["timings"][-1][3] == 2
    assert send.msg["timings"][-1][1] == pytest.approx(0.15)  # (0.1 + 0.2) / 2: the misreporting device halves it


def test_a_result_from_before_a_rejoin_is_dropped():
    state = _with_stage()
    stale = core.Computed(_forward(), np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins - 1, {"a": 2})
    assert core.handle(state, stale)[1] == []


def test_the_last_stage_answers_tokens_unless_every_entry_is_a_partial_replay():
    load = _load(start=0, end=2, nxt=HEAD)
    state = _with_stage(load=load, session=_session(last=True))
    fwd = _forward(seqs=("a", "b"))
    _, cmds = core.handle(state, core.Computed(fwd, np.array([4, 9]), 0.01, None, 2, state.joins, {"a": 2, "b": 2}))
    assert cmds[0].msg.type is T.TOKEN and cmds[0].msg["tokens"] == [4, 9]
    partial = parse(Message(T.FORWARD, {"plan": 1, "batch": [{"seq": "a", "step": 0, "partial": True}]}, {"x": np.zeros((1, 2), np.int64)}))
    assert core.handle(state, core.Computed(partial, np.array([4]), 0.01, None, 2, state.joins, {"a": 2}))[1] == []


def test_a_failed_send_fails_the_frames_sequences_as_unreachable():
    state = _with_stage()
    _, cmds = core.handle(state, core.Failed(_forward(seqs=("a", "b")), ErrorCode.UNREACHABLE, "next hop unreachable"))
    assert _errors(cmds) == [("unreachable", "a"), ("unreachable", "b")]


def test_the_memory_budget_counts_kept_stages_once_and_a_reused_session_not_at_all():
    state = _with_stage(core.WorkerState("n0", worker_id="w1", joins=1, budget_bytes=2000))
    # a second plan that keeps plan 1: 1000 in use + 1000 weights + 10 B/token x 64 KV > 2000
    _, cmds = core.handle(state, core.Fetched(_load(plan=2, start=2, end=4, graph="g-2-4", keep=(1, 2)), 0, 1000))
    assert cmds[-1].msg["ok"] is False and "memory budget" in cmds[-1].msg["error"]
    # the same range again (same graph) is the same session: nothing more is needed
    _, cmds = core.handle(state, core.Fetched(_load(plan=2, keep=(1, 2)), 0, 1000))
    assert cmds[-1].msg["ok"] is True and cmds[-1].msg["reused_session"] is True


def test_a_rejoin_forgets_plans_and_sequences_but_keeps_sessions_warm():
    state = _with_stage()
    state, _ = core.handle(state, core.Computed(_forward(), np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins, {"a": 2}))
    state, cmds = core.handle(state, core.Joined("w7"))
    assert cmds == [core.Forget()] and state.stages == {} and state.held == {} and state.warm == {"g-0-2"} and state.joins == 2
    # the same range in the new membership reuses the session
    _, cmds = core.handle(state, core.Fetched(_load(plan=1), 0, 1000))
    assert cmds[-1].msg["reused_session"] is True


def test_activate_releases_sessions_no_kept_plan_uses():
    state = _with_stage()
    state = _with_stage(state, _load(plan=2, start=2, end=4, graph="g-2-4", keep=(1, 2)), _session("g-2-4", first=False, layers=(2, 3)))
    state, cmds = core.handle(state, Activate([2]))
    assert set(state.stages) == {2} and set(state.sessions) == {"g-2-4"} and cmds == [core.KeepSessions(frozenset({"g-2-4"}), frozenset({2}))]


def test_drop_forgets_the_sequence_everywhere():
    state = _with_stage()
    state, _ = core.handle(state, core.Computed(_forward(), np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins, {"a": 2}))
    state, cmds = core.handle(state, Drop("a"))
    assert state.length("g-0-2", "a") == 0 and cmds == [core.DropSequence(("g-0-2",), "a")]


def test_a_stale_frame_of_a_dropped_sequence_brings_no_kv_back():
    """Seed 1096 of the simulation: a prefill sat behind a partition while the coordinator replayed
    the request under a new id and dropped the old one; the frame then reached the next stages and
    re-created the old id's KV there, never to be freed. A dropped id that is not held is now
    discarded from frames; the other sequences of the frame run; a KV import of that id (moved back
    here) or a rejoin (a new coordinator counts ids afresh) makes its frames live again."""
    state = _with_stage()
    state, _ = core.handle(state, Drop("a"))
    _, cmds = core.handle(state, _forward(seqs=("a",)))
    assert cmds == []
    _, cmds = core.handle(state, _forward(seqs=("a", "b")))
    assert [type(c) for c in cmds] == [core.RunStage] and cmds[0].seqs == ["b"] and cmds[0].x.shape[0] == 1
    kv = parse(Message(T.KV, {"seq": "a", "plan": 1, "length": 2, "move": 4}, {}))
    moved_back, _ = core.handle(state, core.Imported(kv, "g-0-2", 2, 80))
    _, cmds = core.handle(moved_back, _forward(seqs=("a",), pos=2))
    assert [type(c) for c in cmds] == [core.RunStage] and cmds[0].seqs == ["a"]
    rejoined, _ = core.handle(state, core.Joined("w1"))
    assert rejoined.dropped == {}
    many = state
    for i in range(core.DROPPED_KEPT + 5):
        many, _ = core.handle(many, Drop(f"s{i}"))
    assert len(many.dropped) == core.DROPPED_KEPT and "a" not in many.dropped  # bounded: the oldest go first


def test_kv_moves_export_what_is_held_and_acknowledge_imports():
    state = _with_stage()
    export = KvExport("a", 1, 0, 2, 5, "ws://10.0.0.9:7000", 3)
    _, cmds = core.handle(state, export)
    assert cmds[0].msg["kv_received"] == 3 and cmds[0].msg["ok"] is False  # nothing of "a" held yet
    state, _ = core.handle(state, core.Computed(_forward(), np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins, {"a": 2}))
    _, cmds = core.handle(state, export)
    assert isinstance(cmds[0], core.ExportKv) and cmds[0].graph == "g-0-2"
    kv = parse(Message(T.KV, {"seq": "b", "plan": 1, "length": 5, "move": 4}, {}))
    state, cmds = core.handle(state, kv)
    assert isinstance(cmds[0], core.ImportKv) and cmds[0].layers == (0, 1)
    state, cmds = core.handle(state, core.Imported(kv, "g-0-2", 5, 80))
    assert state.length("g-0-2", "b") == 5 and cmds[0].msg.fields == {"kv_received": 4, "plan": 1, "ok": True, "bytes": 80}
    _, cmds = core.handle(state, core.Failed(kv, ErrorCode.BAD_INPUT, "bad tensors"))
    assert cmds[0].msg["kv_received"] == 4 and cmds[0].msg["ok"] is False


def test_probes_and_data_port_admission():
    state = _with_stage()
    _, cmds = core.handle(state, Probe(1, plan=1, reps=3))
    assert cmds == [core.TimeStage(1, "g-0-2", 3, 64, 1, 1000)]
    _, cmds = core.handle(state, Probe(1, plan=1, reps=3, rows=8))
    assert cmds == [core.TimeStage(1, "g-0-2", 3, 64, 8, 1000)]  # a batched probe, with the stage's weight bytes for a roofline
    _, cmds = core.handle(state, Probe(2, plan=9))
    assert cmds[0].msg.fields == {"probe": 2, "ok": False}
    _, cmds = core.handle(replace(state, misreport=4.0), core.StageTimed(1, [0.4, 0.8]))
    assert cmds[0].msg["times"] == [0.1, 0.2]
    _, cmds = core.handle(state, Probe(3, kind="peer", url="http://nope"))
    assert cmds[0].msg["ok"] is False and "bad url" in cmds[0].msg["error"]
    state, cmds = core.handle(state, Probe(4, kind="accept", secret="p"))
    assert state.probe_secret == "p" and cmds[0].msg["ok"] is True
    stage = replace(state.stages[1], secret="k")
    state = replace(state, stages={1: stage})
    assert core.admit_data(state, 1, lambda s: s == "k") == stage.frame_limit
    assert core.admit_data(state, 1, lambda s: s == "wrong") is None
    assert core.admit_data(state, 0, lambda s: s == "p") == core.PROBE_PLAN_FRAME_LIMIT
    assert core.admit_data(state, 5, lambda s: True) is None


def test_every_coordinator_frame_parses_to_its_type_and_bad_ones_say_why():
    load = _load()
    back = parse(decode(encode(load.to_message())))
    assert back == load and isinstance(back.next, NextHop)
    with pytest.raises(ProtocolError, match="next"):
        parse(Message(T.LOAD, {**load.to_message().fields, "next": {"kind": "elsewhere"}}))
    with pytest.raises(ProtocolError, match="unit range"):
        parse(Message(T.LOAD, {**load.to_message().fields, "start": 3, "end": 1}))
    with pytest.raises(ProtocolError, match="slowdown"):
        parse(Message(T.EMULATE, {"slowdown": float("nan")}))
    with pytest.raises(ProtocolError, match="missing field"):
        parse(Message(T.KV_EXPORT, {"seq": "a"}))
    assert parse(Message(T.DROP, {"seq": "a"})) == Drop("a")


def test_a_prefix_reuse_starts_the_frame_after_the_cached_blocks():
    state = _with_stage()
    entry = {"epoch": 1, "block": 4, "reuse": ["b0", "b1"], "save": [], "evict": []}
    fwd = parse(Message(T.FORWARD, {"plan": 1, "batch": [{"seq": "a", "step": 0, "pos": 8, "prefix": entry}]}, {"x": np.zeros((1, 3), np.int64)}))
    _, cmds = core.handle(state, fwd)
    assert isinstance(cmds[0], core.RunStage) and cmds[0].prefixes == (("a", entry),) and not cmds[0].inline
    wrong = parse(Message(T.FORWARD, {"plan": 1, "batch": [{"seq": "a", "step": 0, "pos": 0, "prefix": entry}]}, {"x": np.zeros((1, 3), np.int64)}))
    assert _errors(core.handle(state, wrong)[1]) == [("corrupt_input", "a")]
    bad = parse(Message(T.FORWARD, {"plan": 1, "batch": [{"seq": "a", "step": 0, "prefix": {"epoch": -1}}]}, {"x": np.zeros((1, 3), np.int64)}))
    assert _errors(core.handle(state, bad)[1]) == [("bad_input", "a")]
