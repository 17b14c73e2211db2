"""The roofline device emulation and the planner's price of batched steps (pure: no process, no model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgepipe.emulate.roofline import RooflinePolicy
from edgepipe.net.messages import Probe, parse
from edgepipe.net.protocol import Message, MessageType as T
from edgepipe.plan import DeviceProfile, Objective, PlanRequest, evaluate, plan, transformer_profile
from edgepipe.plan.plan import Stage
from edgepipe.plan.profiles import LinkProfile, NetworkProfile
from edgepipe.worker import core
from edgepipe.worker.settings import WorkerSettings

pytestmark = pytest.mark.pure


# -- the policy ------------------------------------------------------------------------------------------------
def test_a_step_is_the_slower_of_streaming_the_weights_and_the_rows_arithmetic():
    device = RooflinePolicy(flops=40e9, bandwidth=5e9, overhead_s=0.002, bytes_per_parameter=0.5)
    weights = 50_000_000  # 100 M parameters: 0.2 GFLOP per row
    assert device.flops_per_row(weights) == pytest.approx(0.2e9)
    assert device.step_s(weights, 1) == pytest.approx(0.002 + 0.01)  # memory-bound: 50 MB at 5 GB/s
    assert device.step_s(weights, 16) == pytest.approx(0.002 + 16 * 0.005)  # compute-bound: 3.2 GFLOP at 40 GFLOP/s
    assert device.step_s(weights, 2) == device.step_s(weights, 1)
    assert device.knee_rows() == pytest.approx(2)  # rows where both take the same time
    assert device.extra_wait(0.005, weights, 1) == pytest.approx(0.007)  # the real compute counts toward the step
    assert device.extra_wait(1.0, weights, 1) == 0.0  # a host slower than the device: no wait (the benchmark checks this)


def test_a_memory_bound_device_batches_almost_for_free_a_compute_bound_one_does_not():
    phone = RooflinePolicy(flops=8e9, bandwidth=10e9)
    box = RooflinePolicy(flops=1000e9, bandwidth=10e9)  # knee at 31 rows
    w = 60_000_000
    assert phone.step_s(w, 16) / phone.step_s(w, 1) == pytest.approx(16)
    assert box.step_s(w, 16) / box.step_s(w, 1) == pytest.approx(1)


def test_parse_label_and_bad_specs():
    device = RooflinePolicy.parse("20e9, 8GB, 2")
    assert (device.flops, device.bandwidth, device.overhead_s) == (20e9, 8e9, 0.002)
    assert RooflinePolicy.parse(device.spec()) == device
    assert device.label().startswith("emulated") and device.emulated
    for bad, says in (("20e9", "FLOPS,BANDWIDTH"), ("x,8GB", "not a number"), ("20e9,8XB", "unknown unit"),
                      ("0,8GB", "flops must be"), ("20e9,8GB,-1", "overhead"), ("20e9,8GB,z", "OVERHEAD_MS")):
        with pytest.raises(ValueError, match=says):
            RooflinePolicy.parse(bad)
    with pytest.raises(ValueError, match="give one"):
        WorkerSettings("http://c", roofline="20e9,8GB", slowdown=2.0)
    settings = WorkerSettings("http://c", roofline="20e9,8GB,1")
    assert settings.emulated and settings.emulation()["roofline"]["flops"] == 20e9


# -- the worker waits as the emulated device would -------------------------------------------------------------
def _stage_state(roofline: RooflinePolicy) -> core.WorkerState:
    from tests.test_worker_core import _with_stage

    return replace(_with_stage(), roofline=roofline)


def _computed(state: core.WorkerState, rows: int, positions: int, compute_s: float) -> list:
    batch = [{"seq": f"s{i}", "pos": 0} for i in range(rows)]
    msg = parse(Message(T.FORWARD, {"plan": 1, "batch": batch}, {"x": np.zeros((rows, positions, 8), np.float32)}))
    out = np.zeros((rows, positions, 8), np.float32)
    return core.handle(state, core.Computed(msg, out, compute_s, None, positions, state.joins, {}))[1]


def test_the_worker_waits_out_the_roofline_step_by_rows_and_positions():
    device = RooflinePolicy(flops=1e9, bandwidth=1e9, overhead_s=0.001, bytes_per_parameter=1.0)  # stage: 1000 weight bytes
    state = _stage_state(device)
    cmds = _computed(state, rows=1, positions=1, compute_s=0.0)
    assert isinstance(cmds[0], core.Wait) and cmds[0].seconds == pytest.approx(0.001 + 2e-6)
    cmds = _computed(state, rows=4, positions=3, compute_s=0.0001)  # 12 rows of 2000 FLOP
    assert cmds[0].seconds == pytest.approx(0.001 + 12 * 2e-6 - 0.0001)
    timing = cmds[-1].msg["timings"][-1]
    assert timing[1] == pytest.approx(0.001 + 12 * 2e-6)  # reported: the emulated step


def test_the_head_is_charged_a_rows_last_position_not_every_prompt_position():
    """A prefill of P positions on a stage holding the head: its layers compute P positions a row,
    the head one (``graphs.head_unit``); charging the head P times made head stages look slower."""
    device = RooflinePolicy(flops=1e9, bandwidth=1e12, overhead_s=0.0, bytes_per_parameter=1.0)
    assert device.step_s(1000, 12, head_bytes=400, head_rows=4) == pytest.approx((12 * 1200 + 4 * 800) / 1e9)
    assert device.step_s(1000, 12, head_bytes=400) == device.step_s(1000, 12)  # head rows default: every row
    with pytest.raises(ValueError, match="head bytes"):
        device.step_s(1000, 1, head_bytes=2000)
    state = _stage_state(device)
    stage = replace(state.stages[1], head_bytes=400)
    state = replace(state, stages={**state.stages, 1: stage})
    cmds = _computed(state, rows=4, positions=3, compute_s=0.0)  # 4 sequences x 3 prompt positions
    assert cmds[0].seconds == pytest.approx(device.step_s(stage.compute_bytes, 12, 400, 4))
    assert cmds[0].seconds < device.step_s(stage.compute_bytes, 12)


# -- the planner prices batched steps --------------------------------------------------------------------------
def _model():
    return transformer_profile("toy", 8, layer_cost=0.01, layer_bytes=10_000_000, kv_bytes_per_token=1000, hidden_bytes=4096,
                               embed_bytes=1_000_000, head_cost=0.01, head_bytes=5_000_000, context_tokens=512)


def _network():
    return NetworkProfile((), LinkProfile("*", "*", 0.001, 1e9))


def test_token_share_without_row_speed_is_the_old_per_row_price():
    d = DeviceProfile("a", 1 << 30, speed=0.5, overhead_s=0.002)
    assert d.token_share(0.1, 16, 2) == pytest.approx((0.002 + 0.2) / 2)
    batched = replace(d, row_speed=0.5)  # compute-bound: each further row costs c / speed
    assert batched.token_share(0.1, 16, 2) == pytest.approx((0.002 + 8 * 0.2) / 16)  # the call overhead paid once per step
    free = replace(d, row_speed=1e9)  # memory-bound: rows cost nothing
    assert free.token_share(0.1, 16, 1) == pytest.approx(free.token_share(0.1, 16, 2)) == pytest.approx(0.202 / 16)
    assert batched.token_share(0.1, 16, 3) == pytest.approx((0.002 + 6 * 0.2) / 16)  # 6, 5 and 5 sequences: the busiest gates


def _pool(row_speed_factor: float | None):
    """A fast device that holds everything and three slow ones; ``row_speed = factor x speed``."""
    def dev(name, speed, memory):
        return DeviceProfile(name, memory, speed=speed, overhead_s=0.001,
                             row_speed=None if row_speed_factor is None else speed * row_speed_factor)
    return [dev("fast", 1.0, 1 << 30), dev("s1", 0.3, 1 << 30), dev("s2", 0.3, 1 << 30), dev("s3", 0.3, 1 << 30)]


@pytest.mark.parametrize("factor, replicates", [(1.0, True), (None, True), (1000.0, False)])
def test_replicas_only_where_rows_cost_compute(factor, replicates):
    """Compute-bound devices (each row costs a step) gain from replicas; on memory-bound ones
    (rows nearly free) a replica only adds weights and hops, so the planner does not replicate."""
    model, devices, network = _model(), _pool(factor), _network()
    request = PlanRequest(objective=Objective.THROUGHPUT, sequences=16)
    best = plan(model, devices, network, request).best
    assert any(len(s.device_ids) > 1 for s in best.stages) is replicates
    again = evaluate(best.stages, model, devices, network, request)
    assert again.throughput_tok_s == pytest.approx(best.predicted.throughput_tok_s)
    alone = plan(model, devices, network, replace(request, replicas=False)).best
    assert best.predicted.throughput_tok_s >= alone.predicted.throughput_tok_s - 1e-9


def test_evaluate_prices_a_replicated_memory_bound_stage_no_faster():
    model, network = _model(), _network()
    devices = [DeviceProfile(n, 1 << 30, speed=0.3, overhead_s=0.001, row_speed=300.0) for n in ("a", "b")]
    request = PlanRequest(objective=Objective.THROUGHPUT, sequences=16)
    one = evaluate([Stage(("a",), 0, 10)], model, devices, network, request)
    two = evaluate([Stage(("a", "b"), 0, 10)], model, devices, network, request)
    assert two.bottleneck_s == pytest.approx(one.bottleneck_s, rel=0.05)  # 8 rows or 16: the same step
    legacy = [replace(d, row_speed=None) for d in devices]
    assert evaluate([Stage(("a", "b"), 0, 10)], model, legacy, network, request).bottleneck_s == pytest.approx(
        evaluate([Stage(("a",), 0, 10)], model, legacy, network, request).bottleneck_s / 2)


def test_probe_rows_are_checked_on_the_wire():
    from edgepipe.net.messages import ProtocolError, parse

    assert parse(Message(T.PROBE, {"probe": 1, "plan": 1, "rows": 8})) == Probe(1, plan=1, rows=8)
    with pytest.raises(ProtocolError, match="rows"):
        parse(Message(T.PROBE, {"probe": 1, "plan": 1, "rows": 0}))


# -- the coordinator measures the cost of a further row ---------------------------------------------------------
def test_rows_timed_gives_the_cost_of_a_further_row_and_it_is_remembered(tmp_path):
    from edgepipe.cluster.state import known_devices, measurements as M
    from edgepipe.cluster.rules.profiling import ROW_FLOOR, ClusterProfile

    class Unit:
        cost_s = 0.01
        experts = 0  # dense

    class Manifest:
        name = "toy"
        max_context = 2048
        units = [Unit()] * 4

    prof = ClusterProfile(Manifest())
    prof.calibrated_by_ratio("phone", [(0.04, 0.05)])
    prof.apply(M.RowsTimed("phone", 0, 4, 8, 0.05, 0.40))  # compute-bound: 0.05 s more per row
    assert prof.of("phone").row_speed == pytest.approx(0.04 / 0.05)
    prof.calibrated_by_ratio("box", [(0.04, 0.02)])
    prof.apply(M.RowsTimed("box", 0, 4, 8, 0.020, 0.019))  # memory-bound (and noise): rows priced at the floor
    assert prof.of("box").row_speed == pytest.approx(0.04 / (ROW_FLOOR * 0.020))
    identity = ("phone", "native", 1 << 30, 1, None, None)
    prof.remember("phone", identity)
    known_devices.save(prof.known, "toy", tmp_path / "known.json")
    assert known_devices.load(tmp_path / "known.json", "toy")[identity].row_speed == pytest.approx(0.8)
    assert prof.recall("phone-again", identity) and prof.of("phone-again").row_speed == pytest.approx(0.8)


@pytest.mark.parametrize("speculative, fails, measured", [(False, False, True), (False, True, False), (True, False, False)])
def test_the_batched_probe_is_skipped_on_the_verify_form_and_a_failed_one_measures_nothing(speculative, fails, measured):
    """The verify form (``--speculative``) runs one sequence per decode call, so it is not probed
    at 8 rows; a worker that cannot run the probe answers ``ok=false`` and the row cost stays
    unmeasured (before, its unanswered probe left every speculative cluster down)."""
    import asyncio
    from types import SimpleNamespace

    from edgepipe.cluster.shells import calibration as C
    from edgepipe.cluster.state import measurements as M
    from edgepipe.net.messages import Probed

    measured_now, asked = [], []
    ports = SimpleNamespace(settings=SimpleNamespace(speculative=speculative), measure=measured_now.append)
    cal = C.Calibrator.__new__(C.Calibrator)
    cal.ports = ports

    async def probe(wid, **fields):
        asked.append(fields["rows"])
        bad = fails and fields["rows"] > 1
        return Probed(1, not bad, None if bad else [0.01] * 10, error="batch_size must be 1" if bad else None)

    async def nothing(*args):
        return 7

    cal.probe, cal._load_probe_plan, cal._release_probe_plan = probe, nothing, nothing
    asyncio.run(cal._rows("w1", 1, 5))
    assert asked == ([] if speculative else [1, C.ROW_PROBE])
    assert [type(m) for m in measured_now] == ([M.RowsTimed] if measured else [])
