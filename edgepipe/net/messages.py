"""Typed wire messages: one frozen dataclass per message type, the header fields it carries.

``to_message()`` gives the ``protocol.Message`` to encode (fields that are None are left out,
so optional fields stay optional on the wire); ``parse(msg)`` checks a received message's
fields (types, ranges, finite numbers) and returns its dataclass, or raises ``ProtocolError``
with one line. Field names are the wire names in ``docs/protocol.md`` (the browser worker,
``api/static/worker.js``, reads the same names); the message tables of ``docs/protocol.md`` are
generated from these classes (``edgepipe.net.protocol_doc``, checked by ``tests/test_protocol_doc.py``)
and ``tests/test_golden_frames.py`` checks both workers against recorded frames. Errors carry an
:class:`ErrorCode` so nobody matches error text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .protocol import Message, MessageType as T, ProtocolError

MAX_TOKEN_ID = (1 << 31) - 1


class ErrorCode(str, Enum):
    UNREACHABLE = "unreachable"  # the next hop could not be reached: the plan is broken, retry on a new one
    NO_STAGE = "no_stage"  # the worker holds no stage for that plan (stale plan): retry on a new one
    BAD_INPUT = "bad_input"  # the frame's values are wrong for this request: it fails
    CONTEXT = "context"  # the sequence outgrew the KV the stage holds: it fails
    INTERNAL = "internal"  # anything else on the worker: the request fails
    CORRUPT_INPUT = "corrupt_input"  # the stage's input was unusable (non-finite, wrong shape): the sender is at fault, retry
    REFUSED = "refused"  # the coordinator refuses this worker (join token, bad frame, ...)
    PREFIX_MISS = "prefix_miss"  # the stage lacks a cached prefix block the frame reuses: the plan's cache is dropped, retry


RETRYABLE = frozenset({ErrorCode.UNREACHABLE, ErrorCode.NO_STAGE, ErrorCode.CORRUPT_INPUT, ErrorCode.PREFIX_MISS})


TENSORS = MappingProxyType({"tensors": True})
"""Field metadata of a message's ``tensors`` (the frame's arrays, not a header field)."""


def header_fields(cls) -> tuple:
    """A message class's header fields (the dataclass fields but its ``tensors``)."""
    return tuple(f for f in fields(cls) if not f.metadata.get("tensors"))


_HEADER_NAMES: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True)
class Wire:
    TYPE: ClassVar[T]

    def to_message(self, tensors: dict | None = None) -> Message:
        """The frame: header fields that are not None, and ``tensors`` (else the message's own, if it has any)."""
        names = _HEADER_NAMES.get(type(self))
        if names is None:
            names = _HEADER_NAMES[type(self)] = tuple(f.name for f in header_fields(self))
        body = {name: _plain(v) for name in names if (v := getattr(self, name)) is not None}
        return Message(self.TYPE, body, dict(tensors if tensors is not None else getattr(self, "tensors", None) or {}))


_PLAIN = frozenset({int, float, str, bool, list, dict})


def _plain(v):
    if type(v) in _PLAIN:  # most fields, at once (a Mapping check is slow, and builds run per decode step)
        return v
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, NextHop):
        return v.wire()
    if isinstance(v, Mapping):
        return dict(v)
    return list(v) if isinstance(v, tuple) else v


@dataclass(frozen=True)
class NextHop:
    """Where a stage's output goes: the coordinator (the last stage), or the next stage's worker,
    at its data port ``url`` or, for a ``relay``, through the coordinator."""

    kind: str  # "coordinator" | "worker"
    id: str | None = None
    url: str | None = None
    relay: bool = False
    secret: str | None = None  # the next stage's data-port secret (net.auth)
    fingerprint: str | None = None  # its data port's certificate (TLS clusters)
    # the next stage's other replicas (a plan with replicated stages): a frame whose batch
    # entries carry a ``route`` goes to the hop whose id is on it
    replicas: tuple["NextHop", ...] = ()

    @classmethod
    def of(cls, wire) -> "NextHop":
        if isinstance(wire, NextHop):
            return wire
        if not isinstance(wire, dict) or wire.get("kind") not in ("coordinator", "worker"):
            raise ProtocolError("load: next must be {kind: coordinator} or {kind: worker, id, url, relay}")
        if wire["kind"] == "coordinator":
            return cls("coordinator")
        url, relay = wire.get("url"), bool(wire.get("relay"))
        if not isinstance(wire.get("id"), str) or not (relay or isinstance(url, str) and url):
            raise ProtocolError("load: a worker hop needs an id and a url (or relay)")
        opt = lambda k: wire.get(k) if isinstance(wire.get(k), str) else None  # noqa: E731
        others = wire.get("replicas") or []
        if not isinstance(others, list) or not all(isinstance(o, dict) and o.get("kind") == "worker" and "replicas" not in o for o in others):
            raise ProtocolError("load: next.replicas must be a list of worker hops")
        return cls("worker", wire["id"], url if isinstance(url, str) else None, relay, opt("secret"), opt("fingerprint"),
                   tuple(cls.of(o) for o in others))

    def toward(self, batch) -> "NextHop":
        """The hop a frame of ``batch`` goes to: the replica on its entries' ``route``, else this one."""
        route = batch[0].get("route") if self.replicas and batch and isinstance(batch[0], dict) else None
        if isinstance(route, list):
            return next((h for h in (self, *self.replicas) if h.id in route), self)
        return self

    def wire(self) -> dict:
        if self.kind == "coordinator":
            return {"kind": "coordinator"}
        hop = {"kind": "worker", "id": self.id, "url": self.url, "relay": self.relay}
        hop.update({k: v for k, v in (("secret", self.secret), ("fingerprint", self.fingerprint)) if v is not None})
        return {**hop, "replicas": [h.wire() for h in self.replicas]} if self.replicas else hop


