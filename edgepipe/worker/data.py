"""The worker core's data (``worker.core``): its state, the events it takes besides the typed wire
messages (what the shell reports back), and the commands it gives the shell. Plain frozen values."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

import numpy as np

from ..emulate.roofline import RooflinePolicy
from ..net import limits
from ..net.messages import Activate, Drop, Emulate, ErrorCode, Forward, Kv, KvExport, Load, NextHop, Probe, Token
from ..net.protocol import Message

# -- state --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Session:
    """What the core knows of a built stage graph: enough to check the frames it is given."""

    graph: str
    takes_token_ids: bool  # first stage: token ids in
    emits_tokens: bool  # last stage: token ids out
    hidden: int  # width of the activations in (0: token ids or unknown)
    layers: tuple[int, ...]  # decoder layers it holds KV for (none: embedding or head alone)
    vocab: int | None = None
    kv_itemsize: int = 4  # bytes of one KV element as the graph keeps it (the gguf form's fp16 cache: 2)


@dataclass(frozen=True)
class Stage:
    """A stage of one plan: units ``[start, end)`` run by ``graph``'s session, output to ``next``."""

    plan: int
    start: int
    end: int
    graph: str
    next: NextHop
    weight_bytes: int
    secret: str | None = None  # what this stage's predecessor must present on the data port
    frame_limit: int = limits.HEADER_SLACK_BYTES  # largest frame accepted on the data port for this plan
    max_context: int | None = None
    matmul_bytes: int | None = None  # weight bytes its matrix products read per step (emulated roofline); None: weight_bytes
    head_bytes: int = 0  # of those, the head's (it computes a row's last position only)
    # the direct token path on a plan of several stages (``Load.first``, ``Load.fed_by``)
    first: NextHop | None = None  # the last stage: the plan's first stage, fed the next step of a direct run
    first_secret: str | None = None  # the last stage: what it presents when it feeds the first
    fed_by: str | None = None  # the first stage: the worker of its plan's last stage, the one peer it takes token ids from
    feed_secret: str | None = None  # the first stage: what that peer presents (None: an open cluster)

    @property
    def compute_bytes(self) -> int:
        return self.weight_bytes if self.matmul_bytes is None else self.matmul_bytes


@dataclass(frozen=True)
class WorkerState:
    name: str
    join_token: str | None = None
    budget_bytes: int | None = None  # emulated memory budget (weights + KV), None: none
    slowdown: float = 1.0
    misreport: float = 1.0  # reported compute times are divided by this (a faulty device, emulated)
    drop_work: bool = False  # a faulty device that drops every activation frame (emulated)
    activation_dtype: str = "float32"  # "float16" halves the bytes on the wire
    data_url: str | None = None
    worker_id: str | None = None
    joins: int = 0  # memberships so far (1 + rejoins)
    stages: dict[int, Stage] = field(default_factory=dict)  # plan -> stage
    sessions: dict[str, Session] = field(default_factory=dict)  # built sessions by graph sha
    warm: frozenset[str] = frozenset()  # sessions kept as a warm spare (or from the previous membership)
    held: dict[str, dict[str, int]] = field(default_factory=dict)  # graph -> seq -> positions in its KV
    step_s: dict[str, float] = field(default_factory=dict)  # graph -> last decode step's seconds
    probe_secret: str | None = None  # what a peer timing this data port presents (probe kind "accept")
    spare: int | None = None  # the spare plan whose stage is in ``stages`` (KV checkpoints land there)
    computed: int = 0
    busy_s: float = 0.0
    fetched_bytes: int = 0
    roofline: RooflinePolicy | None = None  # emulated roofline device (replaces the slowdown), None: none
    # the last sequence ids DROPPED here, oldest first (core.DROPPED_KEPT; a dict for order and a cheap
    # lookup on every frame): a stale frame of one brings no KV back
    dropped: dict[str, None] = field(default_factory=dict)

    def stage_of(self, plan: int) -> Stage | None:
        return self.stages.get(plan)

    def length(self, graph: str, seq: str) -> int:
        return self.held.get(graph, {}).get(seq, 0)

    def in_use(self, keep: list | tuple, warm: bool, graph: str) -> int:
        """Weight bytes that stay beside a stage of ``graph``: the sessions of the stages kept (a
        warm spare: of every stage), each counted once, ``graph``'s own not at all (it is reused)."""
        kept = {s.graph: s.weight_bytes for p, s in self.stages.items() if (warm or p in keep) and p != self.spare}
        return sum(b for g, b in kept.items() if g != graph)


# -- events from the shell (besides the typed wire messages) -------------------------------------------------
@dataclass(frozen=True)
class Joined:
    """The coordinator welcomed this worker (a first join or a rejoin)."""

    worker_id: str


@dataclass(frozen=True)
class Pinged:
    """A PING, with what only the shell can see (KV bytes of its runners, queue, loop lag)."""

    t: float | None
    kv_bytes: int
    queue: int
    loop_lag_s: float
    prefix_bytes: int = 0  # KV of cached prompt blocks (beside the sequences' KV)


@dataclass(frozen=True)
class Fetched:
    """A LOAD's files are in the blob cache (``fetched_bytes`` of them were downloaded now)."""

    load: Load
    fetched_bytes: int
    weight_bytes: int
    repaired: tuple[str, ...] = ()


