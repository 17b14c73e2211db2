"""Profiles: what the planner knows about the model, the devices and the network.

This module owns the frozen value types the planner reads (`UnitProfile`, `ModelProfile`,
`DeviceProfile`, `LinkProfile`, `NetworkProfile`) and the one formula for the time of a
network hop. Everything here is validated at construction, so the search code can trust it.

Units: bytes are ints, times are seconds, `cost` is in "cost units" (seconds a reference
device needs for one decode token), `speed` is cost units per second (1.0 = the reference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

COORDINATOR = "coordinator"
"""Node id of the coordinator in `LinkProfile.src`/`dst`; no device may use it."""

DEFAULT_RUNTIME_OVERHEAD_BYTES = 64 * 1024 * 1024
"""Allowance per stage for the runtime itself (session, arenas, I/O buffers).

A conservative guess, not a measurement: replace it with the value the profiler measures
for the model package in use."""

DEFAULT_POWER_BUSY_W = 15.0
DEFAULT_POWER_IDLE_W = 3.0
"""Power defaults for devices that declare none: 15 W is the sustained package-power class
of laptop (U-series) CPUs and 3 W a typical idle floor of the same machines. They are
placeholders for ranking plans by energy; declare measured values in devices.yaml."""

DEFAULT_PREFILL_EFFICIENCY = 6.0
"""How much cheaper a prompt token is than a decode token when no device declares a prefill
speed. Prefill runs the whole prompt in one call (compute-bound matrix products), decode one
token per call (memory-bound): `benchmarks/results/decode.md` measured SmolLM2-135M int4 on
the 2-core reference machine at 7.9 ms per decode token and 54 ms for a 43-token prefill,
i.e. 6.3x cheaper per prompt token. A default, not a law: declare `prefill_speed` per device."""

ACTIVATION_DTYPE_BYTES = {"float32": 4, "float16": 2}
"""Bytes per activation element on the wire for each `DeviceProfile.activation_dtype`."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class UnitProfile:
    """One link of the model chain: the embedding, a decoder layer, or the head.

    `cost` is seconds on the reference device for one decode token; `out_bytes_per_token`
    is the size of the unit's output for one token (the activation sent to the next stage).
    `kv_window`: positions of KV the unit keeps at most (a sliding-window layer: its window
    plus the runner's slack); 0 = the whole context.
    A mixture-of-experts layer (`experts` > 0): `weight_bytes` holds all its experts, each
    `expert_bytes`; `cost` is a one-row step, which reads `experts_used` of them; a batched
    step reads the union of its rows' experts (`plan.moe`).
    """

    index: int
    name: str
    cost: float
    weight_bytes: int
    kv_bytes_per_token: int
    out_bytes_per_token: int
    kv_window: int = 0
    experts: int = 0
    experts_used: int = 0
    expert_bytes: int = 0

    def kv_bytes(self, context_tokens: int) -> int:
        """KV bytes one sequence of `context_tokens` positions holds in this unit."""
        kept = min(context_tokens, self.kv_window) if self.kv_window else context_tokens
        return kept * self.kv_bytes_per_token

    def __post_init__(self) -> None:
        _require(self.index >= 0, f"unit {self.name!r}: index {self.index} < 0")
        for label, value in (
            ("cost", self.cost),
            ("weight_bytes", self.weight_bytes),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
            ("out_bytes_per_token", self.out_bytes_per_token),
            ("kv_window", self.kv_window),
            ("experts", self.experts),
            ("expert_bytes", self.expert_bytes),
        ):
            _require(
                math.isfinite(value) and value >= 0,
                f"unit {self.index} ({self.name}): {label} = {value} must be finite and >= 0",
            )
        _require(
            0 <= self.experts_used <= self.experts and (self.experts_used > 0) == (self.experts > 0),
            f"unit {self.index} ({self.name}): experts_used {self.experts_used} must be in 1..experts ({self.experts})",
        )


