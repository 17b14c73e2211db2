"""The control plane's pure parts, without processes: state reducer, membership, waits, KV moves, wire types."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgepipe.cluster.rules import membership, scheduling
from edgepipe.cluster.state import state as S
from edgepipe.cluster.rules.deploy import KvCopy, kv_moves
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A
from edgepipe.net.messages import Error, ErrorCode, Hello, Token, parse
from edgepipe.net.protocol import Message, MessageType as T, ProtocolError, decode, encode

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

GB = 1 << 30


def joined(*names, memory=GB, budget=True) -> S.ClusterState:
    st = S.ClusterState()
    for i, n in enumerate(names):
        hello = Hello.from_fields({"memory_bytes": memory, "emulation": {"memory_budget": memory} if budget else None})
        st = S.apply(st, S.WorkerJoined(n, n, hello, float(i)))
    return st


def test_reducer_phases_outages_and_unknown_events():
    dep = Deployment(1, (A("a", 0, 2), A("b", 2, 4)))
    st = joined("a", "b")
    st = S.apply(st, S.Preparing(dep, 1.0))
    assert st.phase is S.Phase.PREPARING and st.preparing == dep
    st = S.apply(S.apply(st, S.Committing(2.0)), S.Committed(dep, 3.0))
    assert st.phase is S.Phase.UP and st.active == dep and st.preparing is None and st.ever_up
    st = S.apply(st, S.RequestStarted("r", 10))
    st = S.apply(st, S.RequestFed("r", "r.0", 1, 5))
    st = S.apply(st, S.WorkerLost("b", "gone", 4.0))
    assert st.phase is S.Phase.DOWN and st.active is None and "b" not in st.workers
    assert st.requests["r"].plan is None  # its KV went with the plan
    st = S.apply(st, S.Committed(Deployment(2, (A("a", 0, 4),)), 6.5))
    assert st.outages == (2.5,)
    same = S.apply(st, S.Heard("nobody", 7.0))
    assert same is st  # late events about unknown workers change nothing
    st = S.apply(st, S.RequestEnded("r"))
    assert not st.requests


def test_a_silent_worker_is_suspected_then_lost_after_an_adaptive_grace():
    settings = membership.LivenessSettings(heartbeat_s=0.5, min_suspect_s=2.0, lose_after_s=10.0)
    st = joined("a")
    for i in range(1, 20):
        st = S.apply(st, S.Heard("a", i * 0.5))
    assert membership.verdicts(st, 10.0, settings) == []
    assert membership.verdicts(st, 12.0, settings) == [membership.Suspect("a", 2.5)]
    st = S.apply(st, S.Suspected("a", 12.0))
    assert membership.verdicts(st, 15.0, settings) == []  # probed, not dropped yet
    assert isinstance(membership.verdicts(st, 19.6, settings)[0], membership.Lose)
    st = S.apply(st, S.Heard("a", 30.0))  # it stalled for 20.5 s and came back: it is trusted longer now
    assert st.workers["a"].suspected_since is None
    assert membership.lose_after(st.workers["a"], settings) == pytest.approx(3 * 20.5)


def test_waits_are_bounded_with_a_reason():
    waits = scheduling.WaitSettings(capacity_wait_s=30, max_wait_s=300)
    small = joined("a", "b", memory=300_000_000)
    lacking = scheduling.shortfall(small, weight_bytes=500_000_000, kv_bytes=200_000_000, overhead_bytes=0)
    assert lacking == ("not enough memory: the 2 connected worker(s) hold 600 MB for the model, it needs 700 MB "
                       "(500 MB weights + 200 MB KV room)")
    assert scheduling.shortfall(small, weight_bytes=500_000_000, kv_bytes=100_000_000, overhead_bytes=0) is None
    assert scheduling.shortfall(small, weight_bytes=400_000_000, kv_bytes=0, overhead_bytes=100_000_000) is None
    assert scheduling.shortfall(small, weight_bytes=400_000_000, kv_bytes=0, overhead_bytes=100_001_000) is not None
    assert scheduling.wait_verdict(small, 29.0, lacking, waits) is None
    assert scheduling.wait_verdict(small, 30.0, lacking, waits).startswith("cluster lacks capacity after waiting 30 s: not enough memory")
    assert scheduling.shortfall(S.ClusterState(), 1, 0, 0) == "no workers are connected"
    assert scheduling.shortfall(joined("a", memory=1, budget=False), 10, 0, 0) is None  # no declared budget: RAM bounds it
    assert scheduling.wait_verdict(small, 300.0, None, waits).startswith("cluster not up after waiting 300 s")
    # A quarantined worker holds nothing for a plan (simulation seed 10494: the planner retried a
    # plan that could not load every 0.5 s while the quarantined worker was counted as room).
    benched = S.apply(small, S.Misbehaved("b", "dropped work", 10.0))
    assert scheduling.shortfall(benched, 500_000_000, 0, 0, now=20.0) == (
        "not enough memory: the 1 connected worker(s) (1 more suspected or quarantined) hold 300 MB for the model, "
        "it needs 500 MB (500 MB weights + 0 MB KV room)")
    assert scheduling.shortfall(benched, 500_000_000, 0, 0, now=10.0 + S.QUARANTINE_S) is None  # served its time
    assert scheduling.shortfall(S.apply(joined("a"), S.Suspected("a", 1.0)), 1, 0, 0, now=2.0) == \
        "no usable workers: 1 connected, all suspected or quarantined"


def test_kv_moves_follow_switching_diff():
    kv = [0, 1, 1, 1, 1, 0]  # embedding and head hold no KV
    old = Deployment(1, (A("a", 0, 3), A("b", 3, 6)))
    new = Deployment(2, (A("a", 0, 2), A("b", 2, 6)))
    # both ranges changed (new sessions): a keeps unit 1, b takes unit 2 from a and its own 3-4
    assert kv_moves(old, new, 6, kv) == [KvCopy("a", "a", 1, 2), KvCopy("a", "b", 2, 3), KvCopy("b", "b", 3, 5)]
    assert kv_moves(old, Deployment(3, old.stages), 6, kv) == []


def test_wire_types_check_ranges_and_codes():
    msg = Message(T.TOKEN, {"plan": 1, "batch": [{"seq": "r.0", "step": 0}], "tokens": [5], "timings": [["w", 0.1, 1, 4, 1]]})
    assert parse(msg, vocab_size=10) == Token(1, [{"seq": "r.0", "step": 0}], [5], [["w", 0.1, 1, 4, 1]])
    with pytest.raises(ProtocolError, match="not in"):
        parse(Message(T.TOKEN, {**msg.fields, "tokens": [10]}), vocab_size=10)
    with pytest.raises(ProtocolError, match="timing"):
        parse(Message(T.TOKEN, {**msg.fields, "timings": [["w", math.nan, 1]]}), vocab_size=10)
    err = parse(Message(T.ERROR, {"message": "next hop gone\nline two", "code": "unreachable", "seq": "r.0"}))
    assert err == Error("next hop gone", ErrorCode.UNREACHABLE, "r.0") and err.retryable
    assert not parse(Message(T.ERROR, {"message": "x", "code": "bad_input"})).retryable
    assert parse(Message(T.ERROR, {"message": "next hop unreachable: ws://x"})).retryable  # an older worker without codes


def test_hello_is_one_typed_message_both_ways():
    sent = Hello(name="a", token=None, protocol=1, kind="native", memory_bytes=2 * GB, threads=2, data_url="ws://127.0.0.1:9/",
                 held=("ab" * 32,), emulation={"slowdown": 2.0, "memory_budget": GB}, native_kernel="gguf")
    msg = decode(encode(sent.to_message()))
    assert set(msg.fields) == {f.name for f in dataclasses.fields(Hello)}  # nulls included, as both workers send them
    got = parse(msg)
    assert got == dataclasses.replace(sent, emulation=got.emulation) and dict(got.emulation) == sent.emulation
    assert got.memory_budget == GB and not got.relay and got.with_slowdown(3).emulation["slowdown"] == 3.0
    with pytest.raises(TypeError):
        got.emulation["slowdown"] = 9  # the declaration kept in the state is read-only
    slowed = S.apply(joined("a"), S.EmulationChanged("a", 4.0)).workers["a"].hello  # the dashboard's slowdown control
    assert dict(slowed.emulation) == {"memory_budget": GB, "slowdown": 4.0} and slowed.memory_budget == GB
    old = parse(Message(T.HELLO, {"name": "old", "kind": "browser"}))  # absent fields take their defaults
    assert (old.kind, old.memory_bytes, old.threads, old.held, old.data_url, old.relay) == ("browser", 0, 1, (), None, True)
    for bad, field in (({"kind": "toaster"}, "kind"), ({"memory_bytes": "lots"}, "memory_bytes"), ({"memory_bytes": math.inf}, "memory_bytes"),
                       ({"held": [1, 2]}, "held"), ({"emulation": [1]}, "emulation"), ({"device": "tpu"}, "device"),
                       ({"power_busy_w": -1}, "power_busy_w"), ({"name": 7}, "name")):
        with pytest.raises(ProtocolError, match=f"hello: {field}"):
            parse(Message(T.HELLO, {"name": "x", **bad}))
