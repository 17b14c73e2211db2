"""A plan that cannot load must change what the planner believes (issue 42, item 1).

The loop the issue found: a tab joined a memory-tight cluster, the planner priced every device
with the tab's fp32 KV (and the package's `native` weights), judged the running gguf plan to "no
longer fit", and prepared a plan whose LOAD a worker refused (a new stage is loaded beside the
running one) — the same plan again twice a second, for ever. Here, as pure decisions: each device
is priced in its own form; a worker's room for a new stage is its budget less what its running
stage holds, or what it reported when it refused (``deploy.new_stage_room``); a plan is only
deployed where every stage loads beside the running one (``planning.loadable_beside``), else the
running plan stays and says so once; the plan that just failed is not prepared again in a row.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace as NS

import pytest

from edgepipe.cluster.rules import deploy
from edgepipe.cluster.shells import narrate
from edgepipe.cluster.state import state as S
from edgepipe.cluster.shells.deployer import retry_after_s
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A
from edgepipe.cluster.rules.planning import PlanContext, PlannerPolicy
from edgepipe.cluster.rules.profiling import RUNTIME_OVERHEAD_BYTES as O, ClusterProfile
from edgepipe.cluster.shells.requests import Requests
from edgepipe.model.manifest import Manifest, Unit, UnitVariant
from edgepipe.net.messages import Hello, Load, Loaded, NextHop, parse, plan_label
from edgepipe.worker import core

pytestmark = pytest.mark.pure  # no process, no model

MB = 10**6
NATIVE_W, GGUF_W = 40 * MB, 30 * MB  # every unit's weights in each form
KV = 8192  # a layer's KV bytes per position, fp32 (the `native` form; `gguf` keeps half)
CONTEXT = 2048
N = 6  # an embedding, four layers, a head


def _manifest() -> Manifest:
    def unit(i: int, kind: str) -> Unit:
        kv = KV if kind == "layer" else 0
        variants = {"native": UnitVariant("native", f"n{i}", (f"n{i}",), NATIVE_W),
                    "gguf": UnitVariant("gguf", f"k{i}", (f"k{i}",), GGUF_W, kv_bytes_per_token=kv // 2 if kv else None)}
        return Unit(i, kind, f"u{i}", 0.01, kv, 100, variants)

    kinds = ["embed"] + ["layer"] * (N - 2) + ["head"]
    return Manifest(1, "tiny", {}, "native", {"n_layers": N - 2, "hidden_size": 128}, tuple(unit(i, k) for i, k in enumerate(kinds)),
                    {}, "tok", None, (0,), None, False, 4096)


MANIFEST = _manifest()


def _join(state: S.ClusterState, name: str, memory: int, kernel: bool = True, at: float = 0.0) -> S.ClusterState:
    hello = Hello.from_fields({"name": name, "memory_bytes": memory, "data_url": f"ws://{name}:1", "emulation": {"memory_budget": memory},
                               **({"native_kernel": "gguf"} if kernel else {})})
    return S.apply(state, S.WorkerJoined(name, name, hello, at))


def _context(state: S.ClusterState, profile: ClusterProfile, names: list[str]) -> PlanContext:
    """What the coordinator gives the plan function (``Coordinator.plan_context``)."""
    workers = [state.workers[n] for n in names]
    forms = deploy.worker_forms(state, MANIFEST, None, names)
    return PlanContext(state, profile, workers, 10.0, CONTEXT, 1.0, deploy.budget_form(state, MANIFEST, None, names), forms,
                       deploy.new_stage_room(state, MANIFEST, forms, O))


def _stages(stages) -> list[tuple[str, int, int]]:
    return [(s.worker_id, s.start, s.end) for s in stages]


def test_a_joining_device_of_another_form_leaves_the_running_plan_as_it_was():
    """Two kernel workers run a gguf plan that fits their budgets (weights 90 MB + fp16 KV 17 MB +
    runtime 67 MB each); a worker without the kernel library (the `native` form, fp32 KV) joins.
    Priced as before the fix (every device with the joiner's KV and the package's `native`
    weights) the running plan needs 221 MB of each 215 MB and "no longer fits"; priced in each
    device's own form it still fits and stays."""
    memory = 215 * MB
    running = Deployment(1, (A("a", 0, 3), A("b", 3, N)))
    state = _join(_join(S.ClusterState(), "a", memory), "b", memory, at=1.0)
    state = S.apply(state, S.Committed(running, 2.0))
    state = _join(state, "tab", 100 * MB, kernel=False, at=3.0)
    profile = ClusterProfile(MANIFEST, context_tokens=CONTEXT)
    policy = PlannerPolicy()
    stages, reason, predicted = policy(_context(state, profile, ["a", "b", "tab"]))
    assert "no longer fits" not in reason, reason
    assert deploy.stay_reason(state.active, stages, False, predicted.get("switch")) is not None, (reason, _stages(stages))
    # the running plan's own figures: gguf weights and fp16 KV on each of its devices
    _, model, devices, _, _ = policy.last_result
    form = {d.id: d.precision for d in devices}
    assert form == {"a": "gguf", "b": "gguf", "tab": "native"}
    assert model.stage_bytes(0, 3, 1, "gguf") == 3 * GGUF_W + 2 * KV // 2 * CONTEXT + O <= memory
    assert model.stage_bytes(0, 3, 1, "native") == 3 * NATIVE_W + 2 * KV * CONTEXT + O > memory