@dataclass(frozen=True)
class ModelProfile:
    """A model as a chain of units: index 0 is the token embedding, the last is the head.

    `context_tokens` is the KV capacity reserved per sequence; `prefill_efficiency` > 1
    means a prefill token is cheaper than a decode token (prefill per token costs
    `cost / prefill_efficiency` on a device that declares no `prefill_speed`).

    `tied_bytes`: weight bytes the embedding (unit 0) and the head (last unit) share (tied
    embeddings) and that both units' `weight_bytes` count; a stage holding both counts them
    once. `variant_weight_bytes`: per precision name, every unit's weight bytes in that
    variant (e.g. the fp32 files a browser runs); a device whose `precision` names one is
    sized with it. `variant_kv_bytes`: likewise, every unit's KV bytes per token in that
    variant (a GGUF kernel form keeps an fp16 cache, half the fp32 one of the others). Activations are priced as `out_bytes_per_token` at float32; a device
    sending float16 (`DeviceProfile.activation_dtype`) halves its outgoing activations.
    """

    name: str
    units: tuple[UnitProfile, ...]
    context_tokens: int
    token_id_bytes: int = 4
    runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD_BYTES
    prefill_efficiency: float = DEFAULT_PREFILL_EFFICIENCY
    tied_bytes: int = 0
    variant_weight_bytes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    variant_kv_bytes: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        for name in ("variant_weight_bytes", "variant_kv_bytes"):
            variants = getattr(self, name)
            if isinstance(variants, dict):
                variants = tuple(variants.items())
            object.__setattr__(self, name, tuple(sorted((str(k), tuple(int(b) for b in v)) for k, v in variants)))
        _require(len(self.units) > 0, f"model {self.name!r} has no units")
        for position, unit in enumerate(self.units):
            _require(
                unit.index == position,
                f"model {self.name!r}: unit at position {position} has index {unit.index}",
            )
        _require(self.context_tokens > 0, f"model {self.name!r}: context_tokens must be > 0")
        _require(self.token_id_bytes > 0, f"model {self.name!r}: token_id_bytes must be > 0")
        _require(
            self.runtime_overhead_bytes >= 0,
            f"model {self.name!r}: runtime_overhead_bytes must be >= 0",
        )
        _require(
            self.prefill_efficiency > 0,
            f"model {self.name!r}: prefill_efficiency must be > 0",
        )
        for what, variants in (("weight", self.variant_weight_bytes), ("KV", self.variant_kv_bytes)):
            for precision, sizes in variants:
                _require(
                    len(sizes) == len(self.units) and all(b >= 0 for b in sizes),
                    f"model {self.name!r}: variant {precision!r} needs {len(self.units)} {what} sizes >= 0",
                )
        smaller_end = min(self.units[0].weight_bytes, self.units[-1].weight_bytes)
        _require(
            0 <= self.tied_bytes <= smaller_end or len(self.units) == 1 and self.tied_bytes == 0,
            f"model {self.name!r}: tied_bytes {self.tied_bytes} must be within 0..{smaller_end} "
            "(the bytes both the embedding and the head count)",
        )

    @property
    def n_units(self) -> int:
        return len(self.units)

    @cached_property
    def kv_bytes_per_sequence(self) -> tuple[int, ...]:
        """Per unit, the KV bytes of one sequence of `context_tokens` (window layers: their window)."""
        return tuple(u.kv_bytes(self.context_tokens) for u in self.units)

    def unit_kv(self, precision: str | None = None) -> tuple[int, ...]:
        """Per unit, the KV bytes of one sequence of `context_tokens` in the variant `precision`
        (None, or a variant without its own KV sizes: the profile's own)."""
        sizes = dict(self.variant_kv_bytes).get(precision) if precision is not None else None
        if sizes is None:
            return self.kv_bytes_per_sequence
        return tuple((min(self.context_tokens, u.kv_window) if u.kv_window else self.context_tokens) * b
                     for u, b in zip(self.units, sizes))

    def unit_weights(self, precision: str | None = None) -> tuple[int, ...]:
        """Weight bytes of every unit in the variant `precision` (None: the profile's own)."""
        if precision is not None:
            for name, sizes in self.variant_weight_bytes:
                if name == precision:
                    return sizes
        return tuple(u.weight_bytes for u in self.units)

    def stage_bytes(self, start: int, end: int, sequences: int, precision: str | None = None) -> int:
        """Memory a stage `[start, end)` needs with `sequences` KV caches of full context, on a
        device running the variant `precision` (its weights and its KV).

        Tied embedding/head bytes are counted once when the stage holds both units."""
        weights = sum(self.unit_weights(precision)[start:end])
        if start == 0 and end == len(self.units) and len(self.units) > 1:
            weights -= self.tied_bytes
        kv = sum(self.unit_kv(precision)[start:end])
        return weights + sequences * kv + self.runtime_overhead_bytes


