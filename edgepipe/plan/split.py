"""Contiguous splits: price tables and the dynamic programmes that search them.

This module owns
- `Pricing`: the cost model of `plan.evaluate` laid out as numpy tables over every
  (slot, range) and (slot, slot, boundary) for one planning call. A *slot* is what a stage
  runs on: one device, or a group of devices replicating the stage;
- `CostTables`: the additive cost the searches minimise (time, or a weighted time for the
  energy objective, with ranges over a bottleneck limit removed);
- the exact searches over those tables: `best_split` for a fixed order of slots (seed 000,
  algorithm 5.1, extended with per-pair hop costs), `subset_dp` over sets of used slots
  (exact over every order);
- lower bounds: `relaxed_split` lets a device appear more than once, `cost_to_go` is the
  same bound run backwards (used to prune the subset DP), and `lagrangian_bound` tightens
  the relaxation by pricing reuse.

Ranges that do not fit memory are infinite in the tables. Because memory grows with the
range, the feasible starts of a stage ending at unit i form one window; masking them up
front is what algorithm 5.1's early `break` does, done once per call instead of per order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np

from .plan import PlanRequest, replica_sequences
from .profiles import COORDINATOR, DeviceProfile, ModelProfile, NetworkProfile

INF = float("inf")

Path = tuple[tuple[int, int, int], ...]
"""A split as (slot, start, end) triples, contiguous from unit 0."""


@dataclass(frozen=True, eq=False)
class Pricing:
    """Time and memory of every stage and hop for one (model, pool, network, request).

    Index conventions: devices are `ids` (sorted), slots are `slots` (tuples of device
    indices; singletons first, in device order). Arrays hold +inf where a stage does not
    fit memory, where x >= i, and for hops between slots that share a device.
    """

    ids: tuple[str, ...]
    n: int
    slots: tuple[tuple[int, ...], ...]
    masks: np.ndarray  # (k,) bitmask of the devices in each slot
    time: np.ndarray  # (k, n+1, n+1) time of stage [x, i) on the slot (slowest replica)
    eff: np.ndarray  # (k, n+1, n+1) its share of the bottleneck: time / replicas
    hop: np.ndarray  # (k, k, n+1) hop at boundary x (1..n-1) from slot g to slot h
    enter: np.ndarray  # (k,) coordinator -> slot, one token id
    leave: np.ndarray  # (k,) slot -> coordinator, one token id
    leave_partial: np.ndarray  # (k, n+1) slot -> coordinator with unit x-1's activations

    @property
    def k(self) -> int:
        return len(self.slots)


@dataclass(frozen=True, eq=False)
class DeviceTables:
    """Per-device costs for one (model, pool, network, request), before slots are formed.

    `slot_pricing` turns them into a `Pricing` for any list of slots (device groups) without
    re-reading the network: the replica searches price many groupings of one pool.
    """

    ids: tuple[str, ...]
    n: int
    sequences: int
    dev_time: np.ndarray  # (m, n+1, n+1) time of [x, i) on each device, inf where x >= i
    dev_row: np.ndarray  # (m, n+1, n+1) each further row of a batched step of [x, i); nan: no row_speed (a row = a step)
    needs: dict[tuple[int, str | None], np.ndarray]  # (KV caches, precision) -> (n+1, n+1) bytes
    precisions: tuple[str | None, ...]
    memory: np.ndarray  # (m,) bytes
    model: ModelProfile
    dev_hop: np.ndarray  # (m, m, n+1)
    dev_enter: np.ndarray  # (m,)
    dev_leave: np.ndarray  # (m,)
    dev_leave_partial: np.ndarray  # (m, n+1)
    speed: np.ndarray | None = None  # (m,) cost units / s (the MoE expert reads of a batched step)
    expert_spans: dict[int, np.ndarray] = field(default_factory=dict)  # rows -> (n+1, n+1), see expert_span

    def expert_span(self, rows: int) -> np.ndarray | None:
        """(n+1, n+1) cost units a ``rows``-row step of [x, i) spends reading MoE experts beyond
        a one-row step's (``plan.moe.extra_cost``); None for a model without MoE layers."""
        if not any(u.experts for u in self.model.units):
            return None
        if rows not in self.expert_spans:
            from .moe import extra_cost

            prefix = np.concatenate(([0.0], np.cumsum([extra_cost(u, rows) for u in self.model.units], dtype=np.float64)))
            self.expert_spans[rows] = np.where(np.triu(np.ones((self.n + 1, self.n + 1), dtype=bool), k=1),
                                               prefix[None, :] - prefix[:, None], 0.0)
        return self.expert_spans[rows]

    def need(self, sequences: int, precision: str | None) -> np.ndarray:
        key = (sequences, precision)
        if key not in self.needs:
            self.needs[key] = _stage_need(self.model, sequences, precision)
        return self.needs[key]