_NOT_EMULATING = {"slowdown": 1.0, "link_delay_ms": 0.0, "misreport": 1.0}  # an emulation entry's values that emulate nothing


@dataclass(frozen=True)
class Hello(Wire):
    """A worker's first frame: who it is and what it can hold. The coordinator keeps it, parsed
    (``Hello.from_fields``), as the worker's declaration; unknown keys are ignored."""

    TYPE = T.HELLO
    name: str
    token: str | None
    protocol: int
    kind: str  # "native" or "browser"
    memory_bytes: int
    threads: int
    data_url: str | None  # None for a browser (it cannot accept connections)
    held: tuple[str, ...]  # sha256s in its cache
    emulation: Mapping | None = None  # {slowdown, link_delay_ms, link_rate, memory_budget[, drop_work]}, labelled emulation
    precision: str | None = None  # the weight variant it wants (a WebAssembly tab: fp32; absent: the package's own)
    pid: int | None = None
    data_fingerprint: str | None = None  # its data port's certificate (TLS clusters)
    power_busy_w: float | None = None
    power_idle_w: float | None = None
    device: str | None = None  # where its stages compute: "cpu" or "gpu" (absent: cpu)
    adapter: str | None = None  # the GPU adapter (vendor, architecture, description) when device is "gpu"
    device_note: str | None = None  # one line: why it computes on the CPU though a GPU was asked for or looked for
    native_kernel: str | None = None  # "gguf" when its GGUF kernel library loaded (CPU workers only: it runs the `gguf` form)
    native_kernel_note: str | None = None  # one line: why it has no kernel library (it runs the MatMulNBits form)
    role: str | None = None  # "drafter": it holds no stage, it runs the draft model (speculative decoding); absent: "stage"

    KINDS: ClassVar[frozenset] = frozenset({"native", "browser"})
    ROLES: ClassVar[frozenset] = frozenset({"stage", "drafter"})
    DEVICES: ClassVar[frozenset] = frozenset({"cpu", "gpu"})

    def to_message(self, tensors: dict | None = None) -> Message:
        """Every field, null ones too (as both workers have always sent them)."""
        return Message(self.TYPE, {f.name: _plain(getattr(self, f.name)) for f in fields(self)}, tensors or {})

    @property
    def relay(self) -> bool:
        """A browser: it cannot accept connections, so its activations travel through the coordinator."""
        return self.kind == "browser"

    @property
    def drafter(self) -> bool:
        """It asked to run the draft model beside the pipeline, not a stage."""
        return self.role == "drafter"

    @property
    def memory_budget(self):
        """The memory budget it declared (``--memory``; None: no budget). It travels in ``emulation``
        but is no emulation: a budget the user chose is a budget (``emulated`` leaves it out)."""
        return (self.emulation or {}).get("memory_budget")

    @property
    def declared_emulation(self) -> dict | None:
        """What it emulates (``--slowdown``, ``--roofline``, link shaping, ``--drop-work``,
        ``--misreport``), its defaults and its memory budget left out; None: a real device."""
        left = {k: v for k, v in (self.emulation or {}).items() if k != "memory_budget" and v is not None and v is not False
                and not (k in _NOT_EMULATING and v == _NOT_EMULATING[k])}
        return left or None

    @property
    def emulated(self) -> bool:
        """Whether its slowness (or misbehaviour) is injected: what reports and the dashboard label emulated."""
        return self.declared_emulation is not None

    def with_slowdown(self, slowdown: float) -> Hello:
        """The same declaration with its emulated slowdown changed (the dashboard's emulation control)."""
        return replace(self, emulation=MappingProxyType({**(self.emulation or {}), "slowdown": float(slowdown)}))

    @classmethod
    def from_fields(cls, f: Mapping) -> Hello:
        """A received hello's fields, checked (``ProtocolError`` names the field). An absent field
        takes its default (old or minimal workers); a field of the wrong type is refused."""
        def opt_str(name: str, limit: int = 4096) -> str | None:
            v = f.get(name)
            if v is not None and not isinstance(v, str):
                raise ProtocolError(f"hello: {name} must be a string or null")
            return None if v is None else v[:limit]

        def count(name: str, default: int) -> int:
            v = f.get(name, default)
            if v is None:
                return default
            if not (_finite(v) and v >= 0):
                raise ProtocolError(f"hello: {name} must be a number >= 0, got {str(v)[:40]!r}")
            return int(v)

        def power(name: str) -> float | None:
            v = f.get(name)
            if v is not None and not (_finite(v) and v >= 0):
                raise ProtocolError(f"hello: {name} must be finite watts >= 0")
            return None if v is None else float(v)

        kind, device, role = f.get("kind") or "native", f.get("device"), f.get("role")
        if role is not None and role not in cls.ROLES:
            raise ProtocolError(f"hello: role must be one of {sorted(cls.ROLES)}, got {str(role)[:40]!r}")
        if kind not in cls.KINDS:
            raise ProtocolError(f"hello: kind must be one of {sorted(cls.KINDS)}, got {str(kind)[:40]!r}")
        if device is not None and device not in cls.DEVICES:
            raise ProtocolError(f"hello: device must be one of {sorted(cls.DEVICES)}, got {str(device)[:40]!r}")
        held, emulation = f.get("held") or (), f.get("emulation")
        if not (isinstance(held, (list, tuple)) and all(isinstance(h, str) for h in held)):
            raise ProtocolError("hello: held must be a list of sha256 strings")
        if emulation is not None and not isinstance(emulation, Mapping):
            raise ProtocolError("hello: emulation must be a map or null")
        pid = f.get("pid")
        return cls(name=opt_str("name", 256) or "worker", token=opt_str("token"), protocol=count("protocol", 0), kind=kind,
                   memory_bytes=count("memory_bytes", 0), threads=count("threads", 1), data_url=opt_str("data_url"), held=tuple(held),
                   emulation=None if emulation is None else MappingProxyType(dict(emulation)), precision=opt_str("precision", 64),
                   pid=pid if _int(pid) else None, data_fingerprint=opt_str("data_fingerprint", 256),
                   power_busy_w=power("power_busy_w"), power_idle_w=power("power_idle_w"), device=device,
                   adapter=opt_str("adapter", 512), device_note=opt_str("device_note", 512), native_kernel=opt_str("native_kernel", 64),
                   native_kernel_note=opt_str("native_kernel_note", 512), role=role)


