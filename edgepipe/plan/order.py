"""Device-order search and the planner's entry point, `plan()`.

This module owns the choice of search (seed 000 §5.5): every order of a small pool at once
with a DP over subsets of devices (or, on request, every permutation through the fixed-order
DP), and beyond that seeded simulated annealing over ordered subsets of devices, started from
the relaxed lower-bound path and the valid paths its Lagrangian tightening meets, and ended
by an exact subset DP over the devices of the best plans it found. For latency, annealing
also reports a proven lower bound (`PlanResult.lower_bound`). On top of the search it
implements the three objectives:

- latency: one search over ring time;
- throughput: a binary search over the bottleneck limit beta; each probe finds the least
  ring time T with every stage and hop <= beta, and 1/throughput = max(T/S, B) is minimised
  at the smallest beta where T/S <= beta or the one just below it (exact when the inner
  search is); stages are replicated over groups of devices (exactly for pools of up to
  `REPLICA_EXACT_DEVICES`; beyond, spares are added greedily and then a local search splits
  and merges groups, each grouping priced at its best split: `replicas.regroup`);
- energy (seed 002's QoE form): energy = A + P*T (A: busy-minus-idle energy, P: idle power
  of the plan's devices). Fixing the device set fixes P, so `energy.search_sets` runs an exact
  subset DP per set (every set of pools up to `ENERGY_EXACT_DEVICES`, else the sets of the best
  plans found), with a Lagrange weight on T bisected until the tpot target is met: exact for
  one sequence without a target, bounded (`PlanResult.bound`, `gap`) with one. Several
  sequences add bottleneck caps, then an exact label DP over (A, T, B) per partial plan
  (`energy.exact_energy`, pruned by the best plan found) proves the optimum among plans
  without replicas, or gives up after `ENERGY_MAX_LABELS` labels (no bound). The older
  linearisation around the current plan still seeds the candidates.

The K best plans on distinct device sets are kept (seed 002's top-K).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .plan import (
    Objective,
    Plan,
    PlanError,
    PlanRequest,
    PlanResult,
    Prediction,
    SearchKind,
    Stage,
    device_map,
    evaluate,
    meets_target,
    objective_key,
    objective_value,
)
from .energy import energy_bound, exact_energy, search_sets
from .replicas import regroup
from .profiles import DeviceProfile, ModelProfile, NetworkProfile
from .split import (
    INF,
    CostTables,
    Path,
    Pricing,
    best_split,
    build_pricing,
    cost_tables,
    device_tables,
    lagrangian_bound,
    relaxed_split,
    subset_dp,
    subset_dp_size,
)

TableMaker = Callable[..., CostTables]
"""Builds the search's cost tables for given `cost_tables` options (spare hooks applied)."""

ENERGY_EXACT_DEVICES = 7
"""Pools up to this size search the energy objective over every device set (3^m DP steps)."""

ENERGY_POLISH_SETS = 4
"""Beyond that, the device sets of this many best energy plans are searched exactly."""

ENERGY_LIMITS = 240
"""Bottleneck caps tried on those sets with several sequences: every distinct stage/hop time
up to the best plan's bottleneck, or this many quantiles of them."""

ENERGY_MAX_LABELS = 40_000
"""With several sequences, the exact label DP gives up (no bound) after this many labels."""

REPLICA_EXACT_DEVICES = 7
"""Pools up to this size search replica groups exactly (every group is a slot): under a
second for 7 devices x 32 units with 4 sequences on the 2-core reference machine."""

REGROUP_EVALUATIONS = 200
"""Beyond that, pipelines of replica groups priced by the split/merge local search
(`replicas.regroup`) from each of the best greedily replicated plans."""

REGROUP_SEEDS = 2
"""How many of the best plans the local search starts from."""

REPLICA_POLISH_CELLS = 400_000
"""Beyond `REPLICA_EXACT_DEVICES`, the exact replica search also runs on the largest subsets
(the best plan's devices, the fastest devices) whose subset-DP table stays under this many
cells; its plans seed the local search."""

SUBSET_DP_MAX_CELLS = 20_000_000
"""Largest subset-DP table (sets x slots x units) searched exactly; beyond, anneal."""

PERMUTATIONS_MAX = 40_320
"""Most orders `exact-permutations` will try (8!)."""

POLISH_DEVICES = 10
"""Annealing ends with an exact subset DP over the devices of its best plans, up to this many."""


@dataclass
class _Found:
    """Best split per device set found by one search, and the deepest partial split."""

    by_set: dict[int, tuple[float, Path]] = field(default_factory=dict)
    covered: int = 0
    partial: Path = ()

    def add(self, cost: float, path: Path, masks: np.ndarray) -> None:
        if not path or not math.isfinite(cost):
            return
        key = 0
        for g, _, _ in path:
            key |= int(masks[g])
        held = self.by_set.get(key)
        if held is None or (cost, path) < held:
            self.by_set[key] = (cost, path)

    def add_partial(self, covered: int, path: Path) -> None:
        if covered > self.covered or (covered == self.covered and path and path < self.partial):
            self.covered, self.partial = covered, path

    def best(self, count: int) -> list[tuple[float, Path]]:
        return sorted(self.by_set.values())[:count]


