"""Pure arithmetic on measurements: speed/overhead fit, rolling median, MAPE."""

from __future__ import annotations

import random

import pytest

from edgepipe.plan import RollingMedian, fit_speed_overhead, mape

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions


def timings(speed: float, overhead: float, costs, repeats: int, noise: float, seed: int, warmup_extra: float):
    rng = random.Random(seed)
    samples = []
    for cost in costs:
        for run in range(repeats):
            seconds = overhead + cost / speed
            seconds *= 1 + rng.uniform(-noise, noise)
            if run == 0:
                seconds += warmup_extra  # first call of a range pays cold caches
            samples.append((cost, seconds))
    return samples


@pytest.mark.parametrize("speed, overhead", [(1.0, 0.002), (0.25, 0.010), (7.5, 0.0005)])
def test_fit_recovers_speed_and_overhead(speed, overhead):
    samples = timings(speed, overhead, [0.05, 0.2], repeats=6, noise=0.0, seed=1, warmup_extra=0.5)
    fit = fit_speed_overhead(samples)
    assert fit.speed == pytest.approx(speed, rel=1e-9)
    assert fit.overhead_s == pytest.approx(overhead, rel=1e-6)


def test_fit_with_noise_and_three_lengths():
    samples = timings(2.0, 0.004, [0.02, 0.08, 0.32], repeats=20, noise=0.02, seed=3, warmup_extra=1.0)
    speed, overhead = fit_speed_overhead(samples)
    assert speed == pytest.approx(2.0, rel=0.03)
    assert overhead == pytest.approx(0.004, abs=0.002)


def test_warmup_dropped_matters():
    samples = timings(1.0, 0.002, [0.05, 0.2], repeats=3, noise=0.0, seed=1, warmup_extra=0.5)
    assert fit_speed_overhead(samples, warmup=1).overhead_s == pytest.approx(0.002)
    assert fit_speed_overhead(samples, warmup=0).overhead_s > 0.1  # cold calls counted as overhead


def test_negative_intercept_refits_through_origin():
    speed, overhead = fit_speed_overhead([(1.0, 0.9), (1.0, 0.9), (2.0, 2.0), (2.0, 2.0)], warmup=0)
    assert overhead == 0.0
    assert speed == pytest.approx(5 * 1 / (0.9 + 4.0))


def test_fit_needs_two_lengths():
    with pytest.raises(ValueError, match="at least 2 range lengths"):
        fit_speed_overhead([(0.1, 0.2), (0.1, 0.2), (0.3, 0.5)])  # 0.3 only has its warm-up run


def test_fit_is_order_independent_after_warmup():
    samples = timings(1.5, 0.003, [0.05, 0.2], repeats=5, noise=0.01, seed=9, warmup_extra=0.0)
    first, rest = samples[:1] + samples[5:6], [s for i, s in enumerate(samples) if i not in (0, 5)]
    assert fit_speed_overhead(first + rest) == fit_speed_overhead(first + list(reversed(rest)))


def test_rolling_median():
    window = RollingMedian(3)
    assert window.median is None
    for value, expected in [(5.0, 5.0), (1.0, 3.0), (9.0, 5.0), (2.0, 2.0), (100.0, 9.0)]:
        window = window.push(value)
        assert window.median == expected
    assert window.values == (9.0, 2.0, 100.0)
    assert RollingMedian(3, (1.0, 2.0, 3.0, 4.0)).values == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        RollingMedian(0)


def test_mape():
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(10.0)
    assert mape([2.0], [1.0]) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        mape([1.0], [0.0])
    with pytest.raises(ValueError):
        mape([1.0, 2.0], [1.0])