@dataclass(frozen=True)
class Welcome(Wire):
    TYPE = T.WELCOME
    worker_id: str


@dataclass(frozen=True)
class Load(Wire):
    TYPE = T.LOAD
    plan: int
    start: int
    end: int
    graph: str
    files: list
    next: NextHop
    keep: list
    max_context: int | None = None
    kv_bytes_per_token: int | None = None
    warm: bool | None = None  # a spare: build the session too when the budget allows
    prefetch: bool | None = None  # a spare: fetch the files only
    data_secret: str | None = None  # what this stage's predecessor must present on its data port (net.auth)
    matmul_bytes: int | None = None  # weight bytes its matrix products read per step (not the embedding table, only gathered from)
    head_bytes: int | None = None  # of matmul_bytes, the head's: it computes the last position of each row only
    # The direct token path on a plan of several stages (``cluster.rules.direct``): the last stage's
    # ``first`` is the plan's first stage, which it sends the next step of a direct run to (with that
    # stage's ``feed_secret``); the first stage's ``fed_by`` is the last stage's worker id, the one
    # peer it takes token ids from on its data port (None: it takes them from the coordinator only)
    first: NextHop | None = None
    fed_by: str | None = None
    feed_secret: str | None = None  # what the last stage presents when it feeds the first (net.auth)


@dataclass(frozen=True)
class Activate(Wire):
    TYPE = T.ACTIVATE
    keep: list


@dataclass(frozen=True)
class Drop(Wire):
    TYPE = T.DROP
    seq: str


@dataclass(frozen=True)
class Ping(Wire):
    TYPE = T.PING
    t: float


@dataclass(frozen=True)
class Probe(Wire):
    TYPE = T.PROBE
    probe: int
    plan: int | None = None
    reps: int | None = None
    context: int | None = None
    kind: str | None = None  # None: time decode steps; "link": the uplink; "accept"/"peer": a worker-to-worker link; "echo": one round trip of a peer probe (on the data port)
    bytes: int | None = None
    url: str | None = None  # kind "peer": the data port of the worker to probe
    secret: str | None = None  # kind "accept": the probe secret to accept; "peer": the one to present
    fingerprint: str | None = None  # kind "peer": the probed data port's certificate (TLS clusters)
    rows: int | None = None  # decode steps: sequences stepped together in each (None: 1)


PROBE_PLAN = 0
"""Plan id a link probe presents on a data port (real plans count from 1, calibration's are negative)."""

CALIBRATION_PLANS = -10_000
"""Plan ids at or below this one are calibration's timed ranges; those between it and 0 the spare plan's."""


def plan_label(plan: int | None) -> str:
    """A plan id as a log line names it: ``plan 3``, ``the spare plan``, or ``calibration`` (never a negative id)."""
    if plan is None or plan > 0:
        return f"plan {plan}"
    if plan <= CALIBRATION_PLANS:
        return "calibration"
    return "the spare plan" if plan < 0 else "a link probe"


@dataclass(frozen=True)
class KvExport(Wire):
    TYPE = T.KV_EXPORT
    seq: str
    plan: int
    start: int
    end: int
    to_plan: int
    url: str | None
    move: int
    secret: str | None = None  # the destination stage's data-port secret for ``to_plan``
    fingerprint: str | None = None  # the destination's data-port certificate (TLS clusters)
    upto: int | None = None  # a checkpoint: the sender must hold exactly this many positions (else it refuses)
    as_seq: str | None = None  # a checkpoint: the name the receiver stores the KV under (None: ``seq``)
    since: int | None = None  # a checkpoint's increment: full-cache layers from this position on (the receiver holds the rest)


@dataclass(frozen=True)
class Emulate(Wire):
    TYPE = T.EMULATE
    slowdown: float


@dataclass(frozen=True)
class Notice(Wire):
    TYPE = T.NOTICE
    text: str
    done: int | None = None
    total: int | None = None


@dataclass(frozen=True)
class Bye(Wire):
    TYPE = T.BYE
    final: bool | None = None  # true: the sender leaves for good (no reconnect); absent: it may come back


