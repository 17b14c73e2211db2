"""Profiles, evaluate(), devices.yaml parsing and the text report."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from edgepipe.plan import (
    COORDINATOR,
    DeviceProfile,
    DevicesFileError,
    LinkProfile,
    ModelProfile,
    NetworkProfile,
    Objective,
    Plan,
    PlanError,
    PlanRequest,
    Stage,
    UnitProfile,
    evaluate,
    parse_devices,
    plan,
    render,
    transformer_profile,
)

MB = 1_000_000
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "devices.yaml"


def model4(kv: int = 0) -> ModelProfile:
    units = (
        UnitProfile(0, "embed", 0.001, 100 * MB, 0, 1000),
        UnitProfile(1, "l0", 0.010, 100 * MB, kv, 1000),
        UnitProfile(2, "l1", 0.010, 100 * MB, kv, 1000),
        UnitProfile(3, "head", 0.004, 100 * MB, 0, 4),
    )
    return ModelProfile("m4", units, context_tokens=1000, runtime_overhead_bytes=10 * MB, prefill_efficiency=4.0)


# --- validation ----------------------------------------------------------------------------


def test_profiles_validate():
    with pytest.raises(ValueError, match="unit 0 .*cost"):
        UnitProfile(0, "x", -1.0, 0, 0, 0)
    with pytest.raises(ValueError, match="position 1 has index 2"):
        ModelProfile("m", (UnitProfile(0, "a", 0, 0, 0, 0), UnitProfile(2, "b", 0, 0, 0, 0)), 10)
    with pytest.raises(ValueError, match="'pi'.*speed"):
        DeviceProfile("pi", 10, 0.0, 0.0)
    with pytest.raises(ValueError, match="reserved"):
        DeviceProfile(COORDINATOR, 10, 1.0, 0.0)
    with pytest.raises(ValueError, match="given twice"):
        NetworkProfile((LinkProfile("a", "b", 0, 1), LinkProfile("a", "b", 0, 2)))


def test_stage_and_plan_validate_ranges():
    with pytest.raises(PlanError, match="'a'.*\\[3, 3\\)"):
        Stage(("a",), 3, 3)
    with pytest.raises(PlanError, match="'b' starts at unit 3, expected 2"):
        Plan((Stage(("a",), 0, 2), Stage(("b",), 3, 4)), Objective.LATENCY, True, None, "", units=4)
    with pytest.raises(PlanError, match="covers units \\[0, 2\\) of 4"):
        Plan((Stage(("a",), 0, 2),), Objective.LATENCY, True, None, "", units=4)
    with pytest.raises(PlanError, match="'a' appears in two stages"):
        Plan((Stage(("a",), 0, 2), Stage(("a",), 2, 4)), "latency", True, None, "")
    Plan((Stage(("a",), 0, 2),), Objective.LATENCY, False, None, "partial is fine", units=4)
    Plan((Stage(("a",), 0, 2),), Objective.LATENCY, True, None, "coverage unchecked without units")


def test_network_lookup_is_symmetric_with_default():
    net = NetworkProfile((LinkProfile("a", "b", 0.010, 1e6),), LinkProfile("*", "*", 0.002, 1e9))
    assert net.link("b", "a").rtt_s == 0.010
    assert net.link("a", "c").rtt_s == 0.002
    assert net.hop_s("a", "b", 1000) == pytest.approx(0.005 + 0.001)
    both = NetworkProfile((LinkProfile("a", "b", 0.010, 1e6), LinkProfile("b", "a", 0.020, 1e6)))
    assert both.link("b", "a").rtt_s == 0.020


# --- evaluate ------------------------------------------------------------------------------


def test_evaluate_by_hand():
    model = model4()
    devices = [
        DeviceProfile("a", 500 * MB, 1.0, 0.001, power_busy_w=10, power_idle_w=2),
        DeviceProfile("b", 500 * MB, 2.0, 0.002, power_busy_w=30, power_idle_w=5),
    ]
    net = NetworkProfile(default=LinkProfile("*", "*", 0.002, 1e6))  # 1 ms + bytes/1e6
    stages = (Stage(("a",), 0, 2), Stage(("b",), 2, 4))
    p = evaluate(stages, model, devices, net, PlanRequest(prompt_tokens=10))
    t_a = 0.001 + 0.011 / 1.0
    t_b = 0.002 + 0.014 / 2.0
    hops = (0.001 + 4e-6, 0.001 + 1000e-6, 0.001 + 4e-6)
    assert p.stage_times_s == pytest.approx((t_a, t_b))
    assert p.hop_times_s == pytest.approx(hops)
    ring = t_a + t_b + sum(hops)
    assert p.ring_s == p.tpot_s == pytest.approx(ring)
    assert p.throughput_tok_s == pytest.approx(1 / ring)
    assert p.bottleneck_s == pytest.approx(t_a)
    energy = 10 * t_a + 2 * (ring - t_a) + 30 * t_b + 5 * (ring - t_b)
    assert p.energy_j_per_token == pytest.approx(energy)
    prefill = (0.001 + 10 * 0.011 / 4) + (0.002 + 10 * 0.014 / 8)
    prefill_hops = (0.001 + 40e-6) + (0.001 + 10_000e-6) + (0.001 + 4e-6)
    assert p.ttft_s == pytest.approx(prefill + prefill_hops)
    assert p.memory_bytes == (("a", 210 * MB), ("b", 210 * MB))


def test_evaluate_with_sequences_and_replicas():
    model = model4(kv=1000)  # 1000 B/token x 1000 tokens = 1 MB per layer per sequence
    devices = [DeviceProfile(d, 500 * MB, 1.0, 0.0) for d in ("a", "b", "c")]
    net = NetworkProfile(default=LinkProfile("*", "*", 0.0, 1e15))
    request = PlanRequest(sequences=4)
    stages = (Stage(("a",), 0, 1), Stage(("b", "c"), 1, 4))
    p = evaluate(stages, model, devices, net, request)
    # The replicated stage holds 2 of the 4 sequences' KV on each replica.
    assert dict(p.memory_bytes) == {"a": 110 * MB, "b": 314 * MB, "c": 314 * MB}
    assert p.stage_times_s == pytest.approx((0.001, 0.024))
    assert p.bottleneck_s == pytest.approx(0.012)  # 0.024 / 2 replicas
    assert p.ring_s == pytest.approx(0.025)
    assert p.tpot_s == pytest.approx(max(0.025, 4 * 0.012))
    assert p.throughput_tok_s == pytest.approx(4 / 0.048)


def test_evaluate_names_the_device_that_does_not_fit():
    model = model4(kv=1000)
    devices = [DeviceProfile("small", 300 * MB, 1.0, 0.0), DeviceProfile("big", 10**10, 1.0, 0.0)]
    stages = (Stage(("small",), 0, 3), Stage(("big",), 3, 4))
    with pytest.raises(PlanError, match=r"'small': units \[0, 3\) need 312000000 bytes, it has 300000000"):
        evaluate(stages, model, devices, NetworkProfile(), PlanRequest(sequences=1))
    with pytest.raises(PlanError, match="'ghost' is not in the pool"):
        evaluate((Stage(("ghost",), 0, 4),), model, devices, NetworkProfile(), PlanRequest())


def test_transformer_profile_shape():
    model = transformer_profile(
        "t", 3, layer_cost=0.01, layer_bytes=10, kv_bytes_per_token=2, hidden_bytes=8, head_cost=0.02, head_bytes=5
    )
    assert [u.name for u in model.units] == ["embed", "layer0", "layer1", "layer2", "head"]
    assert model.units[-1].out_bytes_per_token == model.token_id_bytes == 4
    assert model.stage_bytes(1, 3, 2) == 20 + model.context_tokens * 2 * 4 + model.runtime_overhead_bytes


# --- devices.yaml --------------------------------------------------------------------------


def test_example_devices_file_parses_and_plans():
    parsed = parse_devices(yaml.safe_load(EXAMPLE.read_text()))
    by_id = {d.id: d for d in parsed.devices}
    assert list(by_id) == sorted(by_id)
    assert by_id["desktop"].memory_bytes == 12 * 2**30
    assert by_id["desktop"].overhead_s == pytest.approx(0.0008)
    assert by_id["desktop"].held_units == frozenset(range(6))
    assert by_id["laptop"].power_busy_w == 15  # from defaults
    assert by_id["browser-tab"].relay and by_id["slow-emulated"].emulated
    assert parsed.network.link("laptop", "coordinator").bandwidth_bytes_per_s == pytest.approx(25e6)
    assert parsed.network.link("pi5", "laptop").rtt_s == pytest.approx(0.002)
    model = transformer_profile(
        "x", 24, layer_cost=0.002, layer_bytes=300 * 2**20, kv_bytes_per_token=8192, hidden_bytes=4096,
        embed_bytes=300 * 2**20, head_bytes=300 * 2**20, head_cost=0.003,
    )
    result = plan(model, parsed.devices, parsed.network, PlanRequest())
    assert result.best.complete


@pytest.mark.parametrize(
    "document, message",
    [
        ({"devices": []}, "non-empty list"),
        ({"devices": [{"id": "a", "speed": 1}]}, "device 'a': 'memory' is required"),
        ({"devices": [{"id": "a", "memory": "8 parsecs", "speed": 1}]}, "device 'a': devices\\[0\\].memory: cannot read size"),
        ({"devices": [{"id": "a", "memory": "1GiB", "speed": 1, "sped": 2}]}, "unknown key.*sped"),
        ({"devices": [{"id": "a", "memory": "1GiB", "speed": 0}]}, "'a': devices\\[0\\].speed: 0 must be > 0"),
        (
            {"devices": [{"id": "a", "memory": "1GiB", "speed": 1}], "network": {"links": [
                {"src": "a", "dst": "b", "rtt_ms": 1, "bandwidth": "1Gbit/s"}]}},
            "unknown node 'b'",
        ),
        (
            {"devices": [{"id": "a", "memory": 1, "speed": 1}, {"id": "a", "memory": 1, "speed": 1}]},
            "'a' is listed twice",
        ),
    ],
)
def test_devices_file_errors(document, message):
    with pytest.raises(DevicesFileError, match=message):
        parse_devices(document)


# --- report --------------------------------------------------------------------------------


def test_render_lists_stages_and_runners_up():
    model = model4()
    devices = [
        DeviceProfile("a", 250 * MB, 1.0, 0.001),
        DeviceProfile("b", 500 * MB, 2.0, 0.002, emulated=True),
        DeviceProfile("c", 500 * MB, 1.5, 0.002),
    ]
    result = plan(model, devices, NetworkProfile(), PlanRequest(top_k=2))
    text = render(result, devices)
    assert text == render(result, devices)
    assert text.startswith("objective: latency (search: exact-subset-dp; lower bound")
    assert "proven optimal" in text
    assert "b (emulated)" in text
    assert "-> coordinator" in text
    assert text.count("\n1 ") + text.count("\n1  ") >= 1
    for stage in result.best.stages:
        assert f"[{stage.start}, {stage.end})" in text


def test_render_partial_plan():
    model = model4()
    result = plan(model, [DeviceProfile("a", 250 * MB, 1.0, 0.0)], NetworkProfile(), PlanRequest())
    text = render(result)
    assert "PARTIAL PLAN" in text and "no complete plan" in text