def _stage_need(model: ModelProfile, sequences: int, precision: str | None) -> np.ndarray:
    """(n+1, n+1) bytes of stage [x, i) with `sequences` KV caches in weight variant `precision`."""
    n = model.n_units
    kv_prefix = np.concatenate(([0], np.cumsum(model.unit_kv(precision), dtype=np.int64)))
    weight_prefix = np.concatenate(([0], np.cumsum(model.unit_weights(precision), dtype=np.int64)))
    weights = weight_prefix[None, :] - weight_prefix[:, None]
    if n > 1:
        weights[0, n] -= model.tied_bytes  # one stage holds the tied embedding and head
    kv = kv_prefix[None, :] - kv_prefix[:, None]
    return weights + sequences * kv + model.runtime_overhead_bytes


def device_tables(
    model: ModelProfile,
    devices: Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
) -> DeviceTables:
    """Stage times, memory needs and hops per device (ids in sorted order)."""
    ids = tuple(sorted(devices))
    m, n = len(ids), model.n_units
    units = model.units
    cost_prefix = np.concatenate(([0.0], np.cumsum([u.cost for u in units], dtype=np.float64)))
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)  # x < i
    span = cost_prefix[None, :] - cost_prefix[:, None]
    speed = np.array([devices[d].speed for d in ids])
    overhead = np.array([devices[d].overhead_s for d in ids])
    memory = np.array([devices[d].memory_bytes for d in ids], dtype=np.int64)
    dev_time = np.where(upper[None], overhead[:, None, None] + span[None] / speed[:, None, None], INF)
    row_speed = np.array([devices[d].row_speed if devices[d].row_speed is not None else np.nan for d in ids])
    dev_row = np.where(upper[None], span[None] / row_speed[:, None, None], 0.0)

    # Device-level links, with the coordinator as node m; relays pay both legs.
    nodes = ids + (COORDINATOR,)
    half_rtt = np.empty((m + 1, m + 1))
    bandwidth = np.empty((m + 1, m + 1))
    for a, src in enumerate(nodes):
        for b, dst in enumerate(nodes):
            link = network.link(src, dst)
            half_rtt[a, b], bandwidth[a, b] = link.rtt_s / 2, link.bandwidth_bytes_per_s
    relay = np.array([devices[d].relay for d in ids] + [False])
    out_bytes = np.zeros(n + 1)
    out_bytes[1:] = [u.out_bytes_per_token for u in units]  # boundary x carries unit x-1's output
    scale = np.array([devices[d].activation_scale for d in ids])  # sender's wire dtype
    sent = scale[:, None] * out_bytes[None, :]  # (m, n+1) activation bytes device a sends at x

    def leg(a: np.ndarray | int, b: np.ndarray | int, nbytes: np.ndarray | float) -> np.ndarray:
        return half_rtt[a, b] + nbytes / bandwidth[a, b]

    coord = m
    dev = np.arange(m)
    direct = half_rtt[:m, :m, None] + sent[:, None, :] / bandwidth[:m, :m, None]
    via = (
        half_rtt[:m, coord, None, None]
        + sent[:, None, :] / bandwidth[:m, coord, None, None]
        + (half_rtt[coord, :m, None] + sent[:, None, :] / bandwidth[coord, :m, None])
    )
    relayed = (relay[:m, None] | relay[None, :m])[:, :, None]
    dev_hop = np.where(relayed, via, direct)
    dev_hop[dev, dev, :] = INF
    dev_hop[:, :, 0] = INF
    dev_hop[:, :, n] = INF
    token = float(model.token_id_bytes)
    return DeviceTables(
        ids=ids,
        n=n,
        sequences=request.sequences,
        dev_time=dev_time,
        dev_row=dev_row,
        needs={},
        precisions=tuple(devices[d].precision for d in ids),
        memory=memory,
        model=model,
        dev_hop=dev_hop,
        dev_enter=leg(coord, dev, token),
        dev_leave=leg(dev, coord, token),
        dev_leave_partial=half_rtt[:m, coord, None] + sent / bandwidth[:m, coord, None],
        speed=speed,
    )


