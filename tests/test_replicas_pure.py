"""Replicated stages, the pure parts: the deployment's groups, which replica a sequence's route
uses (balanced, sticky, deterministic), what a replica's loss does, the next hops a stage is
loaded with, the frame's hop at the worker, lanes per route, KV capacity and plan pricing."""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.cluster.rules import deploy, replicas
from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.batching import LaneAsked, LaneBook, LaneItem, LaneReturned, departures
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A, stage_groups
from edgepipe.cluster.rules.planning import assignments, running_plan
from edgepipe.net.messages import Hello, Load, NextHop, parse
from edgepipe.net.protocol import Message, MessageType as T, decode, encode
from edgepipe.plan import Objective, PlanRequest, Stage
from edgepipe.worker import core

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

PLAN = Deployment(4, (A("a", 0, 3), A("b", 3, 8), A("c", 3, 8)))  # the last stage on b and c
FLAT = Deployment(5, (A("a", 0, 3), A("b", 3, 8)))


def _hello(name: str, memory: int = 1 << 30, **kw) -> Hello:
    return Hello(name=name, token=None, protocol=1, kind="native", memory_bytes=memory, threads=2, data_url=f"ws://{name}:1", held=(), **kw)


def _state(*rids, plan=PLAN, positions=None) -> S.ClusterState:
    st = S.ClusterState()
    for w in "abc":
        st = S.apply(st, S.WorkerJoined(w, w, _hello(w), 0.0))
    for rid in rids:
        st = S.apply(st, S.RequestStarted(rid, (positions or {}).get(rid, 100)))
    return st


def _route(st, rid, plan=PLAN):
    route = replicas.choose_route(plan, st.requests, rid)
    return S.apply(st, S.Routed(rid, plan.plan_id, route)), route


def test_groups_are_consecutive_assignments_of_one_range():
    assert [[s.worker_id for s in g] for g in PLAN.groups] == [["a"], ["b", "c"]]
    assert PLAN.replicated and not FLAT.replicated and PLAN.workers == ("a", "b", "c")
    with pytest.raises(ValueError, match="contiguous"):
        Deployment(1, (A("a", 0, 3), A("b", 3, 8), A("c", 2, 8)))
    with pytest.raises(ValueError, match="worker b twice"):
        Deployment(1, (A("a", 0, 3), A("b", 3, 8), A("b", 3, 8)))


def test_routes_balance_the_replicas_and_stick():
    st = _state("q1", "q2", "q3", "q4")
    seen = []
    for rid in ("q1", "q2", "q3", "q4"):
        st, route = _route(st, rid)
        seen.append(route)
    assert seen == [("a", "b"), ("a", "c"), ("a", "b"), ("a", "c")]
    assert replicas.routed(st.requests, PLAN, "q3") == ("a", "b")  # sticky: what the state recorded
    assert replicas.routed(st.requests, FLAT, "q3") is None  # a route holds on its plan only
    st = S.apply(st, S.RequestFed("q3", "q3.0", PLAN.plan_id, 40))
    assert replicas.routed(st.requests, PLAN, "q3") == ("a", "b")  # a fed step keeps it


def test_routes_weigh_reserved_kv_when_the_counts_tie():
    st = _state("long", "short", "new", positions={"long": 900, "short": 10, "new": 50})
    st, _ = _route(st, "long")
    st = S.apply(st, S.Routed("short", PLAN.plan_id, ("a", "c")))
    assert replicas.choose_route(PLAN, st.requests, "new") == ("a", "c")  # 1 vs 1 sequences: c holds less KV
    ended = S.apply(st, S.RequestEnded("long"))
    assert replicas.choose_route(PLAN, ended.requests, "new") == ("a", "b")  # an ended sequence no longer counts


def test_a_plan_without_replicas_has_one_route_and_nothing_recorded():
    assert replicas.choose_route(FLAT, _state("q1").requests, "q1") == ("a", "b")
    assert replicas.path(PLAN, ("a", "c")) == (A("a", 0, 3), A("c", 3, 8))
    assert replicas.valid_route(PLAN, ("a", "c")) and not replicas.valid_route(PLAN, ("a",)) and not replicas.valid_route(PLAN, ("b", "c"))
    assert replicas.last_stage(PLAN, "c") and replicas.last_stage(PLAN, "b") and not replicas.last_stage(PLAN, "a")