def test_the_room_for_a_new_stage_is_the_budget_less_the_running_stage_or_what_the_worker_reported():
    memory = 300 * MB
    state = _join(_join(S.ClusterState(), "a", memory), "b", memory)
    assert deploy.new_stage_room(state, MANIFEST, {}, O) == {}  # nothing runs: every budget is whole
    state = S.apply(state, S.Committed(Deployment(1, (A("a", 0, 4), A("b", 4, N))), 1.0))
    forms = deploy.worker_forms(state, MANIFEST, None, ["a", "b"])
    room = deploy.new_stage_room(state, MANIFEST, forms, O)
    assert room == {"a": memory - 4 * GGUF_W + O, "b": min(memory, memory - 2 * GGUF_W + O)}  # never beyond the declared budget
    # a refused LOAD beside plan 1: its figures replace the guess (the worker holds more than its weights)
    refused = S.LoadRefused("a", 2, 0, 3, needed_bytes=120 * MB, free_bytes=90 * MB, budget_bytes=280 * MB, beside=1, now=2.0)
    state = S.apply(state, refused)
    assert deploy.new_stage_room(state, MANIFEST, forms, O)["a"] == 90 * MB + O
    # another plan runs: what it holds is its new stage, the budget the one it reported
    state = S.apply(state, S.Committed(Deployment(3, (A("a", 0, 2), A("b", 2, N))), 3.0))
    assert deploy.new_stage_room(state, MANIFEST, forms, O)["a"] == 280 * MB - 2 * GGUF_W + O
    # a worker that refused with nothing running holds its reported budget in any plan
    state = _join(state, "c", memory)
    state = S.apply(state, S.LoadRefused("c", 4, 0, N, 400 * MB, 150 * MB, 150 * MB, None, 4.0))
    assert deploy.new_stage_room(state, MANIFEST, forms, O)["c"] == 150 * MB + O
    state = S.apply(state, S.WorkerLost("c", "gone", 5.0))
    assert "c" not in state.refusals and "c" not in deploy.new_stage_room(state, MANIFEST, forms, O)


def _pool(c_speed: float | None):
    """``a`` runs the whole model (285 MB of budget, 281 MB used); ``b`` joins ten times faster with
    room for two layers and the head; ``c`` (when given a speed) has room for the first three units."""
    state = _join(S.ClusterState(), "a", 285 * MB)
    state = S.apply(state, S.Committed(Deployment(1, (A("a", 0, N),)), 1.0))
    state = _join(state, "b", 200 * MB, at=2.0)
    names = ["a", "b"]
    profile = ClusterProfile(MANIFEST, context_tokens=CONTEXT)
    profile.of("b").speed = 10.0
    if c_speed is not None:
        state = _join(state, "c", 200 * MB, at=3.0)
        profile.of("c").speed = c_speed
        names.append("c")
    return state, profile, names