def slot_pricing(tables: DeviceTables, slots: Sequence[tuple[int, ...]]) -> Pricing:
    """Price `slots` (tuples of device indices; a group replicates its stage) from `tables`."""
    ids, n, m = tables.ids, tables.n, len(tables.ids)
    slots = [tuple(s) for s in slots]
    k = len(slots)
    upper = np.isfinite(tables.dev_time[0]) if m else np.zeros((n + 1, n + 1), dtype=bool)
    # Python ints beyond 62 devices: only the subset DP needs fast masks, and it never runs there.
    masks = np.array([sum(1 << d for d in slot) for slot in slots], dtype=np.int64 if m <= 62 else object)
    time = np.empty((k, n + 1, n + 1))
    eff = np.empty((k, n + 1, n + 1))
    for g, slot in enumerate(slots):
        members = list(slot)
        caches = replica_sequences(tables.sequences, len(slot))
        fits = np.stack([tables.need(caches, tables.precisions[d]) <= tables.memory[d] for d in members]).all(0)
        slowest = tables.dev_time[members].max(0)
        time[g] = np.where(fits & upper, slowest, INF)
        eff[g] = np.where(fits & upper, _token_share(tables, members), INF)

    singletons = all(len(s) == 1 for s in slots)
    if singletons and [s[0] for s in slots] == list(range(m)):
        hop, enter, leave, leave_partial = tables.dev_hop, tables.dev_enter, tables.dev_leave, tables.dev_leave_partial
    else:
        hop = np.empty((k, k, n + 1))
        for g, a in enumerate(slots):
            for h, b in enumerate(slots):
                hop[g, h] = tables.dev_hop[np.ix_(a, b)].max(axis=(0, 1)) if not set(a) & set(b) else INF
        enter = np.array([tables.dev_enter[list(s)].max() for s in slots])
        leave = np.array([tables.dev_leave[list(s)].max() for s in slots])
        leave_partial = np.stack([tables.dev_leave_partial[list(s)].max(0) for s in slots]) if slots else np.zeros((0, n + 1))
    return Pricing(
        ids=ids,
        n=n,
        slots=tuple(slots),
        masks=masks,
        time=time,
        eff=eff,
        hop=hop,
        enter=enter,
        leave=leave,
        leave_partial=leave_partial,
    )


def _token_share(tables: DeviceTables, members: list[int]) -> np.ndarray:
    """(n+1, n+1) the slot's share of the bottleneck per produced token: its slowest member's
    `DeviceProfile.token_share` (one step of its ceil(S / r) sequences, / S; without `row_speed`, t / r)."""
    r, sequences = len(members), tables.sequences
    shares = []
    for d in members:
        rows = tables.dev_row[d]
        if np.isnan(rows).any():
            shares.append(tables.dev_time[d] / r)
        else:
            busiest = replica_sequences(sequences, r)
            experts = tables.expert_span(busiest)
            extra = 0.0 if experts is None else experts / tables.speed[d]
            shares.append((tables.dev_time[d] + (busiest - 1) * rows + extra) / sequences)
    return np.max(shares, axis=0)