@dataclass(frozen=True)
class Forward(Wire):
    """Token ids into the first stage (tensor ``x``), or a relayed frame (``relay_to``)."""

    TYPE = T.FORWARD
    plan: int
    batch: list  # [{seq, step, rid, sampling[, partial][, pos][, prefix][, verify][, rewind][, route][, ahead, stop[, uniforms]][, direct]}], passed on as received
    timings: list | None = None
    relay_to: str | None = None
    # ``x``: token ids [batch, positions] into a first stage, else activations [batch, positions, hidden]
    tensors: Mapping = field(default_factory=dict, compare=False, repr=False, metadata=TENSORS)

    @property
    def x(self) -> np.ndarray | None:
        return self.tensors.get("x")

    def entries(self) -> tuple["ForwardEntry", ...]:
        """One typed entry per batch entry, in frame order (``parse`` checked each has a seq); made
        once per frame (the core and the runner both read them, once per decode step)."""
        made = self.__dict__.get("_entries")
        if made is None:
            made = self.__dict__["_entries"] = tuple(ForwardEntry.of(item) for item in self.batch)
        return made


SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "uniform", "min_p")  # min_p: heads of GRAPH_VERSION 10 on
"""The fields of a FORWARD entry's ``sampling`` every head reads (``runtime.controls`` writes them);
the others (``logprobs``, ``top``, ``adjust``, ``mask``, ...) are extensions a head may lack."""


class ForwardEntry(NamedTuple):
    """One sequence's part of a FORWARD frame (``Forward.entries``): the keys a stage reads; the
    rest (sampling, route) is read where it is used (``runtime.controls``, ``NextHop.toward``).
    A named tuple, not a dataclass: eight of them are made per decode step and hop, and a
    tuple is several times cheaper to build."""

    seq: str
    step: int | None = None
    rid: str | None = None
    pos: int | None = None  # the first position of the frame's rows (a stage checks its KV ends there)
    prefix: Mapping | None = None  # cached prompt blocks to install / save (``net.validate.prefix_entry``)
    partial: bool = False  # a replay frame before the last: no token wanted
    verify: bool = False  # speculative decoding: score the drafts (one sequence a frame)
    rewind: bool = False  # speculative decoding: forget positions from ``pos`` on first

    @classmethod
    def of(cls, item: Mapping) -> ForwardEntry:
        get = item.get
        step, rid, pos = get("step"), get("rid"), get("pos")
        # ``type(v) is int`` (not _int): header values come from msgpack, and a bool is no position
        return tuple.__new__(cls, (item["seq"], step if type(step) is int else None, rid if type(rid) is str else None,
                                   pos if type(pos) is int else None, get("prefix"), bool(get("partial")), bool(get("verify")),
                                   bool(get("rewind"))))


@dataclass(frozen=True)
class Kv(Wire):
    """A sequence's KV for some layers, worker to worker (tensors ``key.<u>``, ``value.<u>``)."""

    TYPE = T.KV
    seq: str
    plan: int  # the receiver's plan
    length: int | None
    move: int
    since: int | None = None  # full-cache layers' tensors start at this position (a checkpoint's increment)
    # ``key.<u>``, ``value.<u>`` per decoder layer u (window layers' trimmed: ``length`` says where they end)
    tensors: Mapping = field(default_factory=dict, compare=False, repr=False, metadata=TENSORS)

    def layers(self) -> dict[int, dict[str, np.ndarray]]:
        """Its tensors by layer: ``{u: {name: array}}``."""
        out: dict[int, dict[str, np.ndarray]] = {}
        for name, value in self.tensors.items():
            out.setdefault(int(name.split(".")[1]), {})[name] = value
        return out


@dataclass(frozen=True)
class DraftLoad(Wire):
    """To a drafter worker: fetch the draft model's files (content-addressed, as a stage's) and
    build it whole, then time ``reps`` draft steps (as calibration times a stage)."""

    TYPE = T.DRAFT_LOAD
    name: str  # the draft package's name
    graph: str  # sha256 of the whole draft model's graph (its head states its sampler's distribution)
    files: list  # sha256s of its weight files
    max_context: int
    reps: int | None = None


@dataclass(frozen=True)
class Draft(Wire):
    """To a drafter worker: ``k`` drafts after a sequence's ids (tensor ``ids``, int32: the ids
    after the first ``keep`` of those sent before for ``seq``); ``k = 0`` takes the ids in only
    (a prompt, while the stages prefill it)."""

    TYPE = T.DRAFT
    id: int
    seq: str
    keep: int
    k: int
    step: int  # the generated tokens before the ids' end: draft j samples with the target's draw for token step + j
    sampling: Mapping | None = None  # {temperature, top_k, top_p, seed[, min_p]} of a sampled request; null: greedy
    rule: bool | None = None  # with the distribution each draft was drawn from (the speculative-sampling rule's q)
    tensors: Mapping = field(default_factory=dict, compare=False, repr=False, metadata=TENSORS)  # ids: int32 [n]


# -- what workers send --------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftReady(Wire):
    TYPE = T.DRAFT_READY
    ok: bool
    name: str | None = None
    step_s: float | None = None  # measured seconds per draft step
    load_s: float | None = None
    fetched_bytes: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class Drafted(Wire):
    TYPE = T.DRAFTED
    id: int
    ok: bool
    tokens: list | None = None
    q_ids: list | None = None  # a rule draft: per draft, the token ids of its distribution
    q_probs: list | None = None  # ... and their probabilities
    compute_s: float | None = None
    error: str | None = None  # why not (one line); "unknown sequence": send its ids again from the start