@dataclass(frozen=True)
class Built:
    """A LOAD's session is built (or was already: ``reused``)."""

    load: Load
    session: Session
    weight_bytes: int
    fetched_bytes: int
    load_s: float
    reused: bool
    repaired: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoadFailed:
    load: Load
    error: str  # one line


@dataclass(frozen=True)
class Computed:
    """A FORWARD ran: ``out`` is the stage's output (hidden rows, or token ids from a head)."""

    forward: Forward
    out: np.ndarray
    compute_s: float
    cpu_s: float | None  # the call's CPU time when single-threaded (see SlowdownPolicy)
    positions: int
    joins: int  # the membership it started in
    lengths: dict = field(default_factory=dict)  # seq -> positions its KV holds now (the runner's count)
    logprobs: dict = field(default_factory=dict)  # the head's logprobs field, when asked


@dataclass(frozen=True)
class Failed:
    """Work on a frame failed (compute, or sending its result): each sequence of it is told."""

    msg: Forward | Kv | Drop | KvExport  # the compute-ordered frame whose work failed
    code: ErrorCode
    text: str
    lengths: dict = field(default_factory=dict)  # seq -> positions its KV holds after the failure (the runner's count)


@dataclass(frozen=True)
class Imported:
    """Moved KV is installed; ``length`` is what the sequence's KV now holds."""

    kv: Kv
    graph: str
    length: int
    nbytes: int


@dataclass(frozen=True)
class ExportFailed:
    export: KvExport
    error: str


@dataclass(frozen=True)
class StageTimed:
    probe: int
    times: list[float]


@dataclass(frozen=True)
class PeerMeasured:
    probe: int
    rtt_s: float | None = None
    bandwidth_bytes_per_s: float | None = None
    error: str | None = None


Event = Union[Joined, Pinged, Fetched, Built, LoadFailed, Computed, Failed, Imported, ExportFailed, StageTimed, PeerMeasured,
              Load, Activate, Drop, Emulate, Probe, KvExport, Forward, Kv]  # frames as net.messages.parse types them


# -- commands for the shell ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SendControl:
    msg: Message


@dataclass(frozen=True)
class SendPeer:
    """A frame to another worker's data port for ``plan`` (presenting ``secret``)."""

    url: str
    plan: int
    msg: Message
    secret: str | None
    fingerprint: str | None
    about: Forward | None = None  # the frame whose result this is: a failed send fails its sequences


@dataclass(frozen=True)
class Forget:
    """A new membership: drop every sequence's KV, queued frames and peer connections."""


@dataclass(frozen=True)
class FetchFiles:
    load: Load


@dataclass(frozen=True)
class BuildSession:
    load: Load
    fetched_bytes: int
    weight_bytes: int
    repaired: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeepSessions:
    """Release every built session but these graphs, and the prefix blocks of every plan but these."""

    graphs: frozenset[str]
    plans: frozenset[int] | None = None  # None: every plan's blocks stay


@dataclass(frozen=True)
class RunStage:
    forward: Forward
    graph: str
    seqs: list[str]
    x: np.ndarray
    inline: bool  # a fast decode step: run on the event loop
    prefixes: tuple[tuple[str, dict], ...] = ()  # (seq, prefix entry): cached blocks installed before, saved after (cluster.prefix)
    out_dtype: str | None = None  # "float16": the compute casts its output so (the next stage is a worker on a half-width wire)


@dataclass(frozen=True)
class Wait:
    seconds: float


@dataclass(frozen=True)
class DropSequence:
    graphs: tuple[str, ...]
    seq: str


@dataclass(frozen=True)
class ExportKv:
    export: KvExport
    graph: str
    secret: str | None


@dataclass(frozen=True)
class ImportKv:
    kv: Kv
    graph: str
    layers: tuple[int, ...]


@dataclass(frozen=True)
class SendLinkPayload:
    probe: int
    nbytes: int


@dataclass(frozen=True)
class MeasurePeer:
    probe: int
    url: str
    secret: str | None
    fingerprint: str | None
    most_bytes: int


@dataclass(frozen=True)
class TimeStage:
    probe: int
    graph: str
    reps: int
    context: int
    rows: int = 1  # sequences decoded together in each timed step
    weight_bytes: int = 0  # the stage's, for an emulated roofline


@dataclass(frozen=True)
class FeedSelf:
    """The direct token path on a one-stage plan: the stage's next decode step, fed with the tokens
    it just sampled, into its own compute queue (behind what arrived meanwhile)."""

    forward: Forward


@dataclass(frozen=True)
class FeedFirst:
    """The direct token path on a plan of several stages: the last stage's next decode step, fed
    with the tokens it just sampled, to the plan's first stage at ``url`` (its data port, presenting
    its feed ``secret``), then the tokens' ``copy`` to the coordinator. A send that fails turns the
    copy unfed (``unfed``), so the coordinator sends the next step itself at once rather than wait
    for a step that never comes until its timeout."""

    url: str
    plan: int
    forward: Forward
    secret: str | None
    fingerprint: str | None
    copy: Token

    def unfed(self) -> Token:
        """The copy as if the stage had fed nothing: the coordinator takes the next steps on."""
        return replace(self.copy, fed=[False] * len(self.copy.fed or ()))


Command = Union[SendControl, SendPeer, Forget, FetchFiles, BuildSession, KeepSessions, RunStage, Wait, DropSequence, ExportKv, ImportKv,
                SendLinkPayload, MeasurePeer, TimeStage, FeedSelf, FeedFirst]