def build_pricing(
    model: ModelProfile,
    devices: Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
    *,
    max_replicas: int = 1,
    replica_pool: Sequence[str] | None = None,
) -> Pricing:
    """Lay out the cost model of `evaluate` for `devices` (ids in sorted order).

    With `max_replicas` > 1, slots also include every group of up to that many devices
    taken from `replica_pool` (default: all), each group replicating one stage.
    """
    tables = device_tables(model, devices, network, request)
    ids, m = tables.ids, len(tables.ids)
    slots: list[tuple[int, ...]] = [(d,) for d in range(m)]
    if max_replicas > 1:
        pool = sorted(ids.index(d) for d in (replica_pool if replica_pool is not None else ids))
        for r in range(2, min(max_replicas, len(pool)) + 1):
            slots.extend(combinations(pool, r))
    return slot_pricing(tables, slots)


@dataclass(frozen=True, eq=False)
class CostTables:
    """The additive cost a search minimises: stage[g, x, i], hop[g, h, x], enter[g], leave[g]."""

    n: int
    masks: np.ndarray
    stage: np.ndarray
    hop: np.ndarray
    enter: np.ndarray
    leave: np.ndarray
    leave_partial: np.ndarray

    @property
    def k(self) -> int:
        return len(self.masks)


def cost_tables(
    pricing: Pricing,
    *,
    bottleneck_limit: float = INF,
    stage_weight: np.ndarray | float = 1.0,
    stage_fixed: np.ndarray | float = 0.0,
    hop_weight: float = 1.0,
    balance: bool = False,
) -> CostTables:
    """Weighted costs: `stage_weight[g] * time + stage_fixed[g]` per stage, `hop_weight * hop`.

    Stages whose bottleneck share, and hops whose time, exceed `bottleneck_limit` are removed.
    With the defaults the cost of a path is its ring time T. `balance` adds 1e-9 * time^2 /
    (largest stage time) per stage: among splits of equal cost it prefers even stage times,
    and it moves a cost by at most a billionth (never use it for bounds).
    """
    weight = np.broadcast_to(np.asarray(stage_weight, dtype=np.float64), (pricing.k,))
    fixed = np.broadcast_to(np.asarray(stage_fixed, dtype=np.float64), (pricing.k,))
    finite_time = np.isfinite(pricing.time)
    # Weights may be negative (idle power above busy power): price finite entries only.
    stage = weight[:, None, None] * np.where(finite_time, pricing.time, 0.0) + fixed[:, None, None]
    if balance:
        finite = pricing.time[np.isfinite(pricing.time)]
        if finite.size:
            stage = stage + 1e-9 * pricing.time**2 / max(float(finite.max()), 1e-300)
    hop, enter, leave = pricing.hop, pricing.enter, pricing.leave
    if hop_weight != 1.0:
        # inf * 0 would be nan: an unreachable hop stays unreachable at any weight.
        reachable = np.isfinite(hop)
        hop = np.where(reachable, np.where(reachable, hop, 0.0) * hop_weight, INF)
        enter, leave = enter * hop_weight, leave * hop_weight
    if bottleneck_limit < INF:
        stage = np.where(pricing.eff <= bottleneck_limit, stage, INF)
        hop = np.where(pricing.hop <= bottleneck_limit, hop, INF)
        enter = np.where(pricing.enter <= bottleneck_limit, enter, INF)
        leave = np.where(pricing.leave <= bottleneck_limit, leave, INF)
    stage = np.where(finite_time, stage, INF)
    return CostTables(
        n=pricing.n,
        masks=pricing.masks,
        stage=stage,
        hop=hop,
        enter=enter,
        leave=leave,
        leave_partial=pricing.leave_partial * hop_weight,
    )