@dataclass(frozen=True, eq=False)
class _Context:
    model: ModelProfile
    devices: dict[str, DeviceProfile]
    network: NetworkProfile
    request: PlanRequest
    pricing: Pricing
    strategy: SearchKind
    m: int


def _singletons(ctx: _Context) -> list[int]:
    return [g for g, slot in enumerate(ctx.pricing.slots) if len(slot) == 1]


def _search(ctx: _Context, tables: CostTables, steps: int, starts: Sequence[Sequence[int]] = ()) -> _Found:
    """Run the context's strategy on `tables`."""
    found = _Found()
    keep = max(8, 2 * ctx.request.top_k)
    if ctx.strategy == "exact-subset-dp":
        result = subset_dp(tables, ctx.m, keep=keep)
        for cost, path in result.best_by_set.values():
            found.add(cost, path, tables.masks)
        found.add_partial(result.covered, result.partial_path)
    elif ctx.strategy == "exact-permutations":
        for order in itertools.permutations(_singletons(ctx)):
            outcome = best_split(tables, order)
            found.add(outcome.cost, outcome.path, tables.masks)
            found.add_partial(outcome.covered, outcome.partial_path)
    else:
        _anneal(ctx, tables, steps, starts, found)
        _polish(tables, found, keep)
    return found


def _polish(tables: CostTables, found: _Found, keep: int) -> None:
    """Exact search restricted to the devices of the best plans annealing found.

    Annealing finds good device sets more easily than their best order (reversing a whole
    pipeline is one unlikely move); the subset DP settles the order and split exactly.
    """
    pool: list[int] = []
    for _, path in found.best(len(found.by_set)):
        extra = [g for g, _, _ in path if g not in pool]
        if len(pool) + len(extra) > POLISH_DEVICES:
            break
        pool.extend(extra)
    if len(pool) < 2:
        return
    index = np.array(sorted(pool))
    sub = CostTables(
        tables.n,
        np.array([1 << b for b in range(len(index))], dtype=np.int64),
        tables.stage[index],
        tables.hop[np.ix_(index, index)],
        tables.enter[index],
        tables.leave[index],
        tables.leave_partial[index],
    )
    for cost, path in subset_dp(sub, len(index), keep=keep).best_by_set.values():
        found.add(cost, tuple((int(index[g]), x, i) for g, x, i in path), tables.masks)


