"""Reliability under churn: failure rates, availability, and the policy that weighs them."""

import pytest

from edgepipe.cluster.rules.planning import PlannerPolicy
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.plan import (COORDINATOR, DeviceProfile, LinkProfile, NetworkProfile, Objective, PlanRequest, availability,
                           expected_goodput, failure_rate, plan, transformer_profile)

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions


def test_availability_falls_with_every_device_a_plan_relies_on():
    one, two = availability([0.1], 1.0), availability([0.1, 0.1], 1.0)
    assert one == pytest.approx(1 / 1.1) and two == pytest.approx(1 / 1.2)
    assert availability([], 5.0) == 1.0
    assert expected_goodput(10.0, ["a", "a"], {"a": 0.1}, 1.0) == pytest.approx(10 / 1.1)  # a device counts once
    assert failure_rate(0, 1000.0) == 0.0
    assert failure_rate(3, 0.0, prior_life_s=30.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        availability([0.1], -1.0)


def setting(n_devices=3):
    model = transformer_profile("m", 8, layer_cost=0.01, layer_bytes=10 << 20, kv_bytes_per_token=1024, hidden_bytes=2048)
    devices = [DeviceProfile(f"d{i}", 1 << 30, 1.0, 0.0005) for i in range(n_devices)]
    ids = [d.id for d in devices]
    links = [LinkProfile(a, COORDINATOR, 0.0002, 1e9) for a in ids]
    links += [LinkProfile(a, b, 0.0002, 1e9) for a in ids for b in ids if a < b]
    return model, devices, NetworkProfile(tuple(links))


def test_policy_prefers_fewer_devices_only_when_they_fail():
    model, devices, network = setting()
    request = PlanRequest(objective=Objective.THROUGHPUT, sequences=3, replicas=False)
    best = plan(model, devices, network, request).best
    assert len(best.stages) > 1  # pipelining pays for three sequences
    assert all(len(s.device_ids) == 1 for s in best.stages)
    policy = PlannerPolicy()
    calm = policy._weigh_churn(best, model, devices, network, request, {d.id: 0.0 for d in devices}, 1.0)
    assert calm is best
    stormy = policy._weigh_churn(best, model, devices, network, request, {d.id: 3.0 for d in devices}, 3.0)
    assert len(stormy.stages) < len(best.stages)
    assert stormy.objective is Objective.THROUGHPUT and "churn" in stormy.reason


def test_profile_counts_lives_by_name_and_recalls_calibration():
    class Manifest:
        max_context = 2048
        units = []

    prof = ClusterProfile(Manifest())
    prof.joined("pi", 0.0)
    assert prof.failure_rate("pi", 100.0) == 0.0
    prof.left("pi", 100.0)
    prof.joined("pi", 110.0)
    assert prof.failure_rate("pi", 110.0) == pytest.approx(1 / (100 + 600))
    identity = ("pi", "native", 1 << 30, 1, None, None)
    prof.calibrated_by_ratio("w1-pi", [(1.0, 2.0)])
    prof.forget("w1-pi", identity)
    assert not prof.recall("w2-pi", ("pi", "native", 2 << 30, 1, None, None))  # other hardware: time it again
    assert prof.recall("w2-pi", identity) and prof.of("w2-pi").speed == pytest.approx(0.5)


def test_batched_steps_still_reveal_a_device_slowing_down():
    class Unit:
        cost_s = 0.01

    class Manifest:
        max_context = 2048
        units = [Unit()] * 4

    prof = ClusterProfile(Manifest())
    for _ in range(8):
        prof.step("w", 0, 4, 0.040)  # single steps: 0.04 s of work in 0.04 s
    assert prof.of("w").speed == pytest.approx(1.0)
    for _ in range(8):
        prof.step("w", 0, 4, 0.060, batch=4)  # a batch of 4 costs 1.5x: that is its baseline
    assert prof.of("w").speed == pytest.approx(1.0)
    for _ in range(40):
        prof.step("w", 0, 4, 0.180, batch=4)  # now only batches run, and they take 3x as long
    assert prof.of("w").speed == pytest.approx(1 / 3)