def test_a_plan_that_cannot_load_beside_the_running_one_is_not_deployed():
    """The faster plan gives ``a`` the first three units beside the six it runs: 174 MB where 172 MB
    are left. Without a device that could take them instead, the running plan stays and says why
    in one line; with one (``c``, slightly slower than ``a``), the plan uses it."""
    state, profile, names = _pool(None)
    ctx = _context(state, profile, names)
    blind = PlannerPolicy()(PlanContext(*[getattr(ctx, f) for f in ("state", "profile", "workers", "now", "kv_positions", "recovery_s",
                                                                      "kv_form", "forms")]))
    assert _stages(blind[0]) == [("a", 0, 3), ("b", 3, N)]  # the plan the old planner deployed, and a refused
    stages, reason, predicted = PlannerPolicy()(ctx)
    assert _stages(stages) == [("a", 0, N)] and deploy.stay_reason(state.active, stages, False, None) == "same plan"
    assert predicted["kept"] == reason and reason.startswith("keeping plan 1: no other plan loads beside it (a would need 174 MB, 172 MB free")
    assert "\n" not in reason

    state, profile, names = _pool(0.9)
    stages, reason, _ = PlannerPolicy()(_context(state, profile, names))
    assert "c" in {s.worker_id for s in stages} and "b" in {s.worker_id for s in stages}, reason
    assert all(_need(s) <= 172 * MB + O for s in stages if s.worker_id == "a"), _stages(stages)  # a's share loads beside its own


def _need(s) -> int:
    """Bytes the planner counts for stage ``s`` in the gguf form (its weights, fp16 KV, the runtime)."""
    return ClusterProfile(MANIFEST, CONTEXT).model_profile(kv_form="gguf", forms=["gguf"]).stage_bytes(s.start, s.end, 1, "gguf")


def test_a_device_that_refused_with_nothing_running_is_planned_with_the_budget_it_reported():
    """Down, no plan running: a worker that declared 300 MB refused the whole model with 200 MB of
    budget. The next plan gives it no more than 200 MB (it would have been the same plan again)."""
    state = _join(_join(S.ClusterState(), "a", 300 * MB), "b", 200 * MB, at=1.0)
    profile = ClusterProfile(MANIFEST, context_tokens=CONTEXT)
    profile.of("b").speed = 0.5
    first, _, _ = PlannerPolicy()(_context(state, profile, ["a", "b"]))
    assert _stages(first) == [("a", 0, N)]
    state = S.apply(state, S.LoadRefused("a", 1, 0, N, 214 * MB, 200 * MB, 200 * MB, None, 2.0))
    again, reason, _ = PlannerPolicy()(_context(state, profile, ["a", "b"]))
    assert _stages(again) != _stages(first) and again, reason
    assert all(_need(s) <= 200 * MB + O for s in again if s.worker_id == "a")


