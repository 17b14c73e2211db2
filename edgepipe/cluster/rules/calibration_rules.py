"""What calibration decides, as plain functions (pure: no I/O, no clock): how steady a round of
probe timings is, which per-step times to believe, whom the calibrator holds, what it does with
a newcomer, and a deployed plan priced again from today's profiles. ``calibration`` (the I/O)
uses them and re-exports them."""

from __future__ import annotations

import statistics
from typing import Mapping

TRUST_RATIO = 0.25  # reported probe times below this fraction of the wall-clock measure are not believed
STABLE_SPREAD = 0.25  # (p90 - p10) / median of seconds per unit cost: above this a round is repeated
MAX_ROUNDS = 3
PROBE_REPS = 34  # the first two warm up; 32 more than the short probe, so the difference outweighs noise
ROW_PROBE, ROW_REPS = 8, 10  # a batched probe: rows stepped together, steps timed (the first two warm up)
STAGE_REPS = 18  # decode steps timed per round on a deployed stage (the first two warm up)


def spread(samples: list[tuple[float, float]]) -> float:
    """Relative spread of seconds per unit of cost over ``(cost, seconds)`` samples (0: steady)."""
    rates = sorted(t / c for c, t in samples if c > 0 and t > 0)
    if len(rates) < 3:
        return 0.0
    med = statistics.median(rates)
    lo, hi = rates[len(rates) // 10], rates[-1 - len(rates) // 10]
    return (hi - lo) / med if med > 0 else float("inf")


def trusted_step_times(reported: list[float], long_wall_s: float, short_wall_s: float, extra_reps: int) -> tuple[list[float], bool]:
    """The per-step times to believe from a probe, and whether the worker's own were overruled.

    The coordinator times two probes of the same stage that differ only in ``extra_reps`` decode
    steps: the difference of their round trips is what those steps took, with the prefill, the
    round trip and fixed costs cancelled. A worker reporting much less than that (a faulty
    clock, or one claiming to be faster than it is to be given more layers) gets the measured
    time instead."""
    measured = (long_wall_s - short_wall_s) / extra_reps if extra_reps > 0 else 0.0
    if not reported or measured <= 0 or statistics.median(reported) >= TRUST_RATIO * measured:
        return reported, False
    return [measured] * len(reported), True


def busy(state) -> set[str]:
    """The workers the calibrator holds (being timed, or measuring their links at join)."""
    return {wid for wid, w in state.workers.items() if w.calibrating}


def on_join(enabled: bool, known: bool) -> str | None:
    """What the calibrator does with a newcomer: ``"recall"`` a device seen before with the same
    declared hardware (its links are still measured), ``"time"`` any other, nothing when
    calibration is off."""
    if not enabled:
        return None
    return "recall" if known else "time"


def reprice(policy, plan_context, views: Mapping, profile, dep) -> dict | None:
    """``dep``'s stages priced with the cost model and today's profiles (None where the
    coordinator plans without the cost model, or the plan no longer fits)."""
    from ...plan import PlanError, evaluate
    from .planning import PlannerPolicy, running_plan

    if not isinstance(policy, PlannerPolicy):
        return None
    workers = [views[w] for w in dep.workers if w in views]
    if len(workers) != len(dep.workers):
        return None
    ctx = plan_context(workers)
    model, request = policy.model(ctx), policy.request(ctx)
    try:
        p = evaluate(running_plan(dep, model, request).stages, model, profile.device_profiles(workers),
                     profile.network_profile(workers), request)
    except PlanError:
        return None
    return {"tpot_s": p.tpot_s, "ttft_s": p.ttft_s, "throughput_tok_s": p.throughput_tok_s, "energy_j_per_token": p.energy_j_per_token,
            "stage_times_s": list(p.stage_times_s), "hop_times_s": list(p.hop_times_s)}
