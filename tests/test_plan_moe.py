"""The planner on mixture-of-experts layers (``plan/moe.py``): memory is every expert, a one-row
step reads the routed ones, a batched step the union of its rows' experts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgepipe.plan import DeviceProfile, NetworkProfile, PlanRequest, Stage, evaluate, plan, transformer_profile
from edgepipe.plan.moe import bytes_read, experts_touched, extra_cost
from edgepipe.plan.profiles import UnitProfile
from edgepipe.plan.split import _token_share, device_tables

pytestmark = pytest.mark.pure

E, K, EXPERT, SHARED = 8, 2, 1_000_000, 500_000  # bytes of one expert, of the shared weights (attention, router)


def _moe_model(layers: int = 4):
    dense = transformer_profile("m", layers, layer_cost=1.0, layer_bytes=SHARED + E * EXPERT, kv_bytes_per_token=1024, hidden_bytes=2048,
                                embed_cost=0.01, embed_bytes=10_000, head_cost=0.2, head_bytes=200_000)
    units = tuple(dataclasses.replace(u, experts=E, experts_used=K, expert_bytes=EXPERT) if u.name.startswith("layer") else u
                  for u in dense.units)
    return dense, dataclasses.replace(dense, units=units)


def test_experts_touched_is_the_expected_union_of_random_routes():
    rng = np.random.default_rng(0)
    for rows in (1, 2, 4, 8, 32):
        sampled = np.mean([len({int(e) for _ in range(rows) for e in rng.choice(E, K, replace=False)}) for _ in range(4000)])
        assert experts_touched(E, K, rows) == pytest.approx(sampled, rel=0.02), rows
    assert experts_touched(E, K, 1) == K and experts_touched(E, E, 5) == E


def test_memory_is_every_expert_and_a_row_reads_the_routed_ones():
    dense, moe = _moe_model()
    layer = moe.units[1]
    assert moe.stage_bytes(1, 2, 1) == dense.stage_bytes(1, 2, 1)  # all E experts are held
    assert bytes_read(layer, 1) == SHARED + K * EXPERT
    assert bytes_read(layer, 8) == pytest.approx(SHARED + E * (1 - (1 - K / E) ** 8) * EXPERT)
    assert bytes_read(dense.units[1], 8) == dense.units[1].weight_bytes
    assert extra_cost(layer, 1) == 0.0 and extra_cost(dense.units[1], 8) == 0.0
    assert extra_cost(layer, 8) == pytest.approx(layer.cost * (bytes_read(layer, 8) / bytes_read(layer, 1) - 1))
    with pytest.raises(ValueError, match="experts_used 3 must be in 1..experts"):
        UnitProfile(1, "layer0", 1.0, 10, 0, 4, experts=2, experts_used=3, expert_bytes=1)


def test_a_batched_moe_step_costs_more_than_a_dense_one_of_the_same_one_row_cost():
    dense, moe = _moe_model()
    device = DeviceProfile("a", memory_bytes=10**9, speed=1.0, overhead_s=0.001, row_speed=20.0)
    network = NetworkProfile()
    stages = [Stage(("a",), 0, moe.n_units)]
    one = [evaluate(stages, m, [device], network, PlanRequest(sequences=1)).throughput_tok_s for m in (dense, moe)]
    assert one[0] == pytest.approx(one[1])  # one row: the routed experts, as measured
    eight = [evaluate(stages, m, [device], network, PlanRequest(sequences=8)) for m in (dense, moe)]
    expected_extra = sum(extra_cost(u, 8) for u in moe.units) / device.speed / 8  # seconds per token
    assert 1 / eight[1].throughput_tok_s - 1 / eight[0].throughput_tok_s == pytest.approx(expected_extra, rel=1e-6)
    # the split search prices a stage as evaluate does
    tables = device_tables(moe, {"a": device}, network, PlanRequest(sequences=8))
    share = _token_share(tables, [0])[0, moe.n_units]
    assert share == pytest.approx(device.token_share(sum(u.cost for u in moe.units), 8, 1,
                                                     lambda rows: sum(extra_cost(u, rows) for u in moe.units)))
    assert plan(moe, [device], network, PlanRequest(sequences=8)).best.predicted.throughput_tok_s == pytest.approx(eight[1].throughput_tok_s)


def _manifest(moe: bool):
    from edgepipe.model.manifest import FORMAT_VERSION, Manifest, Unit, UnitVariant

    def unit(i: int, kind: str, cost: float, nbytes: int, experts: int = 0) -> Unit:
        variant = UnitVariant("gguf", f"g{i}", (f"w{i}",), nbytes, expert_bytes=EXPERT if experts else 0)
        return Unit(i, kind, kind if kind != "layer" else f"layer{i - 1}", cost, 1024, 2048, {"gguf": variant},
                    experts=experts, experts_used=K if experts else 0)

    layers = [unit(i, "layer", 0.01, SHARED + E * EXPERT, E if moe else 0) for i in range(1, 5)]
    units = (unit(0, "embedding", 0.0001, 10_000), *layers, unit(5, "head", 0.002, 200_000))
    return Manifest(FORMAT_VERSION, "m", {}, "gguf", {"n_layers": 4, "hidden_size": 512}, units, {}, "t", None, (), None, False, 2048)


def test_calibration_takes_the_further_experts_off_the_row_price():
    """A batched step measured on a MoE stage holds the further experts its rows read; the row
    price keeps only the rest, so the planner's prediction of that step is the step measured."""
    from edgepipe.cluster.rules.profiling import ClusterProfile

    rows, speed, per_row = 8, 2.0, 0.0004
    for moe in (False, True):
        profile = ClusterProfile(_manifest(moe))
        profile.of("w").speed = speed
        cost = profile.unit_cost(1, 5)
        experts_s = sum(extra_cost(u, rows) for u in profile.model_profile().units[1:5]) / speed
        single_s = cost / speed
        batched_s = single_s + (rows - 1) * per_row + experts_s
        profile.rows_timed("w", 1, 5, rows, single_s, batched_s)
        assert profile.of("w").row_speed == pytest.approx(cost / per_row)
        device = DeviceProfile("w", memory_bytes=10**9, speed=speed, overhead_s=0.0, row_speed=profile.of("w").row_speed)
        model = profile.model_profile()
        predicted = device.token_share(cost, rows, 1, lambda r: sum(extra_cost(u, r) for u in model.units[1:5])) * rows
        assert predicted == pytest.approx(batched_s)
        assert (experts_s > 0) == moe


