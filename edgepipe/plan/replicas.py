"""Replica groups for the throughput objective beyond the exact search (pure, deterministic).

Up to `order.REPLICA_EXACT_DEVICES` devices every group of devices is a slot of the subset
DP, which is exact. Beyond, `regroup` walks over *ordered lists of groups*: each state is a
pipeline whose stage k runs on group k (one device, or replicas), and its unit ranges are
the best for that order (`order_split`, exact for a fixed order). The moves split a group
into two stages, merge two neighbouring stages into one group, move a device to a
neighbouring group, add, swap in or drop a spare device, and insert a spare as a stage of its
own. Best improvement per round until none improves or the evaluation budget is spent; the
spares tried are the fastest few, in a fixed order, so the search has no randomness.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .split import INF, CostTables, DeviceTables, Path, Pricing, best_split, slot_pricing

Groups = tuple[tuple[int, ...], ...]
"""An ordered list of device groups (device indices, sorted within a group)."""

SPARES_TRIED = 6
"""Fastest unused devices tried by the add, swap and insert moves of one round."""


def order_split(pricing: Pricing, sequences: int) -> tuple[float, Path]:
    """Least 1/throughput = max(T / S, B) over splits of `pricing`'s slots in their order.

    Any slot may be skipped. Exact: T(beta), the least ring time with every stage share and
    hop <= beta, does not grow with beta, so the optimum is at the smallest candidate beta
    with T(beta) / S <= beta or at the one just below it (bisection over the distinct stage
    shares and hop times). Returns (inf, ()) when no split fits.
    """
    order = list(range(pricing.k))
    values = np.concatenate(
        (
            pricing.eff[np.isfinite(pricing.eff)],
            pricing.hop[np.isfinite(pricing.hop)],
            pricing.enter,
            pricing.leave,
        )
    )
    values = np.unique(values)
    if values.size == 0:
        return INF, ()
    probes: dict[int, tuple[float, Path]] = {}
    finite_time = np.where(np.isfinite(pricing.time), pricing.time, INF)

    def probe(index: int) -> tuple[float, Path]:
        if index not in probes:
            beta = float(values[index])
            tables = CostTables(
                pricing.n,
                pricing.masks,
                np.where(pricing.eff <= beta, finite_time, INF),
                np.where(pricing.hop <= beta, pricing.hop, INF),
                np.where(pricing.enter <= beta, pricing.enter, INF),
                np.where(pricing.leave <= beta, pricing.leave, INF),
                pricing.leave_partial,
            )
            outcome = best_split(tables, order)
            probes[index] = (outcome.cost, outcome.path)
        return probes[index]

    def holds(index: int) -> bool:
        ring, path = probe(index)
        return bool(path) and ring / sequences <= float(values[index])

    hi = len(values) - 1
    if not probe(hi)[1]:
        return INF, ()
    lo = bisect.bisect_left(range(hi), True, key=holds)  # the first value that holds (the last if none before it)
    best: tuple[float, Path] = (INF, ())
    for index in (lo - 1, lo):
        if index < 0:
            continue
        ring, path = probe(index)
        if path:
            value = max(ring / sequences, _bottleneck(pricing, path))
            if value < best[0]:
                best = (value, path)
    return best


def _bottleneck(pricing: Pricing, path: Path) -> float:
    shares = [float(pricing.eff[g, x, i]) for g, x, i in path]
    hops = [float(pricing.hop[a[0], b[0], b[1]]) for a, b in zip(path, path[1:])]
    return max(shares + hops + [float(pricing.enter[path[0][0]]), float(pricing.leave[path[-1][0]])])


@dataclass(frozen=True)
class Regrouped:
    """The best pipeline found: its groups in order with their unit ranges, and its value."""

    value: float
    stages: tuple[tuple[tuple[int, ...], int, int], ...]
    evaluations: int


def _neighbours(state: Groups, spares: Sequence[int], sequences: int) -> Iterator[Groups]:
    """Every move of the module docstring from `state`, in a fixed order."""
    size = len(state)

    def ok(groups: list[tuple[int, ...]]) -> Groups | None:
        groups = [tuple(sorted(g)) for g in groups if g]
        if not groups or any(len(g) > sequences for g in groups):
            return None
        return tuple(groups)

    candidates: list[Groups | None] = []
    for i in range(size - 1):  # merge two neighbouring stages
        candidates.append(ok([*state[:i], state[i] + state[i + 1], *state[i + 2 :]]))
    for i, group in enumerate(state):
        if len(group) > 1:  # split a group into two stages
            halves = (group[0::2], group[1::2])
            for first, second in (halves, halves[::-1]):
                candidates.append(ok([*state[:i], first, second, *state[i + 1 :]]))
            for member in group:
                rest = tuple(d for d in group if d != member)
                candidates.append(ok([*state[:i], (member,), rest, *state[i + 1 :]]))
                candidates.append(ok([*state[:i], rest, (member,), *state[i + 1 :]]))
                candidates.append(ok([*state[:i], rest, *state[i + 1 :]]))  # drop it
        for member in group:  # move a device to a neighbouring group
            rest = tuple(d for d in group if d != member)
            for j in (i - 1, i + 1):
                if 0 <= j < size and rest:
                    groups = list(state)
                    groups[i], groups[j] = rest, state[j] + (member,)
                    candidates.append(ok(groups))
        for spare in spares:  # add a spare, or swap one in
            candidates.append(ok([*state[:i], group + (spare,), *state[i + 1 :]]))
            for member in group:
                swapped = tuple(spare if d == member else d for d in group)
                candidates.append(ok([*state[:i], swapped, *state[i + 1 :]]))
    for spare in spares[:2]:  # a spare as a stage of its own
        for i in range(size + 1):
            candidates.append(ok([*state[:i], (spare,), *state[i:]]))
    seen: set[Groups] = set()
    for groups in candidates:
        if groups is not None and groups not in seen:
            seen.add(groups)
            yield groups


def regroup(
    tables: DeviceTables,
    start: Groups,
    sequences: int,
    speed_rank: Sequence[int],
    budget: int,
    accept: Callable[[tuple[tuple[tuple[int, ...], int, int], ...]], tuple] | None = None,
) -> Regrouped:
    """Local search from `start` (module docstring); at most `budget` pipelines priced.

    `speed_rank` lists the pool's devices fastest first (the order spares are tried in).
    `accept`, when given, ranks a priced layout (smaller is better) instead of its value, so
    the caller can apply the cost model's full tie-breaks; it may raise ValueError to reject.
    """
    Layout = tuple[tuple[tuple[int, ...], int, int], ...]
    cache: dict[Groups, tuple[tuple, Groups, Layout, float] | None] = {}
    evaluations = 0

    def price(groups: Groups) -> tuple[tuple, Groups, Layout, float] | None:
        nonlocal evaluations
        if groups not in cache:
            evaluations += 1
            value, path = order_split(slot_pricing(tables, groups), sequences)
            if not path:
                cache[groups] = None
            else:
                layout = tuple((groups[g], x, i) for g, x, i in path)
                try:
                    key = accept(layout) if accept is not None else (value,)
                except ValueError:
                    key = None
                cache[groups] = None if key is None else (key, tuple(groups[g] for g, _, _ in path), layout, value)
        return cache[groups]

    current = price(start)
    if current is None:
        return Regrouped(INF, (), evaluations)
    while evaluations < budget:
        used = {d for g in current[1] for d in g}
        spares = [d for d in speed_rank if d not in used][:SPARES_TRIED]
        best = current
        for groups in _neighbours(current[1], spares, sequences):
            if evaluations >= budget:
                break
            priced = price(groups)
            if priced is not None and priced[0] < best[0]:
                best = priced
        if best is current:
            break
        current = best
    return Regrouped(current[3], current[2], evaluations)