@dataclass(frozen=True)
class Outcome:
    """Best complete split found (cost inf and path () if none) and the deepest partial one."""

    cost: float
    path: Path
    covered: int
    partial_path: Path

    @property
    def complete(self) -> bool:
        return bool(self.path)


def best_split(tables: CostTables, order: Sequence[int]) -> Outcome:
    """Exact best split for a fixed order of slots; any slot may be skipped (costs nothing).

    O(n^2 m + n m^2): the state is (units covered, last slot used), because a hop's cost
    depends on both of its ends. Slots in `order` must not share devices.
    """
    n, order = tables.n, list(order)
    length = len(order)
    if length == 0:
        return Outcome(INF, (), 0, ())
    value = np.full((length, n + 1), INF)  # value[p, i]: units [0, i) done, last stage on order[p]
    entry = np.full((length, n + 1), INF)  # cheapest arrival at order[p] before unit x
    came = np.full((length, n + 1), -1)  # position of the previous stage for that arrival
    for p, h in enumerate(order):
        entry[p, 0] = tables.enter[h]
        if p and n > 1:
            prev = np.asarray(order[:p])
            arrive = value[:p, 1:n] + tables.hop[prev, h, 1:n]
            came[p, 1:n] = arrive.argmin(0)
            entry[p, 1:n] = arrive[came[p, 1:n], np.arange(n - 1)]
        value[p] = (entry[p, :n, None] + tables.stage[h, :n, :]).min(0)

    totals = value[:, n] + tables.leave[order]
    best = int(np.argmin(totals))
    cost = float(totals[best])

    def backtrack(p: int, i: int) -> Path:
        path = []
        while True:
            h = order[p]
            x = int(np.argmin(entry[p, :n] + tables.stage[h, :n, i]))
            path.append((h, x, i))
            if x == 0:
                return tuple(reversed(path))
            p, i = int(came[p, x]), x

    if np.isfinite(cost):
        return Outcome(cost, backtrack(best, n), n, ())
    covered, p = _deepest(value, tables, order)
    return Outcome(INF, (), covered, backtrack(p, covered) if covered else ())


def _deepest(value: np.ndarray, tables: CostTables, slots: Sequence[int]) -> tuple[int, int]:
    """Deepest unit boundary reached by any row of `value`, and the cheapest row reaching it."""
    reached = np.isfinite(value).any(0)
    reached[0] = False
    if not reached.any():
        return 0, 0
    i = int(np.flatnonzero(reached)[-1])
    priced = value[:, i] + tables.leave_partial[list(slots), i]
    return i, int(np.argmin(priced))


@dataclass(frozen=True, eq=False)
class SubsetResult:
    """Every set of used devices with its best complete split, plus the deepest partial one."""

    best_by_set: dict[int, tuple[float, Path]]
    covered: int
    partial_path: Path


def subset_dp_size(n: int, m: int, k: int) -> int:
    """Cells of `subset_dp`'s table; callers use it to decide whether the DP is affordable."""
    return (1 << m) * k * (n + 1)


def cost_to_go(tables: CostTables) -> np.ndarray:
    """Lower bound on finishing from boundary x after a stage on slot g: (k, n+1) array.

    Computed like `relaxed_split`, backwards: slots may be reused, so it never overestimates.
    Column n is 0 (nothing left but the hop home, which the caller adds).
    """
    n, k = tables.n, tables.k
    after = np.full((k, n + 1), INF)  # finishing once a stage on g ends at boundary i
    after[:, n] = tables.leave
    to_go = np.full((k, n + 1), INF)
    to_go[:, n] = 0.0
    for x in range(n - 1, 0, -1):
        start_here = (tables.stage[:, x, x + 1 :] + after[:, x + 1 :]).min(1)  # (k,) stage on h from x
        to_go[:, x] = (tables.hop[:, :, x] + start_here[None, :]).min(1)
        after[:, x] = to_go[:, x]
    return to_go