@dataclass(frozen=True)
class Token(Wire):
    TYPE = T.TOKEN
    plan: int
    batch: list  # [{seq, step, rid, sampling[, partial][, pos][, prefix][, verify][, rewind]}], as sent
    tokens: list  # one id per batch entry (a verify entry: the token after its last position)
    timings: list  # [[worker_id, seconds, positions, bytes/elem, batch], ...]
    # per batch entry that asked (sampling.logprobs), else None: {logprob, top_ids, top_logprobs[,
    # prompt: [logprobs [S], top ids [S][N], top logprobs [S][N]]]} (see runtime.controls); a
    # verify entry: a list of such entries, one per position
    logprobs: list | None = None
    # per batch entry: for a verify entry (speculative decoding), the token the head chose after
    # each of its positions; None for the others (see runtime.speculative)
    verified: list | None = None
    # per batch entry: True where the stage fed the entry's next step itself with this token (the
    # direct token path: the entry's ``ahead`` allowed it); absent from stages that never do
    fed: list | None = None

    def entries(self) -> list["TokenEntry"]:
        """One typed result per batch entry, in frame order (``parse`` checked each entry's seq and step)."""
        logprobs = self.logprobs or [None] * len(self.tokens)
        verified = self.verified or [None] * len(self.tokens)
        fed = self.fed or [False] * len(self.tokens)
        return [TokenEntry(item["seq"], item["step"], token, logprobs[i], verified[i], bool(fed[i]) if i < len(fed) else False)
                for i, (item, token) in enumerate(zip(self.batch, self.tokens))]


@dataclass(frozen=True)
class TokenEntry:
    """One sequence's result in a TOKEN frame (``Token.entries``)."""

    seq: str
    step: int
    token: int
    logprobs: dict | list | None  # its logprobs entry (a verify entry: one per position), when asked
    verified: list | None  # a verify entry: the token the head chose after each position
    fed: bool = False  # the stage fed this sequence's next step itself (the direct token path)


@dataclass(frozen=True)
class Pong(Wire):
    TYPE = T.PONG
    t: float | None = None
    kv_bytes: int | None = None
    queue: int | None = None
    busy_s: float | None = None
    computed: int | None = None
    fetched_bytes: int | None = None  # blob bytes this process downloaded so far
    joins: int | None = None  # memberships of this process (1 + rejoins)
    loop_lag_s: float | None = None  # worst event-loop hold-up since the last pong
    prefix_bytes: int | None = None  # KV of cached prompt blocks it holds (beside kv_bytes, the sequences' KV)


@dataclass(frozen=True)
class Loaded(Wire):
    TYPE = T.LOADED
    ok: bool
    plan: int | None = None
    kv_received: int | None = None  # a KV move's id (then this acknowledges the move)
    error: str | None = None
    fetched_bytes: int | None = None  # parse gives 0 when absent
    load_s: float | None = None
    weight_bytes: int | None = None
    repaired: list | None = None  # cached files that failed their SHA-256 and were fetched again
    prefetched: bool | None = None  # a prefetch load: files held, nothing built
    reused_session: bool | None = None  # the stage's session was already built (kept range, warm spare)
    bytes: int | None = None  # a KV move: bytes installed
    # a LOAD refused over the worker's memory budget: what the stage needs, what was free beside
    # what it holds, and the budget (the coordinator prices the worker with them: ``LoadRefused``)
    needed_bytes: int | None = None
    free_bytes: int | None = None
    budget_bytes: int | None = None


@dataclass(frozen=True)
class Probed(Wire):
    TYPE = T.PROBED
    probe: int
    ok: bool
    times: list | None = None
    rtt_s: float | None = None  # a peer probe: the least round trip of small frames on the data port
    bandwidth_bytes_per_s: float | None = None  # a peer probe: extra bytes / extra seconds of a large frame
    error: str | None = None  # a peer probe that failed: why (one line)


@dataclass(frozen=True)
class Error(Wire):
    TYPE = T.ERROR
    message: str
    code: ErrorCode | None = None
    seq: str | None = None
    step: int | None = None
    rid: str | None = None

    @property
    def retryable(self) -> bool:
        """The plan is at fault, not the request: retry on a new plan."""
        if self.code is not None:
            return self.code in RETRYABLE
        return "unreachable" in self.message  # a worker older than error codes


