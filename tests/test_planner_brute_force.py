"""Every objective against an independent brute force (edgepipe.plan.brute: own arithmetic).

Small random pools (3-5 devices, 6-10 units): latency, throughput (replicas of any group) and
energy (one or several sequences, with and without a time-per-token target) must equal the
brute-force optimum and be proven optimal (gap 0). Energy plans have no replicas (the runtime
runs one device per stage), so energy is compared with the best unreplicated plan.
The brute force's own pricing must also agree with `evaluate` on the plans the planner returns.
"""

from __future__ import annotations

import random

import pytest

from edgepipe.plan import DeviceProfile, NetworkProfile, PlanRequest, evaluate, objective_value, plan, transformer_profile
from edgepipe.plan.brute import best_values, price
from test_plan_search import random_instance

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

SHAPES = [(3, 8), (4, 7), (5, 6), (3, 10)]


def instance(seed: int):
    rng = random.Random(5000 + seed)
    m, n = SHAPES[seed % len(SHAPES)]
    model, devices, network = random_instance(rng, m, n)
    return rng, model, devices, network


# Seeds whose pool fits the model (the others have no plan at all, which other tests cover).
FITTING = [0, 1, 2, 3, 5, 6, 8, 9, 10, 13, 14, 15, 17, 18, 22, 23]


@pytest.mark.parametrize("seed", FITTING)
def test_every_objective_equals_brute_force(seed):
    rng, model, devices, network = instance(seed)
    sequences = 1 if seed % 2 == 0 else [2, 3, 4][seed % 3]
    fast = best_values(model, devices, network, sequences, None, max_group=len(devices))
    assert fast["latency"] < float("inf")
    target = None if seed % 3 == 0 else fast["fastest_tpot"] * rng.uniform(1.0, 2.0)
    expected = best_values(model, devices, network, sequences, target, max_group=len(devices))
    expected["energy"] = best_values(model, devices, network, sequences, target)["energy"]
    by_id = {d.id: d for d in devices}
    for objective in ("latency", "throughput", "energy"):
        if objective == "latency" and sequences > 1:
            continue
        request = PlanRequest(objective=objective, sequences=sequences,
                              tpot_target_s=target if objective == "energy" else None)
        result = plan(model, devices, network, request)
        got = objective_value(result.best.predicted, request)
        layout = tuple((s.device_ids, s.start, s.end) for s in result.best.stages)
        mine = price(layout, model, by_id, network, sequences)
        again = evaluate(result.best.stages, model, devices, network, request)
        assert mine.tpot_s == pytest.approx(again.tpot_s, rel=1e-12)
        assert mine.energy_j == pytest.approx(again.energy_j_per_token, rel=1e-12)
        if result.bound is not None:
            assert result.bound <= expected[objective] * (1 + 1e-9)
        assert got == pytest.approx(expected[objective], rel=1e-9), (seed, objective, got, expected)
        if objective == "energy":
            assert result.optimal and result.gap == pytest.approx(0.0, abs=1e-9)


MB = 1024 * 1024


def test_issue_case_gpu_idle_power_does_not_hide_the_optimum():
    """Issue 16's shape: a GPU whose idle power dominates the linearisation around the fastest
    plan. The per-set search finds the cheap two-device plan the brute force finds."""
    model = transformer_profile("m", 10, layer_cost=0.006, layer_bytes=90 * MB, kv_bytes_per_token=1024,
                                hidden_bytes=2048, embed_bytes=20 * MB, head_bytes=20 * MB, head_cost=0.002,
                                context_tokens=256)
    devices = [
        DeviceProfile("gpu", 4000 * MB, 8.0, 0.001, power_busy_w=250, power_idle_w=60),
        DeviceProfile("laptop", 1200 * MB, 1.0, 0.001, power_busy_w=20, power_idle_w=4),
        DeviceProfile("phone", 700 * MB, 0.6, 0.002, power_busy_w=4, power_idle_w=0.6),
        DeviceProfile("pi", 500 * MB, 0.35, 0.003, power_busy_w=6, power_idle_w=2.5),
    ]
    network = NetworkProfile()
    for target in (None, 0.15):
        request = PlanRequest(objective="energy", tpot_target_s=target)
        expected = best_values(model, devices, network, 1, target)["energy"]
        result = plan(model, devices, network, request)
        assert result.best.predicted.energy_j_per_token == pytest.approx(expected, rel=1e-9)
        assert result.optimal


@pytest.mark.parametrize("seed", [1, 3, 6])
@pytest.mark.parametrize("slack", [None, 1.3])
def test_energy_with_four_sequences_equals_brute_force(seed, slack):
    """S = 4: the period max(T / S, B) is searched exactly (label DP), with and without a target."""
    _, model, devices, network = instance(seed)
    fastest = best_values(model, devices, network, 4)["fastest_tpot"]
    target = None if slack is None else fastest * slack
    expected = best_values(model, devices, network, 4, target)["energy"]
    request = PlanRequest(objective="energy", sequences=4, tpot_target_s=target)
    result = plan(model, devices, network, request)
    assert result.best.predicted.energy_j_per_token == pytest.approx(expected, rel=1e-9)
    assert result.optimal and result.gap == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("slack", [None, 1.4])
def test_energy_milp_equals_brute_force(seed, slack):
    """The energy MILP (exact pair hops) finds the brute-force optimum; its separable-hop form
    is a lower bound."""
    from edgepipe.plan import milp_energy

    _, model, devices, network = instance(seed)
    target = None if slack is None else best_values(model, devices, network, 1)["fastest_tpot"] * slack
    expected = best_values(model, devices, network, 1, target)["energy"]
    request = PlanRequest(objective="energy", tpot_target_s=target)
    exact = milp_energy(model, devices, network, request, pair_hops=True)
    assert exact.status == "optimal"
    assert exact.value == pytest.approx(expected, rel=1e-6)
    assert exact.lower_bound <= expected * (1 + 1e-6)
    assert milp_energy(model, devices, network, request, pair_hops=False).lower_bound <= expected * (1 + 1e-6)
