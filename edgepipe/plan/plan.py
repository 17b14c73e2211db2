"""Plans and the cost model: the one place that says what a plan costs.

This module owns the request (`PlanRequest`, `Objective`), the result types (`Stage`,
`Plan`, `Prediction`, `PlanResult`) and `evaluate`, the single cost function that every
search, the MILP check and the runtime's predicted-vs-measured comparison use.

Cost model (DESIGN.md "The planner"; seed 000 §5.2, seed 002 §3):

- a stage `[start, end)` on device d takes `overhead_s + sum(cost) / speed` per decode token,
  and `overhead_s + prompt * sum(cost) / prefill_rate` for the prompt (prefill is one
  compute-bound call, not prompt x decode); its memory is its variant's weights (tied
  embedding/head bytes once) plus KV plus the runtime allowance;
- a hop carries `bytes` in `rtt/2 + bytes/bandwidth`; the coordinator sends the token id to
  the first stage and the last stage returns one; activations are priced in the sender's
  wire dtype (float16: half the bytes); a hop with a relay device at either end goes through
  the coordinator and pays both legs;
- ring time T = sum of stage times + sum of hops (what one token of one sequence takes);
- with S sequences in flight the pipeline period per sequence is max(T, S * B), where B is
  the bottleneck: the largest per-token time of a stage (divided by its replica count), of
  a hop, or of a shared link (`NetworkProfile.shared`: a node whose one link carries all
  its hops, each leg's bytes / bandwidth added up; seed 002's contention); throughput is
  S / max(T, S * B);
- a stage replicated on r devices splits its sequences evenly: each replica holds the whole
  range's weights and ceil(S / r) KV caches, and handles 1/r of the tokens;
- batching: a device that declares `row_speed` runs its ceil(S / r) sequences as one step of
  `t + (ceil(S/r) - 1) * cost / row_speed` (`DeviceProfile.token_share`): its share of the
  bottleneck is that step / S, so a memory-bound device (large `row_speed`) gains little from
  replicas and a compute-bound one (`row_speed` near `speed`) gains r-fold; without it every
  row costs a whole step (t / r);
- mixture-of-experts layers (`plan.moe`): memory is every expert, a one-row step (the measured
  cost) reads k of E, and a batched step of b rows also reads the further experts its rows
  route to, about E * (1 - (1 - k/E)^b) in all, priced at the device's speed on top of the
  per-row price;
- energy per produced token = sum over plan devices of busy power x busy time + idle power
  x idle time within one token period (1 / throughput).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from .profiles import COORDINATOR, DeviceProfile, ModelProfile, NetworkProfile


def _experts_of(model: ModelProfile, start: int, end: int):
    """``rows -> extra cost units`` of a MoE stage's batched step (``plan.moe``); None for a dense stage."""
    if not any(u.experts for u in model.units[start:end]):
        return None
    from .moe import range_extra_cost

    return lambda rows: range_extra_cost(model, start, end, rows)


class Objective(StrEnum):
    """What the planner minimises."""

    LATENCY = "latency"  # ring time T of one token
    THROUGHPUT = "throughput"  # 1 / throughput with `sequences` in flight
    ENERGY = "energy"  # energy per token, subject to tpot <= target


SearchKind = Literal["exact-permutations", "exact-subset-dp", "annealing"]
SearchChoice = Literal["auto", "exact-permutations", "exact-subset-dp", "annealing"]


class PlanError(ValueError):
    """A plan or request that cannot be valid (the message names the device and number)."""


@dataclass(frozen=True)
class PlanRequest:
    """What the caller wants from `plan()`.

    `seed` drives the annealing search; `max_exact_devices` is the largest pool searched
    exactly; `search` forces a strategy ("auto" picks by pool size); `anneal_steps` is the
    annealing budget in evaluated orders (deterministic, not a clock). `replicas` False keeps
    every stage on one device (for a runtime that does not run data-parallel replicas).
    """

    objective: Objective = Objective.LATENCY
    sequences: int = 1
    prompt_tokens: int = 128
    tpot_target_s: float | None = None
    top_k: int = 3
    seed: int = 0
    max_exact_devices: int = 8
    search: SearchChoice = "auto"
    anneal_steps: int = 1200
    replicas: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))
        if self.sequences < 1:
            raise PlanError(f"sequences = {self.sequences} must be >= 1")
        if self.prompt_tokens < 1:
            raise PlanError(f"prompt_tokens = {self.prompt_tokens} must be >= 1")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise PlanError(f"tpot_target_s = {self.tpot_target_s} must be > 0")
        if self.top_k < 1:
            raise PlanError(f"top_k = {self.top_k} must be >= 1")
        if self.anneal_steps < 0:
            raise PlanError(f"anneal_steps = {self.anneal_steps} must be >= 0")
        if self.search not in ("auto", "exact-permutations", "exact-subset-dp", "annealing"):
            raise PlanError(f"unknown search {self.search!r}")