def test_the_plan_that_just_failed_is_not_prepared_again_in_a_row():
    state = _join(_join(S.ClusterState(), "a", 300 * MB), "b", 300 * MB)
    one, two = Deployment(1, (A("a", 0, N),)), Deployment(2, (A("a", 0, 3), A("b", 3, N)))
    down = S.apply(S.apply(state, S.Preparing(two, 1.0)), S.PrepareFailed(2, "refused", 1.5))
    assert not deploy.repeats_failure(down, two.stages, 2.0)  # down: retrying is how it comes up
    state = S.apply(state, S.Committed(one, 1.0))
    state = S.apply(S.apply(state, S.Preparing(two, 2.0)), S.PrepareFailed(2, "plan 2 failed to load", 2.5))
    assert deploy.repeats_failure(state, two.stages, 3.0) and not deploy.repeats_failure(state, one.stages, 3.0)
    assert not deploy.repeats_failure(_join(state, "c", 300 * MB), two.stages, 3.0)  # membership changed: it may be tried
    assert not deploy.repeats_failure(state, two.stages, 2.5 + deploy.FAILED_PLAN_HOLD_S)  # a passing failure is tried again, later
    assert [retry_after_s(n, 5.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_refused_load_carries_its_figures_over_the_wire():
    """The worker core answers a LOAD over its budget with what the stage needs, what was free and
    its budget; the coordinator's parse keeps them (and refuses a negative one)."""
    load = Load(plan=2, start=0, end=3, graph="g2", files=[], next=NextHop("coordinator"), keep=[2, 1], max_context=4096, kv_bytes_per_token=1000)
    held = core.Stage(1, 3, N, "g1", NextHop("coordinator"), 150 * MB)
    state = core.WorkerState("w", budget_bytes=250 * MB, data_url="ws://w:1", stages={1: held})
    _, commands = core.handle(state, core.Fetched(load, 0, 120 * MB))
    reply = parse(commands[0].msg)
    assert isinstance(reply, Loaded) and not reply.ok
    assert (reply.needed_bytes, reply.free_bytes, reply.budget_bytes) == (120 * MB + 1000 * 2048, 100 * MB, 250 * MB)
    bad = Loaded(ok=False, plan=2, error="x", needed_bytes=-1).to_message()
    with pytest.raises(Exception):
        parse(bad)


def test_the_capacity_figures_are_those_of_the_form_the_workers_run():
    """Issue 42 item 9: kernel workers run the gguf form, so the model needs its weights and KV
    (the `native` figures only where a worker runs that form)."""
    def needs(state) -> tuple[int, int]:
        ports = NS(package=NS(manifest=MANIFEST), settings=NS(precision=None), state=lambda: state)
        return Requests(ports, None, None, None, asyncio.Event(), asyncio.Event(), lambda: False, lambda step: None, deque()).needs()

    kernel = _join(_join(S.ClusterState(), "a", 10**9), "b", 10**9)
    assert needs(kernel)[0] == N * GGUF_W
    assert needs(_join(kernel, "c", 10**9, kernel=False))[0] == N * NATIVE_W


def test_the_dashboard_lines_of_a_kept_plan_and_of_a_spare():
    state = _join(_join(S.ClusterState(), "a", 300 * MB), "b", 300 * MB)
    kept = S.Noted(S.NoteKind.PLAN_KEPT, {"plan": 1, "why": "keeping plan 1: no other plan loads beside it"}, 1.0)
    assert narrate.describe(narrate.entry(kept, state, None, 0.0)) == "keeping plan 1: no other plan loads beside it"
    assert narrate.entry(S.PlanFailed("no complete plan", attempted=False), state, None, 0.0) is None
    spare = (A("a", 0, 3), A("b", 3, N))
    state = S.apply(state, S.SpareChosen(spare))
    assert narrate.entry(S.SpareChosen(spare), state, None, 0.0) is None  # chosen is not ready
    state = S.apply(state, S.SpareLoaded(-1, spare, "a", True))
    assert narrate.entry(S.SpareLoaded(-1, spare, "a", True), state, None, 0.0) is None  # one of two built
    files_only = S.apply(state, S.SpareLoaded(-1, spare, "b", False))
    assert narrate.entry(S.SpareLoaded(-1, spare, "b", False), files_only, None, 0.0) is None  # files, no session: not ready
    state = S.apply(state, S.SpareLoaded(-1, spare, "b", True))
    line = narrate.entry(S.SpareLoaded(-1, spare, "b", True), state, None, 0.0)
    assert narrate.describe(line) == "spare plan ready: a [0, 3), b [3, 6)"


def test_worker_logs_name_calibration_and_the_spare_not_negative_plan_ids():
    assert [plan_label(p) for p in (3, -1, -10_000, -10_007)] == ["plan 3", "the spare plan", "calibration", "calibration"]