def _anneal(
    ctx: _Context, tables: CostTables, steps: int, starts: Sequence[Sequence[int]], found: _Found
) -> None:
    """Seeded simulated annealing over ordered subsets of devices (seed 000 §5.5.3).

    The state is the sequence of devices that carry stages; the fixed-order DP prices it
    and drops devices it skips. Moves: insert, remove, replace, swap, move, reverse.
    """
    n = tables.n
    pool = _singletons(ctx)
    rng = random.Random(ctx.request.seed)
    cache: dict[tuple[int, ...], tuple[tuple[float, float], tuple[int, ...]]] = {}

    def score(order: Sequence[int]) -> tuple[tuple[float, float], tuple[int, ...]]:
        key = tuple(order)
        if key not in cache:
            outcome = best_split(tables, key)
            if outcome.complete:
                found.add(outcome.cost, outcome.path, tables.masks)
                used = tuple(g for g, _, _ in outcome.path)
                cache[key] = ((0.0, outcome.cost), used)
            else:
                found.add_partial(outcome.covered, outcome.partial_path)
                used = tuple(g for g, _, _ in outcome.partial_path) or key[:1]
                cache[key] = ((float(n - outcome.covered), INF), used)
        return cache[key]

    relaxed = relaxed_split(tables)
    seeds = [list(dict.fromkeys(g for g, _, _ in relaxed.path))] if relaxed.path else []
    seeds += [list(s) for s in starts]
    fastest = sorted(pool, key=lambda g: (-ctx.devices[ctx.pricing.ids[g]].speed, g))
    seeds.append(fastest)
    scored = [score(s) for s in seeds if s]
    current_key, current = min(scored)
    best_key = current_key
    if steps == 0 or len(pool) < 2:
        return

    def neighbour(order: tuple[int, ...]) -> list[int]:
        state = list(order)
        unused = [g for g in pool if g not in state]
        roll = rng.random()
        if roll < 0.2 and unused:
            state.insert(rng.randrange(len(state) + 1), rng.choice(unused))
        elif roll < 0.35 and len(state) > 1:
            del state[rng.randrange(len(state))]
        elif roll < 0.6 and unused:
            state[rng.randrange(len(state))] = rng.choice(unused)
        elif roll < 0.8 and len(state) > 1:
            a, b = rng.sample(range(len(state)), 2)
            state[a], state[b] = state[b], state[a]
        elif roll < 0.9 and len(state) > 1:
            item = state.pop(rng.randrange(len(state)))
            state.insert(rng.randrange(len(state) + 1), item)
        elif len(state) > 2:
            a, b = sorted(rng.sample(range(len(state) + 1), 2))
            state[a:b] = reversed(state[a:b])
        elif unused:
            state.insert(rng.randrange(len(state) + 1), rng.choice(unused))
        return state

    # Initial temperature from the typical cost difference of a move (seed 000: T0 = 10 * mean).
    deltas = []
    for _ in range(10):
        key, _ = score(neighbour(current))
        if key[0] == current_key[0] == 0.0 and math.isfinite(key[1]):
            deltas.append(abs(key[1] - current_key[1]))
    # Costs may be zero or negative (an energy weight with idle power above busy power), so the
    # temperature scale is the cost's magnitude: a negative ratio would make `cooling` complex.
    scale = abs(current_key[1]) if math.isfinite(current_key[1]) and current_key[1] != 0 else 1.0
    t0 = max(10 * (sum(deltas) / len(deltas) if deltas else 0.0), 1e-6 * scale)
    t_final = 1e-5 * scale
    cooling = (t_final / t0) ** (1.0 / max(steps, 1)) if t0 > t_final else 1.0
    temperature = t0
    patience, idle = max(200, steps // 3), 0
    for _ in range(steps):
        key, used = score(neighbour(current))
        if key[0] < current_key[0]:
            accept = True
        elif key[0] > current_key[0]:
            accept = False
        else:
            # Equal coverage; two partial orders (infinite cost) are a plateau to walk on.
            delta = key[1] - current_key[1] if math.isfinite(key[1]) else 0.0
            accept = delta <= 0 or rng.random() < math.exp(-delta / temperature)
        if accept:
            current_key, current = key, used
        if key < best_key:
            best_key, idle = key, 0
        else:
            idle += 1
            if idle >= patience:
                break
        temperature *= cooling


def _to_stages(ctx: _Context, path: Path) -> tuple[Stage, ...]:
    ids, slots = ctx.pricing.ids, ctx.pricing.slots
    return tuple(Stage(tuple(ids[d] for d in slots[g]), start, end) for g, start, end in path)


@dataclass(frozen=True)
class _Priced:
    key: tuple[float, ...]
    order: str
    stages: tuple[Stage, ...]
    prediction: Prediction

    @property
    def device_set(self) -> frozenset[str]:
        return frozenset(d for s in self.stages for d in s.device_ids)


def _price(ctx: _Context, stages: tuple[Stage, ...]) -> _Priced:
    prediction = evaluate(stages, ctx.model, ctx.devices, ctx.network, ctx.request)
    canonical = repr(tuple((s.device_ids, s.start, s.end) for s in stages))
    # Rounded so that plans equal up to float noise tie, and ties go to the evener pipeline
    # (smaller bottleneck), then to a fixed textual order.
    key = tuple(float(f"{v:.12g}") for v in objective_key(prediction, ctx.request))
    return _Priced(key + (float(f"{prediction.bottleneck_s:.12g}"),), canonical, stages, prediction)


class _Candidates:
    """Priced candidate plans, best per device set."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        self.by_set: dict[frozenset[str], _Priced] = {}
        self.seen: dict[tuple[Stage, ...], _Priced] = {}

    def add_stages(self, stages: tuple[Stage, ...]) -> _Priced:
        priced = self.seen.get(stages)
        if priced is None:
            priced = self.seen[stages] = _price(self.ctx, stages)
            held = self.by_set.get(priced.device_set)
            if held is None or (priced.key, priced.order) < (held.key, held.order):
                self.by_set[priced.device_set] = priced
        return priced

    def add(self, found: _Found, count: int) -> list[_Priced]:
        return [self.add_stages(_to_stages(self.ctx, path)) for _, path in found.best(count)]

    def ranked(self) -> list[_Priced]:
        return sorted(self.by_set.values(), key=lambda p: (p.key, p.order))


def _choose_strategy(request: PlanRequest, n: int, m: int, k: int) -> SearchKind:
    if request.search != "auto":
        if request.search == "exact-permutations" and math.factorial(m) > PERMUTATIONS_MAX:
            raise PlanError(f"exact-permutations over {m} devices is {math.factorial(m)} orders")
        return request.search
    if m <= request.max_exact_devices and subset_dp_size(n, m, k) <= SUBSET_DP_MAX_CELLS:
        return "exact-subset-dp"
    return "annealing"


def plan(
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest = PlanRequest(),
) -> PlanResult:
    """Place `model` on `devices` for `request`'s objective; pure and deterministic.

    Returns the best plan and up to `top_k - 1` runners-up on other device sets, best
    first. If no complete plan exists, `best` is the partial plan that covers the most
    units from unit 0 (`complete=False`), its reason naming the device and bytes that did
    not fit. Same inputs give an identical result (annealing is seeded by `request.seed`).
    """
    return _plan(model, device_map(devices), network, request)


def _plan(
    model: ModelProfile,
    devices: dict[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
    *,
    prefer_not: frozenset[str] = frozenset(),
    forbidden: Mapping[str, tuple[int, int]] | None = None,
) -> PlanResult:
    """`plan()` with two hooks for spare plans: devices in `prefer_not` cost 10x in the search
    (and rank after plans without them); `forbidden[d] = (a, b)` keeps d off ranges meeting [a, b)."""
    n = model.n_units
    seq = request.sequences
    useful = {
        d: dev
        for d, dev in devices.items()
        if any(model.stage_bytes(u, u + 1, seq, dev.precision) <= dev.memory_bytes for u in range(n))
    }
    if not useful:
        return _nothing_fits(model, devices, request)
    m = len(useful)
    replicate = (
        request.objective is Objective.THROUGHPUT
        and request.replicas
        and seq > 1
        and m <= REPLICA_EXACT_DEVICES
        and request.search in ("auto", "exact-subset-dp")
    )
    pricing = build_pricing(model, useful, network, request, max_replicas=min(seq, m) if replicate else 1)
    strategy = _choose_strategy(request, n, m, pricing.k)
    if replicate and strategy != "exact-subset-dp":
        replicate = False
        pricing = build_pricing(model, useful, network, request)
    ctx = _Context(model, useful, network, request, pricing, strategy, m)

    # Spare-plan hooks: busy devices cost 10x in the search and keep off their current ranges.
    penalty = np.ones(pricing.k)
    blocked = np.zeros((pricing.k, n + 1, n + 1), dtype=bool)
    edge = np.arange(n + 1)
    for g, slot in enumerate(pricing.slots):
        for device_id in (pricing.ids[d] for d in slot):
            if device_id in prefer_not:
                penalty[g] = 10.0
            if forbidden and device_id in forbidden:
                a, b = forbidden[device_id]
                blocked[g] |= (edge[:, None] < b) & (edge[None, :] > a)
    adjusted = bool(prefer_not or forbidden)

    def tables(**kwargs: Any) -> CostTables:
        base = cost_tables(pricing, **kwargs)
        if not adjusted:
            return base
        return replace(base, stage=np.where(blocked, INF, base.stage * penalty[:, None, None]))

    candidates = _Candidates(ctx)
    count = max(4, request.top_k + 2)
    steps = request.anneal_steps
    latency_tables = tables()
    starts: list[list[int]] = []
    upper = INF
    if strategy == "annealing":
        # The relaxed path (devices in first-use order) and the valid paths met while
        # tightening its bound are good places to start annealing from.
        relaxed = relaxed_split(latency_tables)
        if relaxed.path:
            repaired = best_split(latency_tables, list(dict.fromkeys(g for g, _, _ in relaxed.path)))
            upper = repaired.cost
            if repaired.complete:
                starts = [[g for g, _, _ in p] for p in lagrangian_bound(latency_tables, upper).paths]
    first = _search(ctx, tables(balance=True), steps, starts)
    candidates.add(first, count)
    bound = None
    energy_lower: float | None = None
    if strategy == "annealing" and first.by_set and not adjusted:
        # A proven lower bound, tightened towards the best plan found.
        best_found = min(cost for cost, _ in first.by_set.values())
        lagrangian = lagrangian_bound(latency_tables, min(best_found, upper))
        for path in lagrangian.paths:
            candidates.add_stages(_to_stages(ctx, path))
        bound = max(lagrangian.bound, relaxed_split(latency_tables).bound)

    if first.by_set:
        if request.objective is Objective.THROUGHPUT and seq > 1:
            _throughput(ctx, candidates, tables, count)
        elif request.objective is Objective.ENERGY:
            ring_lower = bound if bound is not None else relaxed_split(latency_tables).bound
            energy_lower = _energy(ctx, candidates, tables, count, ring_lower, exact_sets=not adjusted)
        if request.objective is Objective.THROUGHPUT and request.replicas and seq > 1 and not replicate:
            _replicate_greedily(ctx, candidates)
            if not adjusted:
                _regroup(ctx, candidates)

    ranked = candidates.ranked()
    if prefer_not:
        ranked.sort(key=lambda p: (len(p.device_set & prefer_not), p.key, p.order))
    if not ranked:
        return _partial(ctx, first, devices)

    plans = []
    for position, priced in enumerate(ranked[: request.top_k]):
        plans.append(
            Plan(
                stages=priced.stages,
                units=n,
                objective=request.objective,
                complete=True,
                predicted=priced.prediction,
                reason=_reason(ctx, priced, ranked[0], position),
                meets_target=meets_target(priced.prediction, request),
            )
        )
    exact = strategy != "annealing"
    lower = None
    if request.objective is Objective.LATENCY and not adjusted:
        lower = plans[0].predicted.ring_s if exact else bound  # type: ignore[union-attr]
    optimal = (exact and request.objective is not Objective.ENERGY) or (
        lower is not None and plans[0].predicted.ring_s <= lower * (1 + 1e-9)  # type: ignore[union-attr]
    )
    if adjusted or (request.objective is Objective.THROUGHPUT and request.replicas and seq > 1 and not replicate):
        optimal = False  # spare-plan ranking, or greedy replication
    value = objective_value(plans[0].predicted, request)  # type: ignore[arg-type]
    proven = None
    if request.objective is Objective.ENERGY:
        optimal = False
        if energy_lower is not None and plans[0].meets_target is not False and not adjusted:
            proven = min(energy_lower, value)
            optimal = value <= proven + 1e-9 * abs(proven)
    elif optimal:
        proven = value
    elif request.objective is Objective.LATENCY and lower is not None:
        proven = lower
    elif request.objective is Objective.THROUGHPUT and not adjusted:
        proven = min(_throughput_bound(ctx), value)
    gap = None if proven is None else (max(value / proven - 1, 0.0) if proven > 0 else 0.0)
    return PlanResult(plans[0], tuple(plans[1:]), strategy, lower, optimal, proven, gap)


def _throughput_bound(ctx: _Context) -> float:
    """A proven lower bound on 1/throughput = max(T / S, B) of any plan, replicas included.

    T is at least the relaxed (device-reuse) ring time with every stage holding one KV cache
    (a replica holds at least one; the slowest replica is no faster than any); B is at least
    the cheapest hop from and to the coordinator, and at least W / sum of speeds: device d is
    busy at most B per token and does at most speed_d x busy_d of the W cost units each token
    needs."""
    request = ctx.request
    one = build_pricing(ctx.model, ctx.devices, ctx.network, replace(request, sequences=1))
    ring = relaxed_split(cost_tables(one)).bound
    work = math.fsum(u.cost for u in ctx.model.units) / math.fsum(d.speed for d in ctx.devices.values())
    ends = min(float(one.enter.min()), float(one.leave.min()))
    return max(ring / request.sequences, work, ends)


def _throughput(ctx: _Context, candidates: _Candidates, tables: TableMaker, count: int) -> None:
    """Binary search on the bottleneck limit (see the module docstring)."""
    pricing, seq = ctx.pricing, ctx.request.sequences
    upper = min(1.0 / p.prediction.throughput_tok_s for p in candidates.ranked())
    values = np.concatenate(
        (
            pricing.eff[np.isfinite(pricing.eff)],
            pricing.hop[np.isfinite(pricing.hop)],
            pricing.enter,
            pricing.leave,
            [upper],
        )
    )
    values = np.unique(values[values <= upper])
    exact = ctx.strategy != "annealing"
    steps = ctx.request.anneal_steps if exact else max(ctx.request.anneal_steps // 4, 50)
    probes: dict[int, bool] = {}
    starts: list[list[int]] = []

    def holds(index: int) -> bool:
        if index not in probes:
            limit = float(values[index])
            found = _search(ctx, tables(bottleneck_limit=limit, balance=True), steps, starts[-1:])
            best = found.best(count)
            candidates.add(found, count)
            probes[index] = bool(best) and best[0][0] / seq <= limit
            if best:
                starts.append([g for g, _, _ in best[0][1]])
        return probes[index]

    hi = len(values) - 1
    lo = bisect.bisect_left(range(hi), True, key=holds)  # the first value that holds (the last if none before it)
    holds(lo)
    if lo > 0:
        holds(lo - 1)


def _energy(
    ctx: _Context, candidates: _Candidates, tables: TableMaker, count: int, ring_lower: float, exact_sets: bool
) -> float | None:
    """The energy search: per-device-set exact DPs with a Lagrange weight on the target
    (`energy.search_sets`: every set of a pool of up to `ENERGY_EXACT_DEVICES`, else the sets
    of the best plans the linearised search below finds), and a proven lower bound for one
    sequence (None otherwise: replicas and the bottleneck regime are not bounded)."""
    _energy_linearised(ctx, candidates, tables, count)
    if not exact_sets:
        return None
    pricing, request = ctx.pricing, ctx.request
    ids = pricing.ids
    m = len(ids)
    busy = np.array([ctx.devices[d].power_busy_w for d in ids])
    idle = np.array([ctx.devices[d].power_idle_w for d in ids])
    target = request.tpot_target_s
    if ctx.strategy != "annealing" and m <= ENERGY_EXACT_DEVICES:
        sets = [tuple(c) for r in range(1, m + 1) for c in itertools.combinations(range(m), r)]
    else:
        sets = []
        for priced in candidates.ranked()[:ENERGY_POLISH_SETS]:
            members = tuple(sorted(ids.index(d) for d in priced.device_set))
            if len(members) <= POLISH_DEVICES and members not in sets:
                sets.append(members)
    ranked = candidates.ranked()
    incumbent = INF
    if ranked and ranked[0].prediction is not None and meets_target(ranked[0].prediction, request) is not False:
        incumbent = ranked[0].prediction.energy_j_per_token if request.sequences == 1 else INF
    found = search_sets(pricing, busy, idle, sets, request.sequences, target, incumbent=incumbent)
    for path in found.paths:
        try:
            candidates.add_stages(_to_stages(ctx, path))
        except PlanError:
            continue
    if request.sequences != 1:
        # Period = max(T / S, B): also search the best sets with the bottleneck capped.
        values = np.concatenate((pricing.eff[:m][np.isfinite(pricing.eff[:m])], pricing.hop[np.isfinite(pricing.hop)]))
        top = candidates.ranked()[0].prediction.bottleneck_s if candidates.ranked() else INF
        values = np.unique(values[values <= top])
        if values.size > ENERGY_LIMITS:
            values = np.unique(np.quantile(values, np.linspace(0, 1, ENERGY_LIMITS)))
        limits = [float(v) for v in values]
        best_sets = []
        for priced in candidates.ranked()[:ENERGY_POLISH_SETS]:
            members = tuple(sorted(ids.index(d) for d in priced.device_set if d in ids))
            if len(members) <= POLISH_DEVICES and members not in best_sets and all(
                len(st.device_ids) == 1 for st in priced.stages
            ):
                best_sets.append(members)
        capped = search_sets(pricing, busy, idle, best_sets, request.sequences, target, limits=limits)
        for path in capped.paths:
            try:
                candidates.add_stages(_to_stages(ctx, path))
            except PlanError:
                continue
        # Without the exact DP: period >= t_d and >= T / S, so the one-sequence bound holds with
        # the ring bound divided by S (energy plans have no replicas).
        fallback = energy_bound(pricing, busy, idle, ring_lower / request.sequences)
        exact = None if ctx.strategy == "annealing" else _energy_exactly(ctx, candidates, busy, idle)
        return fallback if exact is None else exact
    pool_bound = energy_bound(pricing, busy, idle, ring_lower)
    if ctx.strategy != "annealing" and m <= ENERGY_EXACT_DEVICES:
        return max(found.bound, pool_bound)
    return pool_bound


def _energy_exactly(ctx: _Context, candidates: _Candidates, busy: np.ndarray, idle: np.ndarray) -> float | None:
    """Several sequences: the exact label DP (`energy.exact_energy`) under the best plan found
    as incumbent; returns the proven least energy of unreplicated plans, None if it gave up."""
    request, pricing, model = ctx.request, ctx.pricing, ctx.model
    incumbent = INF
    for priced in candidates.ranked():
        if meets_target(priced.prediction, request) is not False:
            incumbent = min(incumbent, priced.prediction.energy_j_per_token)
    if not math.isfinite(incumbent):
        return None
    ids = pricing.ids
    speed = np.array([ctx.devices[d].speed for d in ids])
    rest_cost = np.concatenate((np.cumsum([u.cost for u in model.units][::-1])[::-1], [0.0]))
    rest_time = rest_cost / speed.max() + float(pricing.leave[: len(ids)].min())
    rest_energy = rest_cost * float(((busy - idle) / speed).min())
    found = exact_energy(
        pricing, busy, idle, request.sequences, request.tpot_target_s, incumbent=incumbent,
        rest_time=rest_time, rest_energy=rest_energy, max_labels=ENERGY_MAX_LABELS,
    )
    if found is None:
        return None
    value, path = found
    if path:
        candidates.add_stages(_to_stages(ctx, path))
    return min(value, incumbent)


def _energy_linearised(ctx: _Context, candidates: _Candidates, tables: TableMaker, count: int) -> None:
    """Successive linearisation of energy with a Lagrange weight on time (module docstring)."""
    ids, slots = ctx.pricing.ids, ctx.pricing.slots
    busy = np.array([sum(ctx.devices[ids[d]].power_busy_w for d in s) for s in slots])
    idle = np.array([sum(ctx.devices[ids[d]].power_idle_w for d in s) for s in slots])
    request = ctx.request
    target = request.tpot_target_s

    def linearised(around: _Priced, lam: float) -> _Priced:
        point = around
        for _ in range(4):
            # Idle power is paid over the period 1/throughput, about ring time / sequences.
            p = sum(ctx.devices[d].power_idle_w for d in sorted(point.device_set)) / request.sequences
            theta = point.prediction.tpot_s / request.sequences
            found = _search(
                ctx,
                tables(stage_weight=busy - idle + p + lam, stage_fixed=theta * idle, hop_weight=p + lam),
                request.anneal_steps,
                [[ids.index(d) for s in point.stages for d in s.device_ids]],
            )
            new = candidates.add(found, count)
            if not new or new[0].stages == point.stages:
                return new[0] if new else point
            point = new[0]
        return point

    if request.sequences > 1:
        # With several sequences the fastest plan (least tpot) is the throughput optimum.
        _throughput(ctx, candidates, tables, count)
    fastest = min(candidates.ranked(), key=lambda p: (p.prediction.tpot_s, p.order))
    if target is not None and fastest.prediction.tpot_s > target:
        return  # nothing can meet the target: the fastest plan will be returned
    if ctx.strategy == "annealing":
        # A second start far from the fastest plan, whose idle power (a GPU's) makes time look
        # dear: idle power priced as for two typical (or two most frugal) devices finds frugal multi-device plans
        # (64-device pools: a phones-and-laptop plan 3-13% below the GPU plan, found by the MILP).
        for typical in (np.median(idle[: len(ids)]), idle[: len(ids)].min()):
            reference = 2 * float(typical) / request.sequences
            found = _search(ctx, tables(stage_weight=busy - idle + reference, hop_weight=reference), request.anneal_steps)
            frugal = candidates.add(found, count)
            if frugal:
                linearised(frugal[0], 0.0)
    point = linearised(fastest, 0.0)
    if target is None or point.prediction.tpot_s <= target:
        return
    scale = float(busy.max()) if busy.size else 1.0
    lam_low, lam_high = 0.0, scale
    for _ in range(12):
        point = linearised(point, lam_high)
        if point.prediction.tpot_s <= target:
            break
        lam_low, lam_high = lam_high, lam_high * 4
    for _ in range(6):
        lam = (lam_low + lam_high) / 2
        probe = linearised(point, lam)
        if probe.prediction.tpot_s <= target:
            lam_high = lam
        else:
            lam_low = lam


def _replicate_greedily(ctx: _Context, candidates: _Candidates) -> None:
    """Add spare devices as replicas of stages while that lowers 1/throughput."""
    seq = ctx.request.sequences
    for base in candidates.ranked()[: max(2, ctx.request.top_k)]:
        current = base
        while True:
            spare = [d for d in ctx.pricing.ids if d not in current.device_set]
            best = current
            for index, stage in enumerate(current.stages):
                if len(stage.device_ids) >= seq:
                    continue
                for device_id in spare:
                    grown = Stage(tuple(sorted(stage.device_ids + (device_id,))), stage.start, stage.end)
                    stages = current.stages[:index] + (grown,) + current.stages[index + 1 :]
                    try:
                        priced = candidates.add_stages(stages)
                    except PlanError:
                        continue
                    if (priced.key, priced.order) < (best.key, best.order):
                        best = priced
            if best is current:
                break
            current = best


def _regroup(ctx: _Context, candidates: _Candidates) -> None:
    """Split/merge local search over replica groups from the best plans (`replicas.regroup`)."""
    tables = device_tables(ctx.model, ctx.devices, ctx.network, ctx.request)
    ids = tables.ids
    index = {d: i for i, d in enumerate(ids)}
    speed_rank = sorted(range(len(ids)), key=lambda i: (-ctx.devices[ids[i]].speed, ids[i]))

    def accept(layout: tuple[tuple[tuple[int, ...], int, int], ...]) -> tuple:
        stages = tuple(Stage(tuple(ids[d] for d in group), x, i) for group, x, i in layout)
        try:
            priced = candidates.add_stages(stages)
        except PlanError as error:
            raise ValueError(str(error)) from error
        return (priced.key, priced.order)

    rank_ids = [ids[i] for i in speed_rank]
    size = _polish_size(ctx.model.n_units, ctx.request.sequences, len(ids))
    if size >= 2:
        best = sorted(candidates.ranked()[0].device_set, key=rank_ids.index)
        subsets = []
        for first in (best, []):
            members = tuple(sorted((first + [d for d in rank_ids if d not in first])[:size]))
            if members not in subsets:
                subsets.append(members)
        for members in subsets:
            _replicate_exactly_on(ctx, candidates, members)
    starts = []
    for priced in candidates.ranked()[:REGROUP_SEEDS]:
        start = tuple(tuple(sorted(index[d] for d in stage.device_ids)) for stage in priced.stages)
        if start not in starts:
            starts.append(start)
    for start in starts:
        regroup(tables, start, ctx.request.sequences, speed_rank, REGROUP_EVALUATIONS, accept)


def _polish_size(n: int, sequences: int, m: int) -> int:
    """Largest subset searched exactly with replica groups within `REPLICA_POLISH_CELLS`."""
    best = 0
    for size in range(2, min(m, REPLICA_EXACT_DEVICES) + 1):
        slots = sum(math.comb(size, r) for r in range(1, min(sequences, size) + 1))
        if subset_dp_size(n, size, slots) <= REPLICA_POLISH_CELLS:
            best = size
    return best


def _replicate_exactly_on(ctx: _Context, candidates: _Candidates, members: Sequence[str]) -> None:
    """The exact replica search (every group a slot) restricted to `members`."""
    sub = {d: ctx.devices[d] for d in members}
    request = ctx.request
    pricing = build_pricing(ctx.model, sub, ctx.network, request, max_replicas=min(request.sequences, len(sub)))
    sub_ctx = _Context(ctx.model, sub, ctx.network, request, pricing, "exact-subset-dp", len(sub))
    found = _Candidates(sub_ctx)
    count = max(4, request.top_k + 2)

    def tables(**kwargs: Any) -> CostTables:
        return cost_tables(pricing, **kwargs)

    first = _search(sub_ctx, tables(balance=True), 0)
    found.add(first, count)
    if first.by_set:
        _throughput(sub_ctx, found, tables, count)
    for priced in found.ranked()[:count]:
        candidates.add_stages(priced.stages)


def _reason(ctx: _Context, priced: _Priced, best: _Priced, position: int) -> str:
    request = ctx.request
    prediction = priced.prediction
    where = f"{len(priced.device_set)} of {len(ctx.devices)} devices, {ctx.strategy}"
    value = objective_value(prediction, request)
    base = objective_value(best.prediction, request)
    if request.objective is Objective.LATENCY:
        what = f"ring time {prediction.ring_s * 1e3:.3f} ms/token"
    elif request.objective is Objective.THROUGHPUT:
        what = f"{prediction.throughput_tok_s:.2f} tokens/s with {request.sequences} sequences"
    else:
        what = f"{prediction.energy_j_per_token:.4f} J/token at tpot {prediction.tpot_s * 1e3:.3f} ms"
        if request.tpot_target_s is not None:
            target = request.tpot_target_s * 1e3
            if meets_target(best.prediction, request) is False:
                what = f"no plan meets tpot target {target:.3f} ms; tpot {prediction.tpot_s * 1e3:.3f} ms"
                value, base = prediction.tpot_s, best.prediction.tpot_s
                if position == 0:
                    what += " (fastest plan)"
            else:
                ok = "meets" if meets_target(prediction, request) else "misses"
                what += f" ({ok} target {target:.3f} ms)"
    if position == 0:
        return f"best: {what} ({where})"
    worse = (value / base - 1) * 100 if base > 0 else 0.0
    return f"runner-up {position}: {what}, {worse:+.1f}% vs best ({where})"


def _nothing_fits(model: ModelProfile, devices: dict[str, DeviceProfile], request: PlanRequest) -> PlanResult:
    smallest = min(range(model.n_units), key=lambda u: (model.stage_bytes(u, u + 1, request.sequences), u))
    need = model.stage_bytes(smallest, smallest + 1, request.sequences)
    if devices:
        largest = max(devices.values(), key=lambda d: (d.memory_bytes, d.id))
        why = (
            f"no device can hold any unit: unit {smallest} alone needs {need} bytes, the largest "
            f"device {largest.id!r} has {largest.memory_bytes}"
        )
    else:
        why = "no devices in the pool"
    empty = Plan((), request.objective, False, None, why, None, model.n_units)
    return PlanResult(empty, (), "exact-subset-dp", None, False)


def _partial(ctx: _Context, first: _Found, devices: dict[str, DeviceProfile]) -> PlanResult:
    """The deepest partial plan, with a reason naming what did not fit."""
    model, request = ctx.model, ctx.request
    n, seq = model.n_units, request.sequences
    stages = _to_stages(ctx, first.partial)
    covered = stages[-1].end if stages else 0
    parts = [f"no complete plan: units [0, {covered}) of {n} placed"]
    if stages:
        last = stages[-1]
        device = devices[last.device_ids[0]]
        need = model.stage_bytes(last.start, covered + 1, seq, device.precision)
        parts.append(
            f"extending {device.id!r} to unit {covered} needs {need} bytes > its {device.memory_bytes}"
        )
    used = {d for s in stages for d in s.device_ids}
    free = [d for d in devices.values() if d.id not in used]
    alone = model.stage_bytes(covered, covered + 1, seq)
    if free:
        largest = max(free, key=lambda d: (d.memory_bytes, d.id))
        parts.append(
            f"unit {covered} alone needs {alone} bytes; the largest unused device "
            f"{largest.id!r} has {largest.memory_bytes}"
        )
    else:
        parts.append(f"unit {covered} alone needs {alone} bytes and no device is left")
    prediction = evaluate(stages, model, devices, ctx.network, request) if stages else None
    partial = Plan(stages, request.objective, False, prediction, "; ".join(parts), None, n)
    return PlanResult(partial, (), ctx.strategy, None, False)
