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