@dataclass(frozen=True)
class Stage:
    """Units `[start, end)` run on `device_ids` (more than one id: data-parallel replicas)."""

    device_ids: tuple[str, ...]
    start: int
    end: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if not self.device_ids:
            raise PlanError(f"stage [{self.start}, {self.end}) has no device")
        if len(set(self.device_ids)) != len(self.device_ids):
            raise PlanError(f"stage [{self.start}, {self.end}) repeats a device: {self.device_ids}")
        if not 0 <= self.start < self.end:
            raise PlanError(
                f"stage on {self.device_ids[0]!r}: range [{self.start}, {self.end}) is empty or negative"
            )

    @property
    def units(self) -> range:
        return range(self.start, self.end)


@dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for a plan (seconds, joules, bytes).

    `hop_times_s` has one entry more than `stage_times_s`: coordinator -> first stage,
    between consecutive stages, last stage -> coordinator. `tpot_s` is the time per output
    token each sequence sees with `sequences` in flight (equals `ring_s` for one sequence).
    `ring_s` (one token around the pipeline) and `bottleneck_s` (the slowest stage share or
    hop) default to what the stage and hop times give when no stage is replicated.
    """

    tpot_s: float
    ttft_s: float
    throughput_tok_s: float
    energy_j_per_token: float
    memory_bytes: tuple[tuple[str, int], ...]
    stage_times_s: tuple[float, ...]
    hop_times_s: tuple[float, ...]
    ring_s: float = math.nan
    bottleneck_s: float = math.nan

    def __post_init__(self) -> None:
        if math.isnan(self.ring_s):
            object.__setattr__(self, "ring_s", math.fsum(self.stage_times_s + self.hop_times_s))
        if math.isnan(self.bottleneck_s):
            object.__setattr__(self, "bottleneck_s", max(self.stage_times_s + self.hop_times_s, default=0.0))


@dataclass(frozen=True)
class Plan:
    """An assignment of contiguous unit ranges to devices, with its prediction.

    Stages are contiguous from unit 0 and a device appears in at most one stage. `units` is
    the model's unit count: when given (`plan()` always gives it) the stages must cover all
    of them unless `complete` is False (a partial plan, used to pre-fetch files while the
    pool is too small).
    """

    stages: tuple[Stage, ...]
    objective: Objective
    complete: bool
    predicted: Prediction | None
    reason: str
    meets_target: bool | None = None
    units: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "objective", Objective(self.objective))
        check_stages(self.stages, self.units, self.complete)

    @property
    def device_ids(self) -> tuple[str, ...]:
        """Every device the plan uses, in pipeline order."""
        return tuple(d for stage in self.stages for d in stage.device_ids)

    def stage_of(self, device_id: str) -> Stage | None:
        for stage in self.stages:
            if device_id in stage.device_ids:
                return stage
        return None


def check_stages(stages: tuple[Stage, ...], units: int | None, complete: bool) -> None:
    """Raise `PlanError` unless `stages` are contiguous from 0 with distinct devices, and (when
    `units` is known) cover all units exactly if complete, fewer if partial."""
    expected = 0
    seen: set[str] = set()
    for stage in stages:
        if stage.start != expected:
            raise PlanError(
                f"stage on {stage.device_ids[0]!r} starts at unit {stage.start}, expected {expected}"
            )
        for device_id in stage.device_ids:
            if device_id in seen:
                raise PlanError(f"device {device_id!r} appears in two stages")
            seen.add(device_id)
        expected = stage.end
    if complete and not stages:
        raise PlanError("a complete plan needs at least one stage")
    if units is None:
        return
    if expected > units:
        raise PlanError(f"stages end at unit {expected} but the model has {units} units")
    if complete and expected != units:
        raise PlanError(f"complete plan covers units [0, {expected}) of {units}")
    if not complete and expected == units:
        raise PlanError("plan covers every unit but is flagged partial")


@dataclass(frozen=True)
class PlanResult:
    """`plan()`'s answer: the best plan, runners-up on other device sets, and how it searched.

    `lower_bound` is a proven lower bound on the latency objective's ring time (None for other
    objectives); `optimal` says whether `best` is proven optimal for the request. `bound` is a
    proven lower bound on `objective_value` of any plan meeting the request (None where none
    was computed) and `gap` the best plan's relative excess over it (0.0: proven optimal).
    """

    best: Plan
    runners_up: tuple[Plan, ...]
    searched: SearchKind
    lower_bound: float | None = None
    optimal: bool = False
    bound: float | None = None
    gap: float | None = None


def device_map(devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile]) -> dict[str, DeviceProfile]:
    """Index devices by id, sorted by id, rejecting duplicates."""
    items = list(devices.values()) if isinstance(devices, Mapping) else list(devices)
    result: dict[str, DeviceProfile] = {}
    for device in sorted(items, key=lambda d: d.id):
        if device.id in result:
            raise PlanError(f"device {device.id!r} is listed twice")
        result[device.id] = device
    return result


def hop_s(
    src: str, dst: str, nbytes: float, network: NetworkProfile, devices: Mapping[str, DeviceProfile]
) -> float:
    """Time to move `nbytes` from `src` to `dst`; a relay end routes through the coordinator."""
    relayed = COORDINATOR not in (src, dst) and (
        (src in devices and devices[src].relay) or (dst in devices and devices[dst].relay)
    )
    if relayed:
        return network.hop_s(src, COORDINATOR, nbytes) + network.hop_s(COORDINATOR, dst, nbytes)
    return network.hop_s(src, dst, nbytes)


def replica_sequences(sequences: int, replicas: int) -> int:
    """KV caches each replica of a stage holds when `sequences` are split evenly."""
    return -(-sequences // replicas)


def evaluate(
    plan_stages: Iterable[Stage],
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
) -> Prediction:
    """Predict time, throughput, energy and memory of `plan_stages` (see the module docstring).

    Stages must be contiguous from unit 0; if they stop short of the model's end the last
    stage is priced as sending its activations to the coordinator. Raises `PlanError`
    naming the device if a stage does not fit its memory or a device is unknown.
    """
    stages = tuple(plan_stages)
    devs = devices if isinstance(devices, dict) else device_map(devices)
    n = model.n_units
    complete = bool(stages) and stages[-1].end == n
    check_stages(stages, n, complete)
    if not stages:
        raise PlanError("a plan needs at least one stage")
    sequences = request.sequences
    prompt = request.prompt_tokens

    memory: dict[str, int] = {}
    stage_times: list[float] = []
    prefill_times: list[float] = []
    busy: dict[str, float] = {}  # busy seconds per produced token
    effective: list[float] = []
    for stage in stages:
        replicas = len(stage.device_ids)
        if replicas > sequences:
            raise PlanError(
                f"stage [{stage.start}, {stage.end}) on {', '.join(stage.device_ids)}: "
                f"{replicas} replicas for {sequences} sequences"
            )
        units = model.units[stage.start : stage.end]
        cost = math.fsum(u.cost for u in units)
        times = []
        prefills = []
        for device_id in stage.device_ids:
            if device_id not in devs:
                raise PlanError(f"device {device_id!r} is not in the pool")
            device = devs[device_id]
            need = model.stage_bytes(
                stage.start, stage.end, replica_sequences(sequences, replicas), device.precision
            )
            if need > device.memory_bytes:
                raise PlanError(
                    f"device {device_id!r}: units [{stage.start}, {stage.end}) need {need} bytes, "
                    f"it has {device.memory_bytes}"
                )
            memory[device_id] = need
            t = device.overhead_s + cost / device.speed
            times.append(t)
            prefills.append(device.overhead_s + prompt * cost / device.prefill_rate(model))
            busy[device_id] = device.token_share(cost, sequences, replicas, _experts_of(model, stage.start, stage.end))
        stage_times.append(max(times))
        prefill_times.append(max(prefills))
        effective.append(max(busy[d] for d in stage.device_ids))

    def boundary(src_ids: tuple[str, ...], dst_ids: tuple[str, ...], nbytes: float) -> float:
        # Activations leave a device in its wire dtype (token ids from the coordinator do not).
        return max(
            hop_s(a, b, nbytes * (devs[a].activation_scale if a in devs else 1.0), network, devs)
            for a in src_ids
            for b in dst_ids
        )

    coordinator = (COORDINATOR,)
    token = model.token_id_bytes
    hops = [boundary(coordinator, stages[0].device_ids, token)]
    prefill_hops = [boundary(coordinator, stages[0].device_ids, prompt * token)]
    for before, after in zip(stages, stages[1:]):
        activation = model.units[before.end - 1].out_bytes_per_token
        hops.append(boundary(before.device_ids, after.device_ids, activation))
        prefill_hops.append(boundary(before.device_ids, after.device_ids, prompt * activation))
    if complete:  # a token id goes home, in no activation dtype
        hops.append(max(hop_s(d, COORDINATOR, token, network, devs) for d in stages[-1].device_ids))
    else:
        hops.append(boundary(stages[-1].device_ids, coordinator, model.units[stages[-1].end - 1].out_bytes_per_token))
    prefill_hops.append(hops[-1])

    ring = math.fsum(stage_times + hops)
    bottleneck = max(effective + hops + [shared_link_s(stages, model, devs, network)])
    tpot = max(ring, sequences * bottleneck)
    period = tpot / sequences  # seconds per token produced by the whole pipeline
    energy = math.fsum(
        devs[d].power_busy_w * busy[d] + devs[d].power_idle_w * max(period - busy[d], 0.0)
        for d in sorted(busy)
    )
    return Prediction(
        tpot_s=tpot,
        ttft_s=math.fsum(prefill_times + prefill_hops),
        throughput_tok_s=sequences / tpot,
        energy_j_per_token=energy,
        memory_bytes=tuple(sorted(memory.items())),
        stage_times_s=tuple(stage_times),
        hop_times_s=tuple(hops),
        ring_s=ring,
        bottleneck_s=bottleneck,
    )


def shared_link_s(
    stages: tuple[Stage, ...], model: ModelProfile, devs: Mapping[str, DeviceProfile], network: NetworkProfile
) -> float:
    """Seconds per produced token that the busiest shared link (`NetworkProfile.shared`) is busy.

    Every leg of every hop (a relayed hop: both legs through the coordinator) adds its bytes /
    bandwidth to each shared node at either end, weighted by the share of tokens taking it
    (replicas split their tokens evenly). With one sequence this never exceeds the ring time,
    so only the pipelined period can change. 0.0 when no node is shared."""
    if not network.shared:
        return 0.0
    busy: dict[str, float] = {}
    token = model.token_id_bytes
    n = model.n_units
    senders = [((COORDINATOR,), token, False)] + [
        (s.device_ids, token if s.end == n else model.units[s.end - 1].out_bytes_per_token, s.end != n) for s in stages
    ]
    receivers = [s.device_ids for s in stages] + [(COORDINATOR,)]
    for (src, nbytes, activation), dst in zip(senders, receivers):
        share = 1.0 / (len(src) * len(dst))
        for a in src:
            sent = nbytes * (devs[a].activation_scale if activation else 1.0)
            for b in dst:
                relayed = COORDINATOR not in (a, b) and (devs[a].relay or devs[b].relay)
                for x, y in ((a, COORDINATOR), (COORDINATOR, b)) if relayed else ((a, b),):
                    seconds = share * network.serialization_s(x, y, sent)
                    for node in (x, y):
                        if node in network.shared:
                            busy[node] = busy.get(node, 0.0) + seconds
    return max(busy.values(), default=0.0)


def meets_target(prediction: Prediction, request: PlanRequest) -> bool | None:
    """Whether the predicted tpot is within the request's target (None without a target)."""
    if request.tpot_target_s is None:
        return None
    return prediction.tpot_s <= request.tpot_target_s * (1 + 1e-12)


def objective_key(prediction: Prediction, request: PlanRequest) -> tuple[float, ...]:
    """Sort key of a prediction under the request's objective (smaller is better).

    Energy plans that miss the tpot target rank after every plan that meets it, fastest
    first, so that "no plan meets the target" returns the fastest plan.
    """
    if request.objective is Objective.LATENCY:
        return (prediction.ring_s,)
    if request.objective is Objective.THROUGHPUT:
        return (1.0 / prediction.throughput_tok_s, prediction.ring_s)
    if meets_target(prediction, request) is False:
        return (1.0, prediction.tpot_s, prediction.energy_j_per_token)
    return (0.0, prediction.energy_j_per_token, prediction.tpot_s)


def objective_value(prediction: Prediction, request: PlanRequest) -> float:
    """The scalar the objective minimises: ring seconds, seconds per token, or joules per token."""
    if request.objective is Objective.LATENCY:
        return prediction.ring_s
    if request.objective is Objective.THROUGHPUT:
        return 1.0 / prediction.throughput_tok_s
    return prediction.energy_j_per_token