def parse(msg: Message, vocab_size: int = MAX_TOKEN_ID + 1) -> Any:
    """The typed message, checked (``ProtocolError`` says what is wrong): what a worker sends
    and what the coordinator sends a worker; FORWARD and KV carry the frame's tensors."""
    f = msg.fields
    try:
        if msg.type is T.HELLO:
            return Hello.from_fields(f)
        to_worker = _TO_WORKER.get(msg.type)
        if to_worker is not None:
            typed = to_worker(f)
            return replace(typed, tensors=msg.tensors) if msg.type is T.DRAFT else typed
        if msg.type is T.KV:
            if not (isinstance(f["seq"], str) and _int(f["plan"]) and _int(f["move"]) and (f.get("length") is None or _int(f["length"]))
                    and (f.get("since") is None or (_int(f["since"]) and f["since"] >= 0))):
                raise ProtocolError("kv: seq, plan, move (and length, since) must be a string and integers")
            if not all(isinstance(n, str) and n.count(".") == 1 and n.split(".")[1].isdigit() for n in msg.tensors):
                raise ProtocolError("kv: tensors must be named key.<layer> / value.<layer>")
            return Kv(f["seq"], int(f["plan"]), None if f.get("length") is None else int(f["length"]), int(f["move"]),
                      None if f.get("since") is None else int(f["since"]), msg.tensors)
        if msg.type is T.TOKEN:
            batch, tokens = f["batch"], f["tokens"]
            if not (isinstance(batch, list) and isinstance(tokens, list) and len(batch) == len(tokens)):
                raise ProtocolError("token: batch and tokens must be lists of one length")
            for item in batch:
                if not (isinstance(item, dict) and isinstance(item.get("seq"), str) and _int(item.get("step"))):
                    raise ProtocolError("token: a batch entry lacks seq/step")
            for t in tokens:
                if not (_int(t) and 0 <= t < vocab_size):
                    raise ProtocolError(f"token: id {t!r} is not in [0, {vocab_size})")
            logprobs = f.get("logprobs")
            if logprobs is not None:
                if not (isinstance(logprobs, list) and len(logprobs) == len(batch)):
                    raise ProtocolError("token: logprobs must be a list with one entry per batch entry")
                for entry in logprobs:
                    for one in entry if isinstance(entry, list) and len(entry) <= 1 << 12 else [entry]:
                        if one is not None:
                            _logprob_entry(one, vocab_size)
            verified = f.get("verified")
            if verified is not None:
                if not (isinstance(verified, list) and len(verified) == len(batch)
                        and all(v is None or (isinstance(v, list) and all(_int(t) and 0 <= t < vocab_size for t in v)) for v in verified)):
                    raise ProtocolError("token: verified must be a list with one entry per batch entry, each None or token ids")
            fed = f.get("fed")
            if fed is not None and not (isinstance(fed, list) and len(fed) == len(batch) and all(isinstance(v, bool) for v in fed)):
                raise ProtocolError("token: fed must be a list of booleans, one per batch entry")
            return Token(_need_int(f["plan"], "plan"), batch, tokens, _timings(f.get("timings", [])), logprobs, verified, fed)
        if msg.type is T.PONG:
            return Pong(_num(f.get("t")), f.get("kv_bytes"), f.get("queue"), f.get("busy_s"), f.get("computed"),
                        prefix_bytes=f["prefix_bytes"] if _int(f.get("prefix_bytes")) and f["prefix_bytes"] >= 0 else None)
        if msg.type is T.LOADED:
            return Loaded(bool(f.get("ok")), _opt_int(f.get("plan"), "plan"), _opt_int(f.get("kv_received"), "kv_received"),
                          None if f.get("error") is None else str(f["error"]).splitlines()[0] if str(f["error"]) else "error",
                          int(f.get("fetched_bytes") or 0) if _int(f.get("fetched_bytes") or 0) else 0, _num(f.get("load_s")),
                          f.get("weight_bytes") if _int(f.get("weight_bytes")) else None,
                          [str(x)[:80] for x in f["repaired"][:64]] if isinstance(f.get("repaired"), list) else None,
                          None if f.get("prefetched") is None else bool(f["prefetched"]),
                          None if f.get("reused_session") is None else bool(f["reused_session"]),
                          _opt_size(f.get("bytes"), "bytes"), _opt_size(f.get("needed_bytes"), "needed_bytes"),
                          _opt_size(f.get("free_bytes"), "free_bytes"), _opt_size(f.get("budget_bytes"), "budget_bytes"))
        if msg.type is T.PROBED:
            times = f.get("times")
            if times is not None and not (isinstance(times, list) and all(_finite(t) and t >= 0 for t in times)):
                raise ProtocolError("probed: times must be finite seconds")
            rtt, bandwidth = _num(f.get("rtt_s")), _num(f.get("bandwidth_bytes_per_s"))
            if (rtt is not None and rtt < 0) or (bandwidth is not None and bandwidth <= 0):
                raise ProtocolError("probed: rtt_s must be >= 0 and bandwidth_bytes_per_s > 0")
            error = f.get("error")
            return Probed(_need_int(f["probe"], "probe"), bool(f.get("ok")), times, rtt, bandwidth,
                          str(error).splitlines()[0][:200] if error else None)
        if msg.type is T.ERROR:
            code = f.get("code")
            try:
                code = ErrorCode(code) if code is not None else None
            except ValueError:
                code = ErrorCode.INTERNAL
            text = str(f.get("message", "worker error")).splitlines()
            return Error(text[0] if text else "worker error", code, f.get("seq") if isinstance(f.get("seq"), str) else None,
                         f.get("step") if _int(f.get("step")) else None, f.get("rid") if isinstance(f.get("rid"), str) else None)
        if msg.type is T.DRAFT_READY:
            step_s, load_s = _num(f.get("step_s")), _num(f.get("load_s"))
            if step_s is not None and step_s < 0:
                raise ProtocolError("draft_ready: step_s must be >= 0")
            return DraftReady(bool(f.get("ok")), _opt_str(f.get("name"), "name"), step_s, load_s,
                              f["fetched_bytes"] if _int(f.get("fetched_bytes")) else None, _one_line(f.get("error")))
        if msg.type is T.DRAFTED:
            return _drafted(f, vocab_size)
        if msg.type is T.FORWARD:
            if not isinstance(f.get("batch"), list) or not all(isinstance(i, dict) and isinstance(i.get("seq"), str) for i in f["batch"]):
                raise ProtocolError("forward: batch must be a list of entries with a seq")
            return Forward(_need_int(f["plan"], "plan"), f["batch"], f.get("timings"), f.get("relay_to"), msg.tensors)
    except KeyError as exc:
        raise ProtocolError(f"{msg.type.value}: missing field {exc.args[0]!r}") from None
    return msg  # types without a payload the coordinator reads (bye, ...)


