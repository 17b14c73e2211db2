"""Switching: hysteresis and decay, switch cost, plan diffs as actions, spare plans."""

from __future__ import annotations

import pytest

from edgepipe.plan import (
    DeviceProfile,
    DropStage,
    FetchUnits,
    LinkProfile,
    LoadStage,
    ModelProfile,
    MoveKV,
    NetworkProfile,
    Objective,
    Plan,
    PlanRequest,
    Stage,
    UnitProfile,
    decay,
    diff,
    plan,
    should_switch,
    spare_plan,
    switch_cost,
)

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

MB = 1_000_000
NET = NetworkProfile(default=LinkProfile("*", "*", 0.001, 1e9))


def make_plan(*stages: tuple[tuple[str, ...] | str, int, int], units: int = 8) -> Plan:
    built = tuple(Stage((d,) if isinstance(d, str) else d, a, b) for d, a, b in stages)
    return Plan(built, Objective.LATENCY, True, None, "test", units=units)


# --- should_switch -------------------------------------------------------------------------


def test_decay_is_a_sigmoid_halving_at_the_midpoint():
    assert decay(60.0) == pytest.approx(0.5)
    assert decay(0.0) == pytest.approx(1 - 1 / (1 + 2.718281828459045**5))
    assert decay(300.0) < 1e-8
    assert decay(1e9) == 0.0
    values = [decay(t) for t in range(0, 200, 10)]
    assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("gain_fraction", [0.0, 0.01, 0.03, 0.049])
@pytest.mark.parametrize("since", [0.0, 60.0, 1e6])
def test_small_gains_never_flap(gain_fraction, since):
    decision = should_switch(
        current_cost=0.100,
        candidate_cost=0.100 * (1 - gain_fraction),
        switch_cost_s=0.0,
        seconds_since_last_switch=since,
        horizon_tokens=1000,
    )
    assert not decision.switch
    assert "margin" in decision.reason


def test_penalty_decays_so_a_better_plan_is_taken_later():
    current, candidate = 0.100, 0.080  # a 20% better plan
    switch_s, horizon = 30.0, 1000  # 30 s to deploy, amortised over 1000 tokens
    decisions = {
        t: should_switch(current, candidate, switch_s, t, horizon) for t in (0.0, 30.0, 60.0, 90.0, 120.0)
    }
    assert not decisions[0.0].switch  # penalty ~0.030 s/token > the 0.015 s/token it would win
    assert not decisions[60.0].switch  # halved: 0.015, still not below tau * current - candidate
    assert decisions[120.0].switch
    penalties = [decisions[t].penalty for t in sorted(decisions)]
    assert penalties == sorted(penalties, reverse=True)
    assert decisions[0.0].penalty == pytest.approx(decay(0.0) * switch_s / horizon)
    assert decisions[120.0].gain == pytest.approx(0.020)
    # Once a switch happens the clock restarts, and the penalty is back at full strength.
    assert not should_switch(current, candidate, switch_s, 0.0, horizon).switch


def test_a_broken_plan_is_always_replaced():
    decision = should_switch(float("inf"), 0.5, 1e6, 0.0, 1)
    assert decision.switch


def test_free_switch_beyond_margin_is_taken_at_once():
    assert should_switch(0.100, 0.090, 0.0, 0.0, 100).switch


# --- switch_cost ---------------------------------------------------------------------------


def test_switch_cost_counts_missing_files_and_sessions():
    devices = [
        DeviceProfile("a", 10**9, 1.0, 0.0, held_units=frozenset({0, 1, 2, 3})),
        DeviceProfile("b", 10**9, 1.0, 0.0),
    ]
    files = [100 * MB] * 8
    bandwidth = {"a": 100 * MB, "b": 50 * MB}
    current = make_plan(("a", 0, 4), ("b", 4, 8))
    assert switch_cost(current, current, devices, files, bandwidth) == 0.0
    # a grows to [0, 6): downloads units 4, 5 (2 s) + session (1 s) = 3 s.
    # b moves to [6, 8): already serves them, so only a session: 1 s.
    candidate = make_plan(("a", 0, 6), ("b", 6, 8))
    expected = 0.8 * 3.0 + 0.2 * (3.0 + 1.0)
    assert switch_cost(current, candidate, devices, files, bandwidth) == pytest.approx(expected)
    # From nothing: a fetches 4, 5 (2 s) + 1 s; b fetches 6, 7 at 50 MB/s (4 s) + 1 s.
    assert switch_cost(None, candidate, devices, files, bandwidth) == pytest.approx(0.8 * 5.0 + 0.2 * 8.0)


def test_switch_cost_names_a_device_without_bandwidth():
    devices = [DeviceProfile("a", 10**9, 1.0, 0.0)]
    with pytest.raises(ValueError, match="'a'.*800000000 bytes"):
        switch_cost(None, make_plan(("a", 0, 8)), devices, [100 * MB] * 8, {})