def subset_dp(tables: CostTables, m: int, keep: int | None = None) -> SubsetResult:
    """Exact search over every order at once: a DP over (set of used devices, last slot, units).

    Held-Karp style, O(2^m k^2 n^2) worst case but vectorised per set. Returns, for each
    device set that covers the model, its best split; with `keep`, only the `keep` cheapest
    sets are guaranteed and reconstructed, which lets it drop every partial state whose cost
    plus `cost_to_go` exceeds the keep-th cheapest complete set found so far.
    """
    n, k = tables.n, tables.k
    masks = tables.masks
    size = 1 << m
    value = np.full((size, k, n + 1), INF)
    seeded = tables.enter[:, None] + tables.stage[:, 0, :]
    value[masks, np.arange(k)] = seeded
    alive = np.zeros(size, dtype=bool)
    alive[masks] = True
    to_go = cost_to_go(tables)[:, 1:n] if keep is not None else None
    complete: list[float] = []  # best complete cost of each set already final
    limit = INF
    # Only the window of unit boundaries some state reached is extended, which keeps steps small.
    for used in range(1, size):
        if not alive[used]:
            continue
        done = float((value[used, :, n] + tables.leave).min())
        if keep is not None and done < INF:
            complete.append(done)
            if len(complete) >= keep:
                complete.sort()
                del complete[keep:]
                limit = complete[-1] * (1 + 1e-12)
        rows = value[used, :, 1:n]
        if to_go is not None and limit < INF:
            rows = np.where(rows + to_go > limit, INF, rows)
        open_cols = np.isfinite(rows)
        live = np.flatnonzero(open_cols.any(1))
        free = np.flatnonzero((masks & used) == 0)
        if live.size == 0 or free.size == 0:
            continue
        cols = np.flatnonzero(open_cols[live].any(0))
        lo, hi = int(cols[0]) + 1, int(cols[-1]) + 2  # boundaries x in [lo, hi) were reached
        arrive = rows[live, None, lo - 1 : hi - 1] + tables.hop[live[:, None], free[None, :], lo:hi]
        entry = arrive.min(0)  # (free, x): cheapest arrival at each free slot before unit x
        reach = (entry[:, :, None] + tables.stage[free, lo:hi, lo + 1 :]).min(1)  # (free, i > lo)
        targets = used | masks[free]
        current = value[targets, free, lo + 1 :]
        value[targets, free, lo + 1 :] = np.minimum(current, reach)
        alive[targets] |= np.isfinite(reach).any(1)

    def backtrack(used: int, g: int, i: int) -> Path:
        path = []
        while True:
            if used == masks[g]:
                path.append((g, 0, i))
                return tuple(reversed(path))
            before = used & ~int(masks[g])
            cand = np.flatnonzero((masks & ~before) == 0)  # slots made of devices used before
            arrive = value[before, cand, 1:i] + tables.hop[cand, g, 1:i] + tables.stage[g, 1:i, i][None, :]
            flat = int(np.argmin(arrive))
            row, col = divmod(flat, arrive.shape[1])
            path.append((g, col + 1, i))
            used, g, i = before, int(cand[row]), col + 1

    totals = value[:, :, n] + tables.leave[None, :]
    last = totals.argmin(1)
    best = totals[np.arange(size), last]
    finite = np.flatnonzero(np.isfinite(best))
    if keep is not None and finite.size > keep:
        finite = finite[np.lexsort((finite, best[finite]))[:keep]]
    best_by_set = {
        int(u): (float(best[u]), backtrack(int(u), int(last[u]), n)) for u in finite
    }
    covered, partial = 0, ()
    if not best_by_set:
        reached = np.isfinite(value[:, :, 1:n]).any((0, 1))
        if reached.any():
            covered = int(np.flatnonzero(reached)[-1]) + 1
            priced = value[:, :, covered] + tables.leave_partial[None, :, covered]
            used, g = np.unravel_index(int(np.argmin(priced)), priced.shape)
            partial = backtrack(int(used), int(g), covered)
    return SubsetResult(best_by_set, covered, partial)


