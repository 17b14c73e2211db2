"""KV budgets count the cache of the form a worker is sent: the gguf kernel form keeps fp16 KV,
half the fp32 cache of the MatMulNBits `native` form (``Manifest.kv_bytes_per_token``). The
LOAD frame's reservation, the capacity of a plan's budgets, the requests' KV reservation, the
planner's model and switch pause, and the bytes of KV moves and checkpoints each follow it."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace as NS

import pytest

from edgepipe.cluster.rules import deploy, kv_moves
from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A
from edgepipe.cluster.rules.planning import PlannerPolicy, PlanContext
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.cluster.shells.requests import Requests
from edgepipe.model.manifest import Manifest, Unit, UnitVariant
from edgepipe.net.limits import KV_RESERVE_TOKENS
from edgepipe.net.messages import Hello

pytestmark = pytest.mark.pure  # no process, no model

FP32_KV = 2 * 2 * 64 * 4  # K and V, 2 KV heads of 64, fp32: bytes per position of one layer
N_LAYERS = 4


def _manifest() -> Manifest:
    """An embedding, four layers and a head, each in the `native` and `gguf` forms (gguf: fp16 KV)."""
    def unit(i: int, kind: str) -> Unit:
        kv = FP32_KV if kind == "layer" else 0
        variants = {"native": UnitVariant("native", f"g{i}", (f"n{i}",), 1000),
                    "gguf": UnitVariant("gguf", f"k{i}", (f"k{i}",), 800, kv_bytes_per_token=kv // 2 if kv else None)}
        return Unit(i, kind, f"u{i}", 0.01, kv, 100, variants)

    kinds = ["embed"] + ["layer"] * N_LAYERS + ["head"]
    return Manifest(1, "tiny", {}, "native", {"n_layers": N_LAYERS, "hidden_size": 128}, tuple(unit(i, k) for i, k in enumerate(kinds)),
                    {}, "tok", None, (0,), None, False, 4096)


MANIFEST = _manifest()
N = len(MANIFEST.units)


def _state(kernel: dict[str, bool], memory: int = 10**6) -> S.ClusterState:
    """Workers with (True) or without (False) the kernel library, each with a declared budget."""
    state = S.ClusterState()
    for i, (name, has_kernel) in enumerate(kernel.items()):
        hello = Hello.from_fields({"name": name, "memory_bytes": memory, "data_url": f"ws://{name}:1",
                                   "emulation": {"memory_budget": memory}, **({"native_kernel": "gguf"} if has_kernel else {})})
        state = S.apply(state, S.WorkerJoined(name, name, hello, float(i)))
    return state


def test_the_gguf_form_counts_half_the_kv_of_the_native_one():
    assert deploy.kv_bytes_per_unit(MANIFEST, "gguf") == [0] + [FP32_KV // 2] * N_LAYERS + [0]
    assert deploy.kv_bytes_per_unit(MANIFEST, "native") == deploy.kv_bytes_per_unit(MANIFEST, None) == [0] + [FP32_KV] * N_LAYERS + [0]
    # the form a budget counts: the one every worker is sent; mixed, the larger cache (it holds on each)
    assert deploy.budget_form(_state({"a": True, "b": True}), MANIFEST, None, ["a", "b"]) == "gguf"
    assert deploy.budget_form(_state({"a": True, "b": False}), MANIFEST, None, ["a", "b"]) == "native"
    assert deploy.budget_form(S.ClusterState(), MANIFEST, None, []) is None  # no worker: the package's own
    assert deploy.budget_form(_state({"a": True}), MANIFEST, "fp32", ["a"]) == "fp32"  # another precision served: no kernel form


def test_a_load_frame_reserves_the_kv_of_its_form():
    package = NS(manifest=MANIFEST, stage_graph=lambda *args, **kw: "graph")
    gguf, native = (deploy.load_message(package, 1, 1, 3, form, {"kind": "coordinator"}, []) for form in ("gguf", "native"))
    assert native.kv_bytes_per_token == 2 * FP32_KV and gguf.kv_bytes_per_token == FP32_KV


def test_kv_capacity_counts_each_workers_form():
    memory = 10**6
    plan = Deployment(1, (A("a", 0, 3), A("b", 3, N)))
    for kernel, per_position in ((True, FP32_KV), (False, 2 * FP32_KV)):  # two layers on each worker
        state = S.apply(_state({"a": kernel, "b": kernel}, memory), S.Committed(plan, 1.0))
        form = "gguf" if kernel else "native"
        precision_of = lambda w: deploy.precision_of(state, w.id, MANIFEST, None)  # noqa: E731
        weights = 3 * MANIFEST.units[0].variants[form].weight_bytes
        assert deploy.kv_capacity(state, MANIFEST, precision_of, 0) == (memory - weights) // per_position


def test_the_requests_reserve_the_kv_of_the_workers_form():
    def needs(state) -> int:
        ports = NS(package=NS(manifest=MANIFEST), settings=NS(precision=None), state=lambda: state)
        requests = Requests(ports, None, None, None, asyncio.Event(), asyncio.Event(), lambda: False, lambda step: None, deque())
        return requests.needs()[1]

    reserve = min(KV_RESERVE_TOKENS, MANIFEST.max_context)
    assert needs(_state({"a": True, "b": True})) == N_LAYERS * FP32_KV // 2 * reserve
    assert needs(_state({"a": True, "b": False})) == needs(S.ClusterState()) == N_LAYERS * FP32_KV * reserve


def test_the_planner_budgets_and_prices_the_kv_of_the_form():
    profile = ClusterProfile(MANIFEST, context_tokens=256)
    state = _state({"a": True, "b": True})
    for form, per_layer in (("gguf", FP32_KV // 2), (None, FP32_KV)):
        ctx = PlanContext(state, profile, [], 0.0, 256, 1.0, kv_form=form)
        model = PlannerPolicy().model(ctx)
        assert [u.kv_bytes_per_token for u in model.units] == [0] + [per_layer] * N_LAYERS + [0]
        assert [u.weight_bytes for u in model.units] == [1000] * N  # the weights stay those of the package's own form
    # the switch pause: the KV of the layers that change hands, at the form's bytes
    plans = [NS(stages=[NS(device_ids=("a",), start=0, end=3), NS(device_ids=("b",), start=3, end=N)]),
             NS(stages=[NS(device_ids=("a",), start=0, end=2), NS(device_ids=("b",), start=2, end=N)])]
    busy = S.apply(state, S.RequestStarted("r1", 200))
    busy = S.apply(busy, S.RequestFed("r1", "r1.0", 1, 100))
    pause = {form: PlannerPolicy._kv_pause_s(PlanContext(busy, profile, [], 0.0, 256, 1.0, kv_form=form), *plans, {"a": 1e6, "b": 1e6})
             for form in ("gguf", "native")}
    assert pause["native"] == 100 * FP32_KV / 1e6 and pause["gguf"] == pause["native"] / 2


def test_kv_moves_and_checkpoints_count_the_bytes_of_their_source():
    """A copy carries its source's cache (``deploy.worker_kv_bytes``, which checkpointing's byte
    count uses too): a move from a kernel worker counts fp16 bytes, from a fallback one fp32."""
    state = _state({"a": True, "b": False})
    old, new = Deployment(1, (A("a", 0, 3), A("b", 3, N))), Deployment(2, (A("a", 0, 4), A("b", 4, N)))
    state = S.apply(state, S.Committed(old, 1.0))
    state = S.apply(state, S.RequestStarted("r1", 200))
    state = S.apply(state, S.RequestFed("r1", "r1.0", 1, 100))
    profile = NS(link_of=lambda w: (0.001, 1e9), unit_cost=lambda start, end: 0.01 * (end - start), of=lambda w: NS(speed=1.0, overhead_s=0.0))
    kv_from = deploy.worker_kv_bytes(state, MANIFEST, None)
    assert kv_from("a") == deploy.kv_bytes_per_unit(MANIFEST, "gguf") and kv_from("b") == deploy.kv_bytes_per_unit(MANIFEST, "native")
    moves = kv_moves.plan(state, old, new, MANIFEST.units, profile, kv_from=kv_from)
    by_source = {}
    for _, cp in moves.copies:
        by_source[cp.src] = by_source.get(cp.src, 0) + (cp.end - cp.start)
    # a keeps its two layers (fp16), b hands one of its two to a and keeps the other (fp32)
    assert by_source == {"a": 2, "b": 2}
    assert moves.moved_bytes == 100 * (2 * FP32_KV // 2 + 2 * FP32_KV)
    unit_figures = kv_moves.plan(state, old, new, MANIFEST.units, profile)  # without kv_from: every copy at fp32
    assert unit_figures.moved_bytes == 100 * 4 * FP32_KV


def test_a_stage_that_keeps_fp16_kv_still_takes_an_fp32_move():
    """The LOAD reserves the stage's own cache (fp16 in the gguf form), but a fallback worker sends
    its KV in fp32 (the import converts): the data port's frame limit allows that."""
    from edgepipe.net import limits
    from edgepipe.net.messages import Load, NextHop
    from edgepipe.worker import core

    hidden, context = 16, 4096
    per_position = 8 * FP32_KV  # a stage of 8 layers: its KV frame outgrows an activation frame
    limit = {}
    for itemsize in (2, 4):
        load = Load(plan=1, start=1, end=9, graph="g", files=[], next=NextHop("coordinator"), keep=[1], max_context=context,
                    kv_bytes_per_token=per_position * itemsize // 4)
        st, _ = core.handle(core.WorkerState("w", data_url="ws://w:1"),
                            core.Built(load, core.Session("g", False, False, hidden, tuple(range(8)), None, itemsize), 100, 0, 0.1, False))
        limit[itemsize] = core.admit_data(st, 1, lambda secret: True)
    assert limit[2] == limit[4] == limits.data_frame_limit(context, hidden, per_position)
