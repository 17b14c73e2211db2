"""Changing plans: what a switch costs, whether to take it, what to do, and a spare plan.

This module owns the re-planning policy of seed 000 §5.2 in time units:
- `switch_cost`: seconds to deploy a candidate (downloads of files a device lacks plus
  session creation), combining devices as seed 000 does (alpha = 0.8 of the slowest device,
  0.2 of the sum: downloads mostly run in parallel but share the server's uplink);
- `should_switch`: accept a candidate only if its cost plus the switch cost amortised over a
  horizon and discounted by the sigmoid decay rho(t) beats tau times the current cost, and
  its raw gain beats a margin, so small gains never flap and a better plan is eventually taken;
- `diff`: the change as data, a tuple of frozen actions the coordinator carries out;
- `spare_plan`: a plan that avoids the busiest devices (seed 000's shadow assignment), so its
  files can be fetched before a failure needs it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .order import _plan
from .plan import Plan, PlanRequest, device_map
from .profiles import DeviceProfile, ModelProfile, NetworkProfile

SESSION_S = 1.0
"""Seconds to create an inference session for a new stage (seed 000's sigma)."""

PARALLEL_SHARE = 0.8
"""Weight of the slowest device against the sum when devices deploy at once (seed 000's alpha)."""


def _ranges(current: Plan | None) -> dict[str, tuple[int, int]]:
    if current is None:
        return {}
    return {d: (s.start, s.end) for s in current.stages for d in s.device_ids}


def switch_cost(
    current: Plan | None,
    candidate: Plan,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    unit_file_bytes: Sequence[int] | Mapping[int, int],
    bandwidths: Mapping[str, float],
    *,
    session_s: float = SESSION_S,
    parallel_share: float = PARALLEL_SHARE,
) -> float:
    """Seconds to move from `current` to `candidate`.

    Each device whose stage is new or changed downloads the files of its units that it
    neither holds (`held_units`) nor already serves, at `bandwidths[device]` bytes/s, then
    creates a session (`session_s`). Per-device times combine as
    `parallel_share * max + (1 - parallel_share) * sum`.
    """
    devs = devices if isinstance(devices, dict) else device_map(devices)
    before = _ranges(current)
    per_device = []
    for stage in candidate.stages:
        for device_id in stage.device_ids:
            if before.get(device_id) == (stage.start, stage.end):
                continue
            held = set(devs[device_id].held_units) if device_id in devs else set()
            if device_id in before:
                held.update(range(*before[device_id]))
            missing = sorted(set(stage.units) - held)
            nbytes = sum(unit_file_bytes[u] for u in missing)
            if nbytes and not bandwidths.get(device_id, 0) > 0:
                raise ValueError(f"device {device_id!r}: no download bandwidth for {nbytes} bytes")
            download = nbytes / bandwidths[device_id] if nbytes else 0.0
            per_device.append(download + session_s)
    if not per_device:
        return 0.0
    per_device.sort()
    return parallel_share * per_device[-1] + (1 - parallel_share) * math.fsum(per_device)


def decay(seconds_since_last_switch: float, midpoint_s: float = 60.0, sharpness_s: float | None = None) -> float:
    """Seed 000's rho(t) = 1 - 1 / (1 + exp(-(t - t_mid) / t_sharp)); t_sharp = t_mid / 5."""
    sharpness = midpoint_s / 5 if sharpness_s is None else sharpness_s
    z = (seconds_since_last_switch - midpoint_s) / sharpness
    if z > 700:  # exp would overflow; the factor is 0 to double precision anyway
        return 0.0
    return 1.0 - 1.0 / (1.0 + math.exp(-z))


@dataclass(frozen=True)
class SwitchDecision:
    """`gain` and `penalty` are in the cost's unit per token (seconds for time objectives)."""

    switch: bool
    gain: float
    penalty: float
    reason: str


def should_switch(
    current_cost: float,
    candidate_cost: float,
    switch_cost_s: float,
    seconds_since_last_switch: float,
    horizon_tokens: int,
    margin: float = 0.05,
    tau: float = 0.95,
    midpoint_s: float = 60.0,
    sharpness_s: float | None = None,
) -> SwitchDecision:
    """Decide whether to replace the running plan (costs are per token, lower is better).

    penalty = rho(t) * switch_cost_s / horizon_tokens. Switch iff
    candidate_cost + penalty < tau * current_cost and current_cost - candidate_cost >
    margin * current_cost. A current cost of +inf (the plan cannot run) always switches.
    """
    if horizon_tokens <= 0:
        raise ValueError(f"horizon_tokens = {horizon_tokens} must be > 0")
    rho = decay(seconds_since_last_switch, midpoint_s, sharpness_s)
    penalty = rho * switch_cost_s / horizon_tokens
    if math.isinf(current_cost):
        return SwitchDecision(True, math.inf, penalty, "the running plan cannot run")
    gain = current_cost - candidate_cost
    if gain <= margin * current_cost:
        return SwitchDecision(
            False, gain, penalty, f"gain {gain:.6g} is within the {margin:.0%} margin of {current_cost:.6g}"
        )
    if candidate_cost + penalty >= tau * current_cost:
        return SwitchDecision(
            False,
            gain,
            penalty,
            f"candidate {candidate_cost:.6g} + switch penalty {penalty:.6g} (rho {rho:.3f}) "
            f">= {tau} x current {current_cost:.6g}",
        )
    return SwitchDecision(
        True, gain, penalty, f"candidate {candidate_cost:.6g} + penalty {penalty:.6g} < {tau} x {current_cost:.6g}"
    )


@dataclass(frozen=True)
class FetchUnits:
    """`device` downloads the files of `units` (it neither holds nor serves them)."""

    device: str
    units: tuple[int, ...]


@dataclass(frozen=True)
class LoadStage:
    """`device` creates a session for units [start, end) in its inactive slot."""

    device: str
    start: int
    end: int


@dataclass(frozen=True)
class MoveKV:
    """The KV caches of units [start, end) move from `src` to `dst` (or are re-prefilled)."""

    src: str
    dst: str
    start: int
    end: int


@dataclass(frozen=True)
class DropStage:
    """`device` drops the stage it serves in `current` (after the swap)."""

    device: str


Action = FetchUnits | LoadStage | MoveKV | DropStage


def diff(
    current: Plan | None,
    target: Plan,
    held: Mapping[str, Iterable[int]] | None = None,
) -> tuple[Action, ...]:
    """The actions that turn `current` into `target`, in the order to run them.

    Fetches, then loads (into the inactive slot), then KV moves, then drops. A device whose
    range is unchanged gets no action. `held[d]` are unit files d caches beyond what it
    serves in `current`. Within each kind, actions are sorted for determinism.
    """
    before = _ranges(current)
    fetches: list[FetchUnits] = []
    loads: list[LoadStage] = []
    moves: list[MoveKV] = []
    for stage in target.stages:
        for device_id in stage.device_ids:
            old = before.get(device_id)
            if old == (stage.start, stage.end):
                continue
            cached = set((held or {}).get(device_id, ()))
            if old is not None:
                cached.update(range(*old))
            missing = tuple(sorted(set(stage.units) - cached))
            if missing:
                fetches.append(FetchUnits(device_id, missing))
            loads.append(LoadStage(device_id, stage.start, stage.end))
            for src, (a, b) in before.items():
                if src == device_id:
                    continue
                start, end = max(a, stage.start), min(b, stage.end)
                if start >= end:
                    continue
                # Units the destination already serves keep their KV where they are.
                own = range(*old) if old else range(0)
                for lo, hi in _subtract(start, end, own):
                    moves.append(MoveKV(src, device_id, lo, hi))
    staying = {d: (s.start, s.end) for s in target.stages for d in s.device_ids}
    drops = [DropStage(d) for d in sorted(before) if staying.get(d) != before[d]]
    fetches.sort(key=lambda a: a.device)
    loads.sort(key=lambda a: (a.start, a.device))
    moves.sort(key=lambda a: (a.start, a.src, a.dst))
    return (*fetches, *loads, *moves, *drops)


def _subtract(start: int, end: int, own: range) -> list[tuple[int, int]]:
    """[start, end) minus `own`, as at most two ranges."""
    if not own or own.stop <= start or own.start >= end:
        return [(start, end)]
    parts = []
    if start < own.start:
        parts.append((start, own.start))
    if own.stop < end:
        parts.append((own.stop, end))
    return parts


def spare_plan(
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
    current: Plan,
    busy: set[str] | frozenset[str],
) -> Plan | None:
    """A complete plan to fall back on, avoiding `busy` devices where possible (seed 000 §5.2.5).

    First without any busy device (strict). Failing that, busy devices may take part, only on
    ranges disjoint from what they serve in `current`, priced 10x in the search and ranked
    after plans that use fewer of them. None if neither yields a complete plan.
    """
    devs = device_map(devices)
    free = {d: dev for d, dev in devs.items() if d not in busy}
    if free:
        strict = _plan(model, free, network, request).best
        if strict.complete:
            return replace(strict, reason=f"spare without busy devices; {strict.reason}")
    serving = _ranges(current)
    forbidden = {d: serving[d] for d in sorted(busy) if d in serving}
    shared = _plan(model, devs, network, request, prefer_not=frozenset(busy), forbidden=forbidden).best
    if not shared.complete:
        return None
    reused = sorted(set(shared.device_ids) & set(busy))
    return replace(shared, reason=f"spare reusing busy {', '.join(reused) or 'none'} on other ranges; {shared.reason}")
