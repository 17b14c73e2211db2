"""Arithmetic on measurements: device speed and overhead, running medians, prediction error.

Measuring is I/O and lives elsewhere; this module owns only the pure part (DESIGN.md
"Profiling", seed 000 §5): fitting `seconds = overhead_s + cost_units / speed` to timed unit
ranges of two or more lengths, a rolling median over the times workers report, and the mean
absolute percentage error between predicted and measured time per token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class SpeedFit(NamedTuple):
    speed: float  # cost units per second
    overhead_s: float  # per-call session overhead


def fit_speed_overhead(samples: Sequence[tuple[float, float]], warmup: int = 1) -> SpeedFit:
    """Least-squares fit of `seconds = overhead_s + cost_units / speed`.

    `samples` are (cost_units, seconds) in the order they were measured; the first `warmup`
    samples of each distinct range cost are dropped (cold caches, lazy allocation). At least
    two distinct costs must remain. A negative intercept (noise on a tiny overhead) is
    refitted through the origin, giving overhead 0.
    """
    seen: dict[float, int] = {}
    kept = []
    for cost, seconds in samples:
        seen[cost] = seen.get(cost, 0) + 1
        if seen[cost] > warmup:
            kept.append((float(cost), float(seconds)))
    if len({c for c, _ in kept}) < 2:
        raise ValueError(
            f"need timings of at least 2 range lengths after dropping {warmup} warm-up run(s) each; "
            f"got {len(kept)} sample(s) of {len({c for c, _ in kept})} length(s)"
        )
    kept.sort()
    count = len(kept)
    mean_x = math.fsum(c for c, _ in kept) / count
    mean_y = math.fsum(s for _, s in kept) / count
    sxx = math.fsum((c - mean_x) ** 2 for c, _ in kept)
    sxy = math.fsum((c - mean_x) * (s - mean_y) for c, s in kept)
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        slope = math.fsum(c * s for c, s in kept) / math.fsum(c * c for c, _ in kept)
        intercept = 0.0
    if not slope > 0:
        raise ValueError(f"time does not grow with cost (slope {slope:.3g} s per cost unit)")
    return SpeedFit(1.0 / slope, intercept)


@dataclass(frozen=True)
class RollingMedian:
    """Median of the last `window` values; immutable, `push` returns the updated window."""

    window: int
    values: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window = {self.window} must be >= 1")
        if len(self.values) > self.window:
            object.__setattr__(self, "values", tuple(self.values[-self.window :]))

    def push(self, value: float) -> RollingMedian:
        return RollingMedian(self.window, (*self.values, float(value))[-self.window :])

    @property
    def median(self) -> float | None:
        """None until a value arrives."""
        return statistics.median(self.values) if self.values else None


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent, of `predicted` against `measured`."""
    if len(predicted) != len(measured) or not measured:
        raise ValueError(f"need equal, non-empty sequences (got {len(predicted)} and {len(measured)})")
    errors = []
    for p, m in zip(predicted, measured):
        if m == 0:
            raise ValueError("a measured value is 0; percentage error is undefined")
        errors.append(abs(p - m) / abs(m))
    return 100.0 * math.fsum(errors) / len(errors)