def _str(v, name: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"field {name!r} must be a string, got {type(v).__name__}")
    return v


def _opt_str(v, name: str) -> str | None:
    return None if v is None else _str(v, name)


def _ints(v, name: str) -> list:
    if not (isinstance(v, list) and all(_int(x) for x in v)):
        raise ProtocolError(f"field {name!r} must be a list of integers")
    return v


def _load(f: dict) -> Load:
    files = f["files"]
    if not (isinstance(files, list) and all(isinstance(x, str) for x in files)):
        raise ProtocolError("load: files must be a list of sha256 strings")
    start, end = _need_int(f["start"], "start"), _need_int(f["end"], "end")
    if not 0 <= start < end:
        raise ProtocolError(f"load: bad unit range [{start}, {end})")
    return Load(_need_int(f["plan"], "plan"), start, end, _str(f["graph"], "graph"), files, NextHop.of(f["next"]), _ints(f["keep"], "keep"),
                _opt_int(f.get("max_context"), "max_context"), _opt_int(f.get("kv_bytes_per_token"), "kv_bytes_per_token"),
                bool(f["warm"]) if f.get("warm") is not None else None, bool(f["prefetch"]) if f.get("prefetch") is not None else None,
                _opt_str(f.get("data_secret"), "data_secret"), _opt_int(f.get("matmul_bytes"), "matmul_bytes"),
                _opt_int(f.get("head_bytes"), "head_bytes"), _first_hop(f.get("first")), _opt_str(f.get("fed_by"), "fed_by"),
                _opt_str(f.get("feed_secret"), "feed_secret"))


def _first_hop(wire) -> NextHop | None:
    """A LOAD's ``first``: a worker hop on a data port (a relayed first stage takes no feed)."""
    if wire is None:
        return None
    hop = NextHop.of(wire)
    if hop.kind != "worker" or hop.relay or not hop.url or hop.replicas:
        raise ProtocolError("load: first must be a worker hop with a url (no relay, no replicas)")
    return hop


def _probe(f: dict) -> Probe:
    kind = f.get("kind")
    if kind not in (None, "link", "accept", "peer", "echo"):
        raise ProtocolError(f"probe: unknown kind {kind!r}"[:200])
    return Probe(_need_int(f["probe"], "probe"), _opt_int(f.get("plan"), "plan"), _opt_int(f.get("reps"), "reps"),
                 _opt_int(f.get("context"), "context"), kind, _opt_int(f.get("bytes"), "bytes"), _opt_str(f.get("url"), "url"),
                 _opt_str(f.get("secret"), "secret"), _opt_str(f.get("fingerprint"), "fingerprint"), _probe_rows(f.get("rows")))


MAX_PROBE_ROWS = 64


def _probe_rows(value) -> int | None:
    rows = _opt_int(value, "rows")
    if rows is not None and not 1 <= rows <= MAX_PROBE_ROWS:
        raise ProtocolError(f"probe: rows must be 1..{MAX_PROBE_ROWS}, got {rows}")
    return rows


def _kv_export(f: dict) -> KvExport:
    return KvExport(_str(f["seq"], "seq"), _need_int(f["plan"], "plan"), _need_int(f["start"], "start"), _need_int(f["end"], "end"),
                    _need_int(f["to_plan"], "to_plan"), _opt_str(f.get("url"), "url"), _need_int(f["move"], "move"),
                    _opt_str(f.get("secret"), "secret"), _opt_str(f.get("fingerprint"), "fingerprint"), _opt_int(f.get("upto"), "upto"),
                    _opt_str(f.get("as_seq"), "as_seq"), _opt_int(f.get("since"), "since"))


def _emulate(f: dict) -> Emulate:
    slowdown = f["slowdown"]
    if not (_finite(slowdown) and slowdown >= 1):
        raise ProtocolError("emulate: slowdown must be a finite number >= 1")
    return Emulate(float(slowdown))


def _one_line(v) -> str | None:
    return None if v is None else (str(v).splitlines() or ["error"])[0][:200]


def _drafted(f: dict, vocab_size: int) -> Drafted:
    def ids(v) -> bool:
        return isinstance(v, list) and all(_int(t) and 0 <= t < vocab_size for t in v)

    tokens, q_ids, q_probs = f.get("tokens"), f.get("q_ids"), f.get("q_probs")
    if tokens is not None and not ids(tokens):
        raise ProtocolError(f"drafted: tokens must be ids in [0, {vocab_size})")
    if (q_ids is None) != (q_probs is None):
        raise ProtocolError("drafted: q_ids and q_probs come together")
    if q_ids is not None:
        if not (isinstance(q_ids, list) and isinstance(q_probs, list) and len(q_ids) == len(q_probs) == len(tokens or [])
                and all(ids(i) and isinstance(p, list) and len(i) == len(p) and all(_finite(x) and x >= 0 for x in p)
                        for i, p in zip(q_ids, q_probs))):
            raise ProtocolError("drafted: a distribution per draft, ids in the vocabulary and finite probabilities >= 0 of one length")
    compute_s = _num(f.get("compute_s"))
    return Drafted(_need_int(f["id"], "id"), bool(f.get("ok")), tokens, q_ids, q_probs,
                   compute_s if compute_s is not None and compute_s >= 0 else None, _one_line(f.get("error")))


