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
        _scaled(hop, time_weight),
        _scaled(enter, time_weight),
        _scaled(leave, time_weight),
        _scaled(pricing.leave_partial[members], time_weight),
    )


def _scaled(values: np.ndarray, factor: float) -> np.ndarray:
    """``values * factor`` with infinities kept infinite (no NaN from inf * 0)."""
    finite = np.isfinite(values)
    return np.where(finite, np.where(finite, values, 0.0) * factor, INF)


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


LABEL_DP_STEPS = 60_000
"""Largest `label_dp_steps` for which `exact_energy` runs (a few seconds at most)."""


def label_dp_steps(m: int, n: int) -> int:
    """States x moves of `exact_energy` in the worst case: 2^m sets x m last devices x n x m."""
    return (1 << m) * m * n * m


def _pareto(a: np.ndarray, t: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Indices of the labels no other label beats on energy, ring time and bottleneck at once
    (among equal labels the first is kept)."""
    order = np.lexsort((b, t, a))
    keep: list[int] = []
    for index in order:
        if any(a[k] <= a[index] and t[k] <= t[index] and b[k] <= b[index] for k in keep):
            continue
        keep.append(int(index))
    return np.array(sorted(keep), dtype=np.int64)


def exact_energy(
    pricing: Pricing,
    busy: np.ndarray,
    idle: np.ndarray,
    sequences: int,
    target: float | None,
    *,
    incumbent: float = INF,
    rest_time: np.ndarray | None = None,
    rest_energy: np.ndarray | None = None,
    max_labels: int = 2_000_000,
) -> tuple[float, Path] | None:
    """The least energy per token of any plan without replicas meeting `target`: exact.

    With several sequences the period max(T / S, B) is neither additive nor fixed by the
    device set, so each partial plan carries (A, T, B): its busy-minus-idle energy, ring time
    so far and bottleneck so far. A label is dropped when another of the same state (devices
    used, last device, units covered) is no worse on all three: every completion adds the same
    to A and T and maxes the same into B, and energy A + P_U max(T, S B) / S and time per
    token max(T, S B) only grow with each. Returns (inf, ()) when no plan meets the target.

    Pruning: a label whose energy cannot get below `incumbent` (an energy some plan achieves)
    is dropped, using `rest_time[x]` / `rest_energy[x]`, lower bounds on the ring time and
    busy-minus-idle energy of units [x, n) (the latter only when no device idles above its
    busy power). Exponential: returns None (undecided) once `max_labels` labels were made.
    """
    m, n, seq = len(pricing.ids), pricing.n, sequences
    time = pricing.time[:m]
    hop, enter, leave = pricing.hop[:m, :m], pricing.enter[:m], pricing.leave[:m]
    weight = busy[:m] - idle[:m]
    horizon = target * (1 + 1e-12) if target is not None else INF
    Labels = tuple[list[float], list[float], list[float], list[Path]]
    buckets: list[dict[tuple[int, int], Labels] | None] = [dict() for _ in range(1 << m)]
    rest_t = np.zeros(n + 1) if rest_time is None else rest_time
    monotone = bool((weight >= 0).all())
    rest_a = np.zeros(n + 1) if rest_energy is None or not monotone else rest_energy
    limit = incumbent * (1 + 1e-9) if monotone else INF
    made = 0

    idle_of = [float(idle[d]) for d in range(m)]

    def add(used: int, power: float, g: int, i: int, a: float, t: float, b: float, path: Path) -> None:
        nonlocal made
        if t > horizon or seq * b > horizon:  # T and B only grow
            return
        if limit < INF and a + rest_a[i] + power * max(t + rest_t[i], seq * b) / seq > limit:
            return
        made += 1
        bucket = buckets[used]
        assert bucket is not None
        labels = bucket.setdefault((g, i), ([], [], [], []))
        labels[0].append(a)
        labels[1].append(t)
        labels[2].append(b)
        labels[3].append(path)

    for g in range(m):
        for i in range(1, n + 1):
            t = float(time[g, 0, i])
            if np.isfinite(t):
                add(1 << g, idle_of[g], g, i, float(weight[g]) * t, float(enter[g]) + t, max(float(enter[g]), t), ((g, 0, i),))
    best: tuple[float, Path] = (INF, ())
    for used in range(1, 1 << m):
        if made > max_labels:
            return None
        bucket = buckets[used]
        buckets[used] = None
        if not bucket:
            continue
        members = [d for d in range(m) if used >> d & 1]
        power = float(idle[members].sum())
        free = [h for h in range(m) if not used >> h & 1]
        for (g, x), (a_list, t_list, b_list, paths) in sorted(bucket.items()):
            a, t, b = np.array(a_list), np.array(t_list), np.array(b_list)
            keep = _pareto(a, t, b)
            if x == n:
                ring = t[keep] + leave[g]
                tpot = np.maximum(ring, seq * np.maximum(b[keep], leave[g]))
                energy = a[keep] + power * tpot / seq
                for value, ok, index in zip(energy, tpot <= horizon, keep):
                    if ok and (float(value), paths[index]) < best:
                        best = (float(value), paths[index])
                continue
            for h in free:
                step = float(hop[g, h, x])
                if not np.isfinite(step):
                    continue
                for i in range(x + 1, n + 1):
                    stage = float(time[h, x, i])
                    if not np.isfinite(stage):
                        continue
                    for index in keep:
                        add(
                            used | 1 << h, power + idle_of[h], h, i,
                            float(a[index]) + float(weight[h]) * stage,
                            float(t[index]) + step + stage,
                            max(float(b[index]), step, stage),
                            paths[index] + ((h, x, i),),
                        )
    return best
