"""The energy objective searched per device set, and a lower bound on it (pure).

Energy per token of a plan on device set U (no replicas) is, from `plan.evaluate`,

    E = sum_{d in U} (busy_d - idle_d) * t_d  +  P_U * period,   P_U = sum_{d in U} idle_d,

with period = max(T / S, B) (T ring time, B bottleneck, S sequences). The product P_U * period
is what makes energy hard for a plain DP: P_U is only known once the set is. Fixing the set
fixes P_U, and then `A + (P_U / S + mu) * T` is additive over stages and hops, so an exact
subset DP restricted to U finds its best plan; mu >= 0 is a Lagrange weight on the
time-per-token target, raised by bisection until the target is met. For one sequence
(period = T) with no target this is exact for each set; enumerating every set (3^m DP steps
in all, sets pruned by a relaxed lower bound) makes it exact for the pool. With a target the
Lagrangian value `DP(P_U / S + mu) - mu * target` bounds each set from below, which gives the
printed gap.

`energy_bound` is a pool-wide bound for any size: T >= t_d and T >= the least ring time, so
`E >= sum_d (busy_d - idle_d) t_d + idle_d * max(t_d, T_min)` — additive per stage, solved
by the relaxed (device-reuse) DP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .split import INF, CostTables, Path, Pricing, relaxed_split, subset_dp

MU_STEPS = 10
"""Bisection steps on the Lagrange weight of the target, per device set."""


@dataclass(frozen=True)
class SetSearch:
    """Plans found for the sets searched, and the least Lagrangian lower bound over them."""

    paths: tuple[Path, ...]
    bound: float


def _tables(
    pricing: Pricing,
    members: np.ndarray,
    weight: np.ndarray,
    time_weight: float,
    bottleneck_limit: float,
    blocked: np.ndarray | None,
) -> CostTables:
    """Cost tables over the singleton slots `members`: stage (weight + time_weight) * t,
    hops time_weight * h; stages or hops above `bottleneck_limit` removed."""
    time = pricing.time[members]
    finite = np.isfinite(time)
    if blocked is not None:
        finite &= ~blocked[members]
    w = (weight[members] + time_weight)[:, None, None]
    stage = np.where(finite, w * np.where(finite, time, 0.0), INF)
    hop = pricing.hop[np.ix_(members, members)]
    enter, leave = pricing.enter[members], pricing.leave[members]
    if bottleneck_limit < INF:
        stage = np.where(pricing.eff[members] <= bottleneck_limit, stage, INF)
        hop = np.where(hop <= bottleneck_limit, hop, INF)
        enter = np.where(enter <= bottleneck_limit, enter, INF)
        leave = np.where(leave <= bottleneck_limit, leave, INF)
    return CostTables(
        pricing.n,
        np.array([1 << b for b in range(len(members))], dtype=np.int64),
        stage,
        hop * time_weight,
        enter * time_weight,
        leave * time_weight,
        pricing.leave_partial[members] * time_weight,
    )


def search_sets(
    pricing: Pricing,
    busy: np.ndarray,
    idle: np.ndarray,
    sets: Sequence[tuple[int, ...]],
    sequences: int,
    target: float | None,
    *,
    incumbent: float = INF,
    blocked: np.ndarray | None = None,
    limits: Sequence[float] = (),
) -> SetSearch:
    """Best plans per device set (see the module docstring); `sets` hold singleton slot indices.

    `incumbent` is an energy some plan already achieves: sets whose relaxed bound exceeds it
    are skipped. `busy`/`idle` are per device (= singleton slot) power.

    `limits`: extra bottleneck limits tried per set (S > 1: a plan whose period is its
    bottleneck B rather than T / S is found by capping B; heuristic, no bound).
    """
    weight = busy - idle
    paths: dict[Path, None] = {}
    bound = INF
    # With S > 1 the period is at least T / S and at most target / S: the bottleneck limit.
    limit = target / sequences if target is not None and sequences > 1 else INF
    horizon = target if target is not None else INF
    scored = []
    for members in sets:
        index = np.array(members)
        power = float(idle[index].sum())
        base = power / sequences
        relaxed = relaxed_split(_tables(pricing, index, weight, base, limit, blocked)).bound
        scored.append((relaxed, members))
    scored.sort()
    best_energy = incumbent
    for relaxed, members in scored:
        if relaxed >= best_energy * (1 + 1e-12) and relaxed > -INF:
            bound = min(bound, relaxed)
            continue
        index = np.array(members)
        base = float(idle[index].sum()) / sequences

        def solve(mu: float) -> tuple[float, Path, float]:
            tables = _tables(pricing, index, weight, base + mu, limit, blocked)
            found = subset_dp(tables, len(index), keep=1).best_by_set
            if not found:
                return INF, (), INF
            cost, path = min(found.values())
            real = tuple((int(index[g]), x, i) for g, x, i in path)
            ring = sum(pricing.time[g, x, i] for g, x, i in real)
            ring += pricing.enter[real[0][0]] + pricing.leave[real[-1][0]]
            ring += sum(pricing.hop[a[0], b[0], b[1]] for a, b in zip(real, real[1:]))
            return cost, real, float(ring)

        cost, path, ring = solve(0.0)
        if not path:
            continue
        paths.setdefault(path)
        set_bound = cost  # no constraint active: exact value of the relaxation at mu = 0
        if ring > horizon * (1 + 1e-12):
            low, high, found_high = 0.0, max(base, 1e-3), False
            for _ in range(40):  # find a weight that meets the target
                cost, path, ring = solve(high)
                if not path:
                    break
                paths.setdefault(path)
                set_bound = max(set_bound, cost - high * horizon)
                if ring <= horizon * (1 + 1e-12):
                    found_high = True
                    break
                low, high = high, high * 4
            if found_high:
                for _ in range(MU_STEPS):
                    mu = (low + high) / 2
                    cost, path, ring = solve(mu)
                    paths.setdefault(path)
                    set_bound = max(set_bound, cost - mu * horizon)
                    if ring <= horizon * (1 + 1e-12):
                        high = mu
                    else:
                        low = mu
        for extra in limits:
            tables = _tables(pricing, index, weight, base, min(extra, limit), blocked)
            for _, extra_path in subset_dp(tables, len(index), keep=1).best_by_set.values():
                paths.setdefault(tuple((int(index[g]), x, i) for g, x, i in extra_path))
        bound = min(bound, set_bound)
        if sequences == 1 and path and ring <= horizon * (1 + 1e-12):
            best_energy = min(best_energy, cost)  # cost >= the plan's energy when S = 1
    return SetSearch(tuple(paths), bound)


def energy_bound(pricing: Pricing, busy: np.ndarray, idle: np.ndarray, ring_lower: float) -> float:
    """A lower bound on the energy of any one-sequence plan without replicas (module docstring)."""
    m = len(pricing.ids)
    members = np.arange(m)
    time = pricing.time[members]
    finite = np.isfinite(time)
    safe = np.where(finite, time, 0.0)
    stage = (busy - idle)[:, None, None] * safe + idle[:, None, None] * np.maximum(safe, ring_lower)
    stage = np.where(finite, stage, INF)
    zeros = np.zeros(m)
    tables = CostTables(
        pricing.n,
        pricing.masks[:m],
        stage,
        np.where(np.isfinite(pricing.hop[np.ix_(members, members)]), 0.0, INF),
        zeros,
        zeros,
        np.zeros((m, pricing.n + 1)),
    )
    return relaxed_split(tables).bound