def _draft_load(f: dict) -> DraftLoad:
    files = f["files"]
    if not (isinstance(files, list) and all(isinstance(x, str) for x in files)):
        raise ProtocolError("draft_load: files must be a list of sha256 strings")
    max_context, reps = _need_int(f["max_context"], "max_context"), _opt_int(f.get("reps"), "reps")
    if max_context < 1 or (reps is not None and not 1 <= reps <= 64):
        raise ProtocolError("draft_load: max_context must be >= 1 and reps in [1, 64]")
    return DraftLoad(_str(f["name"], "name"), _str(f["graph"], "graph"), files, max_context, reps)


def _draft(f: dict) -> Draft:
    seq, keep, k, step = _str(f["seq"], "seq"), _need_int(f["keep"], "keep"), _need_int(f["k"], "k"), _need_int(f["step"], "step")
    if keep < 0 or not 0 <= k <= 64 or step < 0:
        raise ProtocolError("draft: keep and step must be >= 0, k in [0, 64]")
    sampling = f.get("sampling")
    if sampling is not None:
        if not (isinstance(sampling, Mapping) and all(_finite(sampling.get(n)) for n in ("temperature", "top_p"))
                and _int(sampling.get("top_k")) and _int(sampling.get("seed"))):
            raise ProtocolError("draft: sampling must be {temperature, top_k, top_p, seed} numbers")
        if sampling.get("min_p") is not None and not (_finite(sampling["min_p"]) and 0 <= sampling["min_p"] <= 1):
            raise ProtocolError("draft: sampling.min_p must be a number in [0, 1]")
        sampling = MappingProxyType({n: sampling[n] for n in ("temperature", "top_k", "top_p", "seed", "min_p") if n in sampling})
    return Draft(_need_int(f["id"], "id"), seq, keep, k, step, sampling, bool(f["rule"]) if f.get("rule") is not None else None)


_TO_WORKER = {
    T.WELCOME: lambda f: Welcome(_str(f["worker_id"], "worker_id")),
    T.LOAD: _load,
    T.ACTIVATE: lambda f: Activate(_ints(f["keep"], "keep")),
    T.DROP: lambda f: Drop(_str(f["seq"], "seq")),
    T.PING: lambda f: Ping(_num(f.get("t"))),
    T.PROBE: _probe,
    T.KV_EXPORT: _kv_export,
    T.EMULATE: _emulate,
    T.NOTICE: lambda f: Notice(_str(f["text"], "text")[:500], _opt_int(f.get("done"), "done"), _opt_int(f.get("total"), "total")),
    T.BYE: lambda f: Bye(bool(f["final"]) if f.get("final") is not None else None),
    T.DRAFT_LOAD: _draft_load,
    T.DRAFT: _draft,
}


def _logprob_entry(entry, vocab_size: int) -> None:
    """A TOKEN frame's logprobs entry: finite logprobs <= 0 (a little slack), ids in the vocabulary."""
    def lps(v) -> bool:
        return isinstance(v, list) and len(v) <= 1 << 20 and all(_finite(x) and x <= 1e-3 for x in v)

    def ids(v) -> bool:
        return isinstance(v, list) and all(_int(t) and 0 <= t < vocab_size for t in v)

    if not (isinstance(entry, dict) and _finite(entry.get("logprob")) and entry["logprob"] <= 1e-3 and ids(entry.get("top_ids"))
            and lps(entry.get("top_logprobs")) and len(entry["top_ids"]) == len(entry["top_logprobs"]) <= 20):
        raise ProtocolError("token: a logprobs entry needs a finite logprob and top_ids/top_logprobs of one length (<= 20)")
    prompt = entry.get("prompt")
    if prompt is not None:
        if not (isinstance(prompt, list) and len(prompt) == 3 and lps(prompt[0]) and isinstance(prompt[1], list)
                and isinstance(prompt[2], list) and len(prompt[1]) == len(prompt[2]) == len(prompt[0])
                and all(ids(a) and lps(b) and len(a) == len(b) <= 20 for a, b in zip(prompt[1], prompt[2]))):
            raise ProtocolError("token: prompt logprobs must be [logprobs, top ids, top logprobs], one row per position")


def _int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _need_int(v, name: str) -> int:
    if not _int(v):
        raise ProtocolError(f"field {name!r} must be an integer, got {v!r}"[:200])
    return int(v)


def _opt_int(v, name: str) -> int | None:
    return None if v is None else _need_int(v, name)


def _opt_size(v, name: str) -> int | None:
    """An optional byte count: an int >= 0 (a negative one is refused)."""
    n = _opt_int(v, name)
    if n is not None and n < 0:
        raise ProtocolError(f"{name} must be >= 0")
    return n


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v) -> float | None:
    return float(v) if _finite(v) else None


def _timings(v) -> list:
    """Per-stage timings with a finite, non-negative duration (others are dropped)."""
    if not isinstance(v, list):
        raise ProtocolError("timings must be a list")
    out = []
    for entry in v:
        if not (isinstance(entry, list) and len(entry) >= 3 and _finite(entry[1]) and entry[1] >= 0 and _int(entry[2])):
            raise ProtocolError(f"bad timing entry {entry!r}"[:200])
        out.append(entry)
    return out
