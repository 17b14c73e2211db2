"""devices.yaml strictness (file:line errors with hints) and property tests over random files.

Hypothesis draws devices files (valid and broken) and checks that loading either gives
profiles or one `DevicesFileError` naming `file:line`, and that planning any valid pool for
every objective never raises, respects memory and is deterministic.
"""

from __future__ import annotations

import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepipe.plan import (
    DeviceProfile,
    DevicesFileError,
    NetworkProfile,
    PlanRequest,
    evaluate,
    load_devices,
    plan,
    transformer_profile,
)

MB = 1024 * 1024
LINE = re.compile(r"^devices\.yaml:\d+: ")


def load(text: str, units: int | None = None):
    return load_devices(text, "devices.yaml", units)


def error_of(text: str, units: int | None = None) -> str:
    with pytest.raises(DevicesFileError) as caught:
        load(text, units)
    return str(caught.value)


BASE = "devices:\n  - id: a\n    memory: 1GiB\n    speed: 1\n"


@pytest.mark.parametrize(
    "extra, line, needle",
    [
        ('    relay: "false"\n', 5, "expected true or false, got 'false' (hint: write false without quotes)"),
        ("    relay: yes please\n", 5, "expected true or false"),
        ("    held_units: [0, 99]\n", 5, "unit 99 is out of range 0..31"),
        ("    held_units: [-1]\n", 5, "unit -1 is out of range"),
        ("    power_busy_w: 5\n    power_idle_w: 9\n", 6, "idle power 9 W exceeds busy power 5 W (hint:"),
        ("    sped: 2\n", 5, "unknown key(s) sped (hint: did you mean 'speed'?)"),
        ('    speed_x: 1\n', 5, "unknown key(s) speed_x"),
        ("    precision: int3\n", 5, "'int3' is not one of int4, int8, fp32, native"),
        ("    activation_dtype: bf16\n", 5, "'bf16' is not one of float32, float16"),
        ("    prefill_speed: 0\n", 5, "0 must be > 0"),
        ('    overhead_ms: "3"\n', 5, "expected a number, got '3' (hint: write the number without quotes)"),
    ],
)
def test_device_errors_name_file_line_and_hint(extra, line, needle):
    message = error_of(BASE + extra, units=32)
    assert message.startswith(f"devices.yaml:{line}: "), message
    assert needle in message


def test_speed_line_and_defaults_line():
    assert error_of("devices:\n  - id: a\n    memory: 1GiB\n    speed: -2\n").startswith("devices.yaml:4: ")
    text = "defaults:\n  power_idle_w: 40\ndevices:\n  - id: a\n    memory: 1GiB\n    speed: 1\n"
    assert error_of(text).startswith("devices.yaml:2: ")  # the value came from `defaults`


def test_links_and_syntax_errors():
    text = BASE + "network:\n  links:\n    - {src: a, dst: coordinatr, rtt_ms: 1, bandwidth: 1Gbit/s}\n"
    message = error_of(text)
    assert message.startswith("devices.yaml:7: ") and "did you mean 'coordinator'?" in message
    message = error_of(BASE + "network:\n  default: {rtt_ms: 1, bandwidth: 0}\n")
    assert message.startswith("devices.yaml:6: ") and "must be > 0" in message
    message = error_of("devices:\n  - id: a\n    memory: 1GiB\n   speed: 1\n")
    assert message.startswith("devices.yaml:4: not valid YAML")
    assert error_of("").startswith("devices.yaml:1: the file is empty")


def test_new_optional_fields_parse():
    text = BASE + "    precision: fp32\n    activation_dtype: float16\n    prefill_speed: 7.5\n    relay: true\n"
    (device,) = load(text).devices
    assert (device.precision, device.activation_dtype, device.prefill_speed, device.relay) == (
        "fp32", "float16", 7.5, True)


# --- property tests over random devices files ---------------------------------------------

MODEL = transformer_profile(
    "prop", 6, layer_cost=0.004, layer_bytes=60 * MB, kv_bytes_per_token=2048, hidden_bytes=4096,
    embed_cost=0.0005, embed_bytes=40 * MB, head_cost=0.002, head_bytes=40 * MB, context_tokens=256,
    tied_bytes=30 * MB, variant_weight_bytes={"fp32": (160 * MB,) + (240 * MB,) * 6 + (160 * MB,)},
)