def transformer_profile(
    name: str,
    layers: int,
    *,
    layer_cost: float,
    layer_bytes: int,
    kv_bytes_per_token: int,
    hidden_bytes: int,
    embed_cost: float = 0.0,
    embed_bytes: int = 0,
    head_cost: float = 0.0,
    head_bytes: int = 0,
    context_tokens: int = 2048,
    **model_kwargs: object,
) -> ModelProfile:
    """Build the usual chain (embedding, `layers` identical decoder layers, head).

    The head emits one token id, so its `out_bytes_per_token` is the token-id size.
    """
    token_id_bytes = int(model_kwargs.get("token_id_bytes", 4))  # type: ignore[arg-type]
    units = [UnitProfile(0, "embed", embed_cost, embed_bytes, 0, hidden_bytes)]
    for layer in range(layers):
        units.append(
            UnitProfile(
                layer + 1, f"layer{layer}", layer_cost, layer_bytes, kv_bytes_per_token, hidden_bytes
            )
        )
    units.append(UnitProfile(layers + 1, "head", head_cost, head_bytes, 0, token_id_bytes))
    return ModelProfile(name, tuple(units), context_tokens, **model_kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DeviceProfile:
    """A worker as the planner sees it.

    `held_units` are units whose weight files the device already caches; `relay` marks a
    device that cannot accept connections (a browser tab): its activations travel through
    the coordinator. `emulated` marks a device whose slowness is injected (reports say so).

    Optional, with defaults that keep older callers' meaning: `prefill_speed` (cost units per
    second for prompt tokens; None: `speed * model.prefill_efficiency`), `precision` (the
    weight variant it runs, e.g. "fp32" for a browser; None: the model profile's own) and
    `activation_dtype` ("float16" halves the activations it sends); `kind` where it computes
    ("cpu" or "gpu", with the GPU's `adapter`: its memory is the GPU's, its speed measured there).

    `row_speed` prices batching: a decode step of `b` rows over a range of cost `c` takes
    `overhead_s + c / speed + (b - 1) * c / row_speed` (one row costs the whole step, each
    further row `c / row_speed`). None keeps the compute-bound reading, each row a whole step
    (`b * (overhead_s + c / speed)`); a memory-bound device (batching nearly free) has a
    `row_speed` many times its `speed`. Measured by timing steps at 1 and at several rows.
    """

    id: str
    memory_bytes: int
    speed: float
    overhead_s: float
    power_busy_w: float = DEFAULT_POWER_BUSY_W
    power_idle_w: float = DEFAULT_POWER_IDLE_W
    held_units: frozenset[int] = frozenset()
    relay: bool = False
    emulated: bool = False
    prefill_speed: float | None = None
    precision: str | None = None
    activation_dtype: str = "float32"
    kind: str = "cpu"
    adapter: str | None = None
    row_speed: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "held_units", frozenset(self.held_units))
        _require(
            self.row_speed is None or (math.isfinite(self.row_speed) and self.row_speed > 0),
            f"device {self.id!r}: row_speed {self.row_speed} must be > 0",
        )
        _require(
            self.prefill_speed is None or (math.isfinite(self.prefill_speed) and self.prefill_speed > 0),
            f"device {self.id!r}: prefill_speed {self.prefill_speed} must be > 0",
        )
        _require(
            self.activation_dtype in ACTIVATION_DTYPE_BYTES,
            f"device {self.id!r}: activation_dtype {self.activation_dtype!r} is not one of "
            f"{', '.join(ACTIVATION_DTYPE_BYTES)}",
        )
        _require(bool(self.id), "device id must not be empty")
        _require(self.id != COORDINATOR, f"device id {COORDINATOR!r} is reserved")
        _require(self.memory_bytes >= 0, f"device {self.id!r}: memory_bytes {self.memory_bytes} < 0")
        _require(
            math.isfinite(self.speed) and self.speed > 0,
            f"device {self.id!r}: speed {self.speed} must be > 0",
        )
        _require(
            math.isfinite(self.overhead_s) and self.overhead_s >= 0,
            f"device {self.id!r}: overhead_s {self.overhead_s} must be >= 0",
        )
        _require(
            math.isfinite(self.power_busy_w) and math.isfinite(self.power_idle_w)
            and self.power_busy_w >= 0 and self.power_idle_w >= 0,
            f"device {self.id!r}: power must be finite and >= 0",
        )

    @property
    def activation_scale(self) -> float:
        """Wire bytes of its activations relative to float32."""
        return ACTIVATION_DTYPE_BYTES[self.activation_dtype] / 4

    def token_share(self, cost: float, sequences: int, replicas: int, extra=None) -> float:
        """Seconds per produced token that a stage of `cost` keeps this device busy, with
        `sequences` in flight split over `replicas`: one step of the busiest replica's
        ceil(S / r) sequences / `sequences`. `extra(rows)`: cost units a step of `rows` rows
        adds beyond the per-row price (the further experts a MoE stage reads, `plan.moe`).

        Without `row_speed` every row costs a whole one-row step (`(overhead + c/speed) / r`)."""
        one_row = self.overhead_s + cost / self.speed
        if self.row_speed is None:
            return one_row / replicas
        rows = -(-sequences // replicas)  # the busiest replica's share (routes balance sequences, not rows)
        experts = extra(rows) / self.speed if extra is not None else 0.0
        return (one_row + (rows - 1) * cost / self.row_speed + experts) / sequences

    def prefill_rate(self, model: ModelProfile) -> float:
        """Cost units per second on prompt tokens (declared, or the model's default ratio)."""
        return self.prefill_speed if self.prefill_speed is not None else self.speed * model.prefill_efficiency


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link between two nodes (device ids or `COORDINATOR`)."""

    src: str
    dst: str
    rtt_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.rtt_s) and self.rtt_s >= 0,
            f"link {self.src}->{self.dst}: rtt_s {self.rtt_s} must be >= 0",
        )
        _require(
            self.bandwidth_bytes_per_s > 0,
            f"link {self.src}->{self.dst}: bandwidth {self.bandwidth_bytes_per_s} must be > 0",
        )

    def transfer_s(self, nbytes: float) -> float:
        """Time of one hop carrying `nbytes`: half a round trip plus serialisation."""
        return self.rtt_s / 2 + nbytes / self.bandwidth_bytes_per_s


DEFAULT_LINK = LinkProfile("*", "*", rtt_s=0.002, bandwidth_bytes_per_s=12.5e6)
"""Fallback for pairs nobody measured: 2 ms RTT, 100 Mbit/s (a wired LAN)."""


@dataclass(frozen=True)
class NetworkProfile:
    """Measured links plus a fallback.

    A link given in one direction only is assumed symmetric; `default` (its src/dst are
    ignored) prices every pair that was not measured.

    `shared`: nodes (device ids or `COORDINATOR`) whose one access link carries everything
    they send and receive — a half-duplex radio, or the coordinator's uplink when it relays
    for a browser. With several sequences in flight the hops touching such a node take turns
    on its link, so the busiest shared link is a bottleneck candidate (see `plan.evaluate`;
    seed 002's contention). Empty (the default): links are contention-free.
    """

    links: tuple[LinkProfile, ...] = ()
    default: LinkProfile = DEFAULT_LINK
    shared: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "shared", frozenset(self.shared))
        seen: set[tuple[str, str]] = set()
        for link in self.links:
            _require(link.src != link.dst, f"link {link.src}->{link.dst} connects a node to itself")
            pair = (link.src, link.dst)
            _require(pair not in seen, f"link {link.src}->{link.dst} is given twice")
            seen.add(pair)

    @cached_property
    def _by_pair(self) -> dict[tuple[str, str], LinkProfile]:
        table = {(link.dst, link.src): link for link in self.links}
        table.update({(link.src, link.dst): link for link in self.links})
        return table

    def link(self, src: str, dst: str) -> LinkProfile:
        """The link used from `src` to `dst` (measured, its reverse, or the default)."""
        return self._by_pair.get((src, dst), self.default)

    def hop_s(self, src: str, dst: str, nbytes: float) -> float:
        """Direct transfer time from `src` to `dst` (no relay rule; see `plan.hop_s`)."""
        return self.link(src, dst).transfer_s(nbytes)

    def with_hop_excess(self, seconds: float) -> NetworkProfile:
        """The same network with every hop `seconds` slower (each RTT, the default's too, longer
        by twice that): what hops were seen to take beyond the link model (framing, event loops)."""
        if seconds <= 0:
            return self
        grow = lambda x: LinkProfile(x.src, x.dst, x.rtt_s + 2 * seconds, x.bandwidth_bytes_per_s)  # noqa: E731
        return NetworkProfile(tuple(grow(x) for x in self.links), grow(self.default), self.shared)

    def serialization_s(self, src: str, dst: str, nbytes: float) -> float:
        """Seconds `nbytes` occupy the link from `src` to `dst` (no round trip)."""
        return nbytes / self.link(src, dst).bandwidth_bytes_per_s


def link_matrix(
    uplinks: Mapping[str, tuple[float, float]],
    measured: Mapping[tuple[str, str], tuple[float, float]] | None = None,
) -> tuple[LinkProfile, ...]:
    """The links the planner prices, from what was measured.

    `uplinks`: per device, (RTT, bandwidth) of its link to the coordinator. `measured`: per
    ordered pair (src, dst), (RTT, bandwidth) a worker measured on its data port to the other
    one. A pair measured in one direction is priced that way both ways; a pair nobody measured
    is priced as a path through both access links (star topology): the larger RTT, the
    smaller bandwidth. Sorted, so equal inputs give an equal profile.
    """
    measured = measured or {}
    ids = sorted(uplinks)
    links = [LinkProfile(a, COORDINATOR, *uplinks[a]) for a in ids]
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            pair = [(x, y) for x, y in ((a, b), (b, a)) if (x, y) in measured]
            if pair:
                links += [LinkProfile(x, y, *measured[(x, y)]) for x, y in pair]
            else:
                (rtt_a, bw_a), (rtt_b, bw_b) = uplinks[a], uplinks[b]
                links.append(LinkProfile(a, b, max(rtt_a, rtt_b), min(bw_a, bw_b)))
    return tuple(links)
