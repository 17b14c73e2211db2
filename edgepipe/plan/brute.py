"""An independent brute force over every plan of a small pool: the yardstick for `plan()`.

Enumerates every ordered choice of distinct device groups (one device, or up to
`max_group` replicas) times every contiguous split of the units, prices each plan with its
own arithmetic (written again from DESIGN.md "The planner", not calling `plan.evaluate` or
the price tables) and returns the best value per objective. Exponential: tests and
benchmarks only, for pools of a few devices and units.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .profiles import COORDINATOR, DeviceProfile, ModelProfile, NetworkProfile

Layout = tuple[tuple[tuple[str, ...], int, int], ...]
"""(device ids, start, end) per stage."""


@dataclass(frozen=True)
class Priced:
    ring_s: float
    tpot_s: float
    energy_j: float


def price(layout: Layout, model: ModelProfile, devices: dict[str, DeviceProfile], network: NetworkProfile,
          sequences: int) -> Priced | None:
    """Ring time, time per token and energy per token of a complete layout (None: does not fit)."""
    n = model.n_units

    def weights(device: DeviceProfile, start: int, end: int) -> int:
        sizes = dict(model.variant_weight_bytes).get(device.precision or "", None)
        total = 0
        for u in range(start, end):
            total += sizes[u] if sizes is not None else model.units[u].weight_bytes
        if start == 0 and end == n and n > 1:
            total -= model.tied_bytes
        return total

    def leg(a: str, b: str, nbytes: float) -> float:
        link = network.link(a, b)
        return link.rtt_s / 2 + nbytes / link.bandwidth_bytes_per_s

    def hop(a: str, b: str, nbytes: float) -> float:
        if a != COORDINATOR and b != COORDINATOR and (devices[a].relay or devices[b].relay):
            return leg(a, COORDINATOR, nbytes) + leg(COORDINATOR, b, nbytes)
        return leg(a, b, nbytes)

    ring = 0.0
    worst = 0.0
    busy_s: dict[str, float] = {}
    for ids, start, end in layout:
        r = len(ids)
        per_replica = -(-sequences // r)
        cost = sum(model.units[u].cost for u in range(start, end))
        slowest = 0.0
        for d in ids:
            device = devices[d]
            need = weights(device, start, end) + per_replica * sum(model.unit_kv(device.precision)[start:end]) + model.runtime_overhead_bytes
            if need > device.memory_bytes:
                return None
            t = device.overhead_s + cost / device.speed
            slowest = max(slowest, t)
            busy_s[d] = t / r
        ring += slowest
        worst = max(worst, slowest / r)
    sends = [((COORDINATOR,), model.token_id_bytes, False)]
    sends += [(ids, model.units[end - 1].out_bytes_per_token, True) for ids, _, end in layout]
    receivers = [ids for ids, _, _ in layout] + [(COORDINATOR,)]
    shared_busy: dict[str, float] = {}  # seconds per token each shared node's link carries
    for (src, nbytes, activation), dst in zip(sends, receivers):
        if dst == (COORDINATOR,):
            nbytes, activation = model.token_id_bytes, False
        h = 0.0
        for a in src:
            scale = 0.5 if activation and devices[a].activation_dtype == "float16" else 1.0
            for b in dst:
                h = max(h, hop(a, b, nbytes * scale))
                relayed = a != COORDINATOR and b != COORDINATOR and (devices[a].relay or devices[b].relay)
                for x, y in ([(a, COORDINATOR), (COORDINATOR, b)] if relayed else [(a, b)]):
                    t = nbytes * scale / network.link(x, y).bandwidth_bytes_per_s / (len(src) * len(dst))
                    for node in {x, y} & network.shared:
                        shared_busy[node] = shared_busy.get(node, 0.0) + t
        ring += h
        worst = max(worst, h)
    worst = max([worst, *shared_busy.values()])
    tpot = max(ring, sequences * worst)
    period = tpot / sequences
    energy = 0.0
    for d, b in sorted(busy_s.items()):
        energy += devices[d].power_busy_w * b + devices[d].power_idle_w * max(period - b, 0.0)
    return Priced(ring, tpot, energy)


def layouts(model: ModelProfile, ids: Sequence[str], sequences: int, max_group: int = 1) -> Iterator[Layout]:
    """Every ordered sequence of disjoint groups with every contiguous split covering the model."""
    n = model.n_units
    groups = [g for r in range(1, min(max_group, sequences) + 1) for g in itertools.combinations(sorted(ids), r)]

    def extend(start: int, used: frozenset[str], stages: Layout) -> Iterator[Layout]:
        if start == n:
            yield stages
            return
        for group in groups:
            if used.intersection(group):
                continue
            for end in range(start + 1, n + 1):
                yield from extend(end, used | set(group), stages + ((group, start, end),))

    yield from extend(0, frozenset(), ())


def best_values(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    network: NetworkProfile,
    sequences: int = 1,
    target_s: float | None = None,
    max_group: int = 1,
) -> dict[str, float]:
    """Optimal latency (ring s), throughput (s per token: tpot / S) and energy (J per token
    among plans meeting `target_s`, or the least tpot if none does) over every layout."""
    by_id = {d.id: d for d in devices}
    best = {"latency": math.inf, "throughput": math.inf, "energy": math.inf, "fastest_tpot": math.inf}
    for layout in layouts(model, list(by_id), sequences, max_group):
        priced = price(layout, model, by_id, network, sequences)
        if priced is None:
            continue
        if all(len(ids) == 1 for ids, _, _ in layout):
            best["latency"] = min(best["latency"], priced.ring_s)
        best["throughput"] = min(best["throughput"], priced.tpot_s / sequences)
        best["fastest_tpot"] = min(best["fastest_tpot"], priced.tpot_s)
        if target_s is None or priced.tpot_s <= target_s * (1 + 1e-12):
            best["energy"] = min(best["energy"], priced.energy_j)
    return best