def test_one_batched_probe_predicts_every_batch_size_along_the_union():
    """A device whose MoE steps cost a per-row price plus the experts the rows' union reads
    (E·(1 − (1 − k/E)^S) of them): calibrated by the join's one probe at 8 rows, the planner's
    step time at every other S is that device's; priced as dense layers (the union folded into a
    linear per-row price) it is not, too slow at 2 rows and too fast at 32."""
    from edgepipe.cluster.rules.profiling import ClusterProfile

    speed, per_row = 2.0, 0.0004
    profile = ClusterProfile(_manifest(True))
    profile.of("w").speed = speed
    model = profile.model_profile()
    cost = profile.unit_cost(1, 5)
    layers = model.units[1:5]
    expert_s = sum(u.cost * u.expert_bytes / bytes_read(u, 1) for u in layers) / speed  # reading one more expert in every layer

    def true_step(rows: int) -> float:  # the device: one row's step, a price per further row, the further experts
        return cost / speed + (rows - 1) * per_row + (experts_touched(E, K, rows) - K) * expert_s

    profile.rows_timed("w", 1, 5, 8, true_step(1), true_step(8))
    device = DeviceProfile("w", memory_bytes=10**9, speed=speed, overhead_s=0.0, row_speed=profile.of("w").row_speed)
    dense_device = dataclasses.replace(device, row_speed=cost / ((true_step(8) - true_step(1)) / 7))
    for rows in (1, 2, 4, 8, 16, 32):
        predicted = device.token_share(cost, rows, 1, lambda r: sum(extra_cost(u, r) for u in layers)) * rows
        assert predicted == pytest.approx(true_step(rows), rel=1e-9), rows
        dense = dense_device.token_share(cost, rows, 1) * rows
        if rows in (2, 32):
            assert abs(dense - true_step(rows)) / true_step(rows) > 0.05, rows