def test_a_replica_loss_takes_the_plan_down_and_names_its_sequences():
    st = _state("q1", "q2", "q3")
    for rid in ("q1", "q2", "q3"):
        st, _ = _route(st, rid)
    st = S.apply(st, S.Committed(PLAN, 1.0))
    loss = replicas.replica_loss(st.active, st.requests, "c")
    assert loss == replicas.ReplicaLoss("c", ("b",), plan_down=True, sequences=("q2",))
    assert replicas.replica_loss(st.active, st.requests, "a") == replicas.ReplicaLoss("a", (), True, ("q1", "q2", "q3"))  # on every route
    assert replicas.replica_loss(st.active, st.requests, "zz") is None
    down = S.apply(st, S.WorkerLost("c", "killed", 2.0))
    assert down.active is None and down.phase is S.Phase.DOWN and all(q.plan is None for q in down.requests.values())


def test_each_stage_is_loaded_with_every_replica_of_the_next_as_its_hops():
    workers = {w: S.WorkerInfo(w, w, _hello(w), 0.0, 0.0) for w in "abc"}
    stages = PLAN.stages
    hop = deploy.next_hop(stages, 0, workers, ["s-a", "s-b", "s-c"])
    assert hop["id"] == "b" and hop["secret"] == "s-b" and [(h["id"], h["secret"]) for h in hop["replicas"]] == [("c", "s-c")]
    assert deploy.next_hop(stages, 1, workers, ["s-a", "s-b", "s-c"]) == {"kind": "coordinator"}
    assert deploy.next_hop(stages, 2, workers, ["s-a", "s-b", "s-c"]) == {"kind": "coordinator"}
    assert "replicas" not in deploy.next_hop(FLAT.stages, 0, workers, ["s-a", "s-b"])
    assert replicas.neighbour_pairs(stages) == [("a", "b"), ("a", "c")]


def test_the_worker_sends_each_row_to_the_replica_on_its_route():
    nxt = NextHop.of({"kind": "worker", "id": "b", "url": "ws://b:1", "secret": "s-b",
                      "replicas": [{"kind": "worker", "id": "c", "url": "ws://c:1", "secret": "s-c"}]})
    load = Load(4, 0, 3, "g-0-3", ["f0"], nxt, [4], max_context=64, kv_bytes_per_token=10)
    assert parse(decode(encode(load.to_message()))) == load  # the hops survive the wire
    state = core.WorkerState("n0", worker_id="a", joins=1)
    state, _ = core.handle(state, core.Fetched(load, 0, 1000))
    state, _ = core.handle(state, core.Built(load, core.Session("g-0-3", True, False, 0, (0, 1, 2), 100), 1000, 0, 0.1, False))
    for route, url, secret in ((["a", "c"], "ws://c:1", "s-c"), (["a", "b"], "ws://b:1", "s-b"), (None, "ws://b:1", "s-b")):
        item = {"seq": "q.0", "step": 0, "pos": 0, **({"route": route} if route else {})}
        fwd = parse(Message(T.FORWARD, {"plan": 4, "batch": [item]}, {"x": np.array([[5, 6]], np.int64)}))
        _, cmds = core.handle(state, core.Computed(fwd, np.zeros((1, 2, 8), np.float32), 0.01, None, 2, state.joins, {"q.0": 2}))
        (send,) = cmds
        assert (send.url, send.secret) == (url, secret)
        assert send.msg["batch"][0].get("route") == route  # the route rides on to the next stage
    # a batch whose sequences use both replicas: a frame per replica, each with its rows
    batch = [{"seq": f"q{i}.0", "step": 0, "pos": 0, "route": ["a", "bc"[i % 2]]} for i in range(3)]
    out = np.arange(3 * 2 * 8, dtype=np.float32).reshape(3, 2, 8)
    fwd = parse(Message(T.FORWARD, {"plan": 4, "batch": batch}, {"x": np.array([[5, 6]] * 3, np.int64)}))
    _, cmds = core.handle(state, core.Computed(fwd, out, 0.01, None, 2, state.joins, {f"q{i}.0": 2 for i in range(3)}))
    sent = {c.url: ([item["seq"] for item in c.msg["batch"]], c.msg.tensors["x"]) for c in cmds}
    assert sorted(sent) == ["ws://b:1", "ws://c:1"]
    assert sent["ws://b:1"][0] == ["q0.0", "q2.0"] and np.array_equal(sent["ws://b:1"][1], out[[0, 2]])
    assert sent["ws://c:1"][0] == ["q1.0"] and np.array_equal(sent["ws://c:1"][1], out[[1]])
    timings = {c.url: c.msg["timings"] for c in cmds}
    assert len(timings["ws://b:1"]) == 1 and timings["ws://c:1"] == []  # this stage's time counts once