scalars = st.one_of(
    st.integers(-5, 5), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["false", "true", "1GiB", "fast", "", "100Mbit/s", "int4", "fp32", "float16"]),
)
good_device = st.fixed_dictionaries(
    {
        "memory": st.sampled_from(["150MB", "300MiB", "600MiB", "2GiB", 10**8]),
        "speed": st.floats(0.1, 8.0),
        "overhead_ms": st.floats(0, 10),
        "power_busy_w": st.floats(0.5, 300),
    },
    optional={
        "relay": st.booleans(),
        "emulated": st.booleans(),
        "held_units": st.lists(st.integers(0, 7), max_size=3),
        "prefill_speed": st.floats(0.5, 50),
        "precision": st.sampled_from(["int4", "fp32"]),
        "activation_dtype": st.sampled_from(["float32", "float16"]),
    },
)
fields = sorted({"memory", "speed", "overhead_ms", "power_busy_w", "power_idle_w", "relay", "held_units",
                 "precision", "activation_dtype", "prefill_speed", "emulated", "sped"})


@st.composite
def documents(draw, broken: bool):
    count = draw(st.integers(1, 10))
    devices = []
    for index in range(count):
        entry = {"id": f"d{index}", **draw(good_device)}
        entry["power_idle_w"] = draw(st.floats(0, 1)) * entry["power_busy_w"]
        if broken and draw(st.booleans()):
            entry[draw(st.sampled_from(fields))] = draw(scalars)
        devices.append(entry)
    links = []
    ids = [d["id"] for d in devices] + ["coordinator"]
    for _ in range(draw(st.integers(0, 4))):
        src, dst = draw(st.sampled_from(ids)), draw(st.sampled_from(ids))
        if src != dst and (src, dst) not in {(l["src"], l["dst"]) for l in links}:
            links.append({"src": src, "dst": dst, "rtt_ms": draw(st.floats(0, 50)),
                          "bandwidth": draw(st.sampled_from(["1Mbit/s", "100Mbit/s", "1Gbit/s", 5e5]))})
    return {"devices": devices, "network": {"links": links}}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(broken=True))
def test_any_file_loads_or_fails_with_file_line(document):
    text = yaml.safe_dump(document, sort_keys=False)
    try:
        parsed = load(text, units=MODEL.n_units)
    except DevicesFileError as error:
        assert LINE.match(str(error)), str(error)
        assert "\n" not in str(error)
        return
    assert all(d.power_idle_w <= d.power_busy_w for d in parsed.devices)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(broken=False), st.sampled_from(["latency", "throughput", "energy"]), st.integers(1, 3),
       st.one_of(st.none(), st.floats(0.005, 0.2)))
def test_planning_any_valid_file_never_crashes(document, objective, sequences, target):
    parsed = load(yaml.safe_dump(document, sort_keys=False), units=MODEL.n_units)
    request = PlanRequest(objective=objective, sequences=sequences, anneal_steps=150,
                          tpot_target_s=target if objective == "energy" else None)
    result = plan(MODEL, parsed.devices, parsed.network, request)
    again = plan(MODEL, parsed.devices, parsed.network, request)
    assert result == again  # deterministic
    by_id = {d.id: d for d in parsed.devices}
    for candidate in (result.best, *result.runners_up):
        if candidate.predicted is None:
            continue
        for device_id, used in candidate.predicted.memory_bytes:
            assert used <= by_id[device_id].memory_bytes
        if candidate.complete:
            repriced = evaluate(candidate.stages, MODEL, parsed.devices, parsed.network, request)
            assert repriced == candidate.predicted
    if result.best.complete and result.gap is not None:
        assert result.gap >= 0


def test_idle_above_busy_in_code_does_not_crash_annealing():
    """Profiles built in code may still carry idle > busy (the parser refuses it): more than 8
    devices anneal, and the energy weights go negative; the search must not crash."""
    devices = [
        DeviceProfile(f"d{i}", 250 * MB, 0.5 + i / 4, 0.001, power_busy_w=5.0, power_idle_w=5.0 * (1 + i % 3))
        for i in range(10)
    ]
    for sequences in (1, 3):
        result = plan(MODEL, devices, NetworkProfile(), PlanRequest(objective="energy", sequences=sequences))
        assert result.best.complete and result.searched == "annealing"