# --- diff ----------------------------------------------------------------------------------


DIFF_CASES = [
    pytest.param(
        None,
        make_plan(("a", 0, 4), ("b", 4, 8)),
        {"b": {4, 5}},
        (
            FetchUnits("a", (0, 1, 2, 3)),
            FetchUnits("b", (6, 7)),
            LoadStage("a", 0, 4),
            LoadStage("b", 4, 8),
        ),
        id="cold-start",
    ),
    pytest.param(
        make_plan(("a", 0, 4), ("b", 4, 8)),
        make_plan(("a", 0, 4), ("b", 4, 8)),
        None,
        (),
        id="no-change",
    ),
    pytest.param(
        make_plan(("a", 0, 4), ("b", 4, 8)),
        make_plan(("a", 0, 6), ("b", 6, 8)),
        None,
        (
            FetchUnits("a", (4, 5)),
            LoadStage("a", 0, 6),
            LoadStage("b", 6, 8),
            MoveKV("b", "a", 4, 6),
            DropStage("a"),
            DropStage("b"),
        ),
        id="boundary-moves",
    ),
    pytest.param(
        make_plan(("a", 0, 4), ("b", 4, 8)),
        make_plan(("a", 0, 4), ("c", 4, 8)),
        {"c": {4, 5, 6, 7}},
        (LoadStage("c", 4, 8), MoveKV("b", "c", 4, 8), DropStage("b")),
        id="replace-device-that-holds-files",
    ),
    pytest.param(
        make_plan(("a", 0, 8)),
        make_plan(("b", 0, 3), ("c", 3, 8)),
        None,
        (
            FetchUnits("b", (0, 1, 2)),
            FetchUnits("c", (3, 4, 5, 6, 7)),
            LoadStage("b", 0, 3),
            LoadStage("c", 3, 8),
            MoveKV("a", "b", 0, 3),
            MoveKV("a", "c", 3, 8),
            DropStage("a"),
        ),
        id="split-onto-new-devices",
    ),
    pytest.param(
        make_plan(("a", 0, 8)),
        make_plan((("a", "b"), 0, 8)),
        None,
        (FetchUnits("b", tuple(range(8))), LoadStage("b", 0, 8), MoveKV("a", "b", 0, 8)),
        id="add-a-replica",
    ),
]


@pytest.mark.parametrize("current, target, held, expected", DIFF_CASES)
def test_diff(current, target, held, expected):
    assert diff(current, target, held) == expected


# --- spare plans ---------------------------------------------------------------------------


def chain(n: int) -> ModelProfile:
    units = tuple(UnitProfile(i, f"u{i}", 0.01, 100 * MB, 0, 4096) for i in range(n))
    return ModelProfile("chain", units, context_tokens=100, runtime_overhead_bytes=0)


def test_spare_plan_avoids_busy_devices():
    model = chain(8)
    devices = [
        DeviceProfile("a", 800 * MB, 3.0, 0.0),
        DeviceProfile("b", 800 * MB, 2.0, 0.0),
        DeviceProfile("c", 500 * MB, 1.0, 0.0),
        DeviceProfile("d", 500 * MB, 1.0, 0.0),
    ]
    current = plan(model, devices, NET, PlanRequest()).best
    assert current.device_ids == ("a",)
    spare = spare_plan(model, devices, NET, PlanRequest(), current, {"a"})
    assert spare is not None and spare.complete
    assert "a" not in spare.device_ids
    assert spare.device_ids == ("b",)
    assert spare.reason.startswith("spare without busy devices")


def test_spare_plan_reuses_busy_devices_only_on_other_ranges():
    model = chain(8)
    devices = [DeviceProfile("a", 500 * MB, 3.0, 0.0), DeviceProfile("b", 500 * MB, 1.0, 0.0)]
    current = plan(model, devices, NET, PlanRequest()).best
    ranges = {d: (s.start, s.end) for s in current.stages for d in s.device_ids}
    spare = spare_plan(model, devices, NET, PlanRequest(), current, {"a", "b"})
    assert spare is not None
    for stage in spare.stages:
        for device_id in stage.device_ids:
            start, end = ranges[device_id]
            assert stage.end <= start or stage.start >= end  # disjoint from what it serves now
    assert spare.reason.startswith("spare reusing busy")


def test_no_spare_when_nothing_else_fits():
    model = chain(8)
    devices = [DeviceProfile("a", 800 * MB, 1.0, 0.0), DeviceProfile("b", 100 * MB, 1.0, 0.0)]
    current = plan(model, devices, NET, PlanRequest()).best
    assert spare_plan(model, devices, NET, PlanRequest(), current, {"a"}) is None