def test_a_lane_goes_out_as_one_frame_per_first_stage_replica():
    def fold(*events):  # the lanes as the state holds them: the batches the events let go
        nonlocal book
        out = []
        for event in events:
            gone = departures(book, event)
            book, out = gone.book, out + [sorted(i.rid for i in b) for b in gone.batches]
        return out

    book = LaneBook()
    assert fold(LaneAsked(LaneItem("q1", 4, 1, ("a", "b")), 1)) == [["q1"]]  # alone: at once
    assert fold(LaneAsked(LaneItem("q2", 4, 2, ("a", "c")), 1)) == []  # waits for its lane (q1 is flying)
    # one first stage: one frame (its worker splits it)
    assert fold(LaneReturned("q1"), LaneAsked(LaneItem("q1", 4, 3, ("a", "b")), 1)) == [["q1", "q2"]]
    book = LaneBook()
    fold(LaneAsked(LaneItem("q1", 4, 1, ("b", "a")), 1), LaneAsked(LaneItem("q2", 4, 2, ("c", "a")), 1))
    batches = fold(LaneReturned("q1"), LaneAsked(LaneItem("q1", 4, 3, ("b", "a")), 1))
    assert sorted(batches) == [["q1"], ["q2"]]  # a replicated first stage: a frame per replica


def test_kv_capacity_counts_every_replica_of_a_stage():
    manifest = _Manifest(units=8, weight=10, kv=1)
    st = S.ClusterState(workers={w: S.WorkerInfo(w, w, _hello(w, 1000, emulation={"memory_budget": 1000}), 0.0, 0.0) for w in "abc"})
    st = S.apply(st, S.Committed(PLAN, 1.0))
    # a: 1000 - 3 x 10 weights over 3 units of KV per position; b and c: 1000 - 50 over 5 each, twice
    assert deploy.kv_capacity(st, manifest, lambda w: None, 0) == min((1000 - 30) // 3, 2 * ((1000 - 50) // 5))
    flat = S.apply(st, S.Committed(FLAT, 2.0))
    assert deploy.kv_capacity(flat, manifest, lambda w: None, 0) == (1000 - 50) // 5


def test_the_planner_and_the_runtime_agree_on_replicated_stages():
    planned = (Stage(("a",), 0, 3), Stage(("b", "c"), 3, 8))
    assert assignments(planned) == list(PLAN.stages)
    assert running_plan(PLAN, _Model(8), PlanRequest(objective=Objective.THROUGHPUT)).stages == planned
    assert [(s.device_ids, s.start, s.end) for s in deploy.as_plan(PLAN, 8).stages] == [(("a",), 0, 3), (("b", "c"), 3, 8)]
    assert deploy.kv_moves(FLAT, PLAN, 8, [1] * 8) == [] and deploy.kv_moves(PLAN, FLAT, 8, [1] * 8) == []  # no route: replayed


def test_a_switch_moves_each_sequences_kv_between_its_routes_replicas():
    kv = [0] + [1] * 6 + [0]  # embedding and head hold no KV
    assert deploy.kv_moves(FLAT, PLAN, 8, kv, None, ("a", "b")) == []  # its KV stays on a and b
    assert deploy.kv_moves(FLAT, PLAN, 8, kv, None, ("a", "c")) == [deploy.KvCopy("b", "c", 3, 7)]
    other = Deployment(6, (A("a", 0, 4), A("c", 4, 8)))
    assert deploy.kv_moves(PLAN, other, 8, kv, ("a", "b"), None) == [deploy.KvCopy("a", "a", 1, 3), deploy.KvCopy("b", "a", 3, 4),
                                                                      deploy.KvCopy("b", "c", 4, 7)]
    assert deploy.kv_moves(PLAN, other, 8, kv, ("a", "c"), None) == [deploy.KvCopy("a", "a", 1, 3), deploy.KvCopy("c", "a", 3, 4),
                                                                      deploy.KvCopy("c", "c", 4, 7)]  # a new range: a new session
    assert stage_groups(()) == ()


class _Unit:
    def __init__(self, index, weight, kv):
        self.index, self.weight_bytes, self.kv_bytes_per_token = index, weight, kv


class _Manifest:
    def __init__(self, units, weight, kv):
        self.units = [_Unit(i, weight, kv) for i in range(units)]
        self.weight = weight

    def variant(self, index, precision):
        return self.units[index]

    def kv_bytes_per_token(self, index, precision=None):
        return self.units[index].kv_bytes_per_token


class _Model:
    def __init__(self, n_units):
        self.n_units = n_units