@dataclass(frozen=True)
class Relaxed:
    """Lower bound on the cost of any valid split, and the split that attains it.

    The path may use a device twice; when it does not, it is an optimal valid split.
    """

    bound: float
    path: Path

    @property
    def elementary(self) -> bool:
        slots = [g for g, _, _ in self.path]
        return len(slots) == len(set(slots))


def relaxed_split(tables: CostTables) -> Relaxed:
    """Shortest path over (unit boundary, last slot) that may reuse a slot: O(n^2 k + n k^2).

    Every valid split is such a path, so its cost is a lower bound. Consecutive stages on
    the same slot are not allowed (their hop is infinite), as in any valid split.
    """
    n, k = tables.n, tables.k
    value = tables.enter[:, None] + tables.stage[:, 0, :]  # (k, n+1)
    entry = np.full((n + 1, k), INF)
    came = np.full((n + 1, k), -1)
    entry[0] = tables.enter
    for x in range(1, n):
        arrive = value[:, x, None] + tables.hop[:, :, x]  # (prev, next)
        came[x] = arrive.argmin(0)
        entry[x] = arrive[came[x], np.arange(k)]
        value[:, x + 1 :] = np.minimum(value[:, x + 1 :], entry[x][:, None] + tables.stage[:, x, x + 1 :])
    totals = value[:, n] + tables.leave
    g = int(np.argmin(totals))
    bound = float(totals[g])
    if not np.isfinite(bound):
        return Relaxed(INF, ())
    path = []
    i = n
    while True:
        x = int(np.argmin(entry[:i, g] + tables.stage[g, :i, i]))
        path.append((g, x, i))
        if x == 0:
            break
        g, i = int(came[x, g]), x
    return Relaxed(bound, tuple(reversed(path)))


@dataclass(frozen=True)
class Lagrangian:
    """Best Lagrangian lower bound found, and the distinct valid paths met on the way."""

    bound: float
    paths: tuple[Path, ...]


def lagrangian_bound(tables: CostTables, upper: float, iterations: int = 60) -> Lagrangian:
    """Tighten `relaxed_split` by pricing the "each slot at most once" rule (subgradient).

    For multipliers mu >= 0, min over relaxed paths of cost + sum mu_g (uses_g - 1) is a
    lower bound on every valid split; mu rises on slots a path reuses (Polyak steps towards
    `upper`, a known achievable cost). Paths that use no slot twice are valid plans and are
    returned for the caller to price. Deterministic: no randomness.
    """
    k = tables.k
    mu = np.zeros(k)
    best = -INF
    paths: dict[Path, None] = {}
    step_scale, stalled = 1.0, 0
    for _ in range(iterations):
        stage = tables.stage + mu[:, None, None]
        relaxed = relaxed_split(CostTables(tables.n, tables.masks, stage, tables.hop, tables.enter, tables.leave, tables.leave_partial))
        if not relaxed.path:
            break
        value = relaxed.bound - float(mu.sum())
        if value > best + 1e-15:
            best, stalled = value, 0
        else:
            stalled += 1
            if stalled >= 5:
                step_scale, stalled = step_scale / 2, 0
        uses = np.zeros(k)
        for g, _, _ in relaxed.path:
            uses[g] += 1
        if relaxed.elementary:
            paths.setdefault(relaxed.path)
        gradient = uses - 1
        gradient[(mu <= 0) & (gradient < 0)] = 0  # projected: mu stays >= 0
        norm = float((gradient**2).sum())
        if norm == 0 or upper - value <= 1e-12 * abs(upper):
            break
        mu = np.maximum(0.0, mu + step_scale * (upper - value) / norm * gradient)
    return Lagrangian(best, tuple(paths))
