"""What happens to the cluster, as data: one frozen dataclass per event ``state.apply`` understands.

Every event that concerns time carries ``now`` (the clock of whoever emitted it), so a log of
events replays into the same state. Events say what happened, never what to do about it: the
decisions are in ``membership``, ``scheduling`` and ``deploy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ...net.messages import Hello
from .notes import Noted, NoteKind  # noqa: F401 - the lines that change no state, as events.X
from .checkpoints import Resume
from .placement import Deployment, StageAssignment

@dataclass(frozen=True)
class WorkerJoined:
    worker_id: str
    name: str
    hello: Hello  # what it declared, parsed
    now: float


@dataclass(frozen=True)
class Heard:
    """Any frame from the worker: it is alive (clears a suspicion)."""

    worker_id: str
    now: float


@dataclass(frozen=True)
class Ponged:
    worker_id: str
    rtt_s: float | None
    stats: Mapping
    now: float


@dataclass(frozen=True)
class Suspected:
    worker_id: str
    now: float


@dataclass(frozen=True)
class WorkerLost:
    worker_id: str
    why: str
    now: float


@dataclass(frozen=True)
class Misbehaved:
    """The worker took a step and computed nothing within the step timeout while answering
    pings: out of new plans for ``state.QUARANTINE_S`` seconds, doubled for each repeat."""

    worker_id: str
    why: str
    now: float


@dataclass(frozen=True)
class PlanAbandoned:
    """The active plan stops being used although its workers are still members (a stage went
    silent and the others can serve without it): Down until the next plan is up."""

    plan_id: int
    why: str
    now: float


@dataclass(frozen=True)
class Calibrating:
    """The calibrator takes the worker (times it, or has it measure its links) or lets it go:
    a worker being calibrated is left out of new plans."""

    worker_id: str
    busy: bool


@dataclass(frozen=True)
class EmulationChanged:
    worker_id: str
    slowdown: float


@dataclass(frozen=True)
class Preparing:
    deployment: Deployment
    now: float


@dataclass(frozen=True)
class PrepareFailed:
    plan_id: int
    why: str
    now: float


@dataclass(frozen=True)
class LoadRefused:
    """``worker_id`` refused the LOAD of plan ``plan_id``'s stage [start, end) over its memory
    budget: the stage needs ``needed_bytes`` where only ``free_bytes`` of its ``budget_bytes``
    were free beside what it holds (the stage of ``beside``, the plan running when it was asked;
    None: none ran). The planner prices that worker with these figures from then on
    (``deploy.new_stage_room``): a plan it refused is not prepared again."""

    worker_id: str
    plan_id: int
    start: int
    end: int
    needed_bytes: int
    free_bytes: int
    budget_bytes: int
    beside: int | None
    now: float


@dataclass(frozen=True)
class Committing:
    now: float


@dataclass(frozen=True)
class UpTimings:
    """How a plan change went, carried by its ``Committed`` (the dashboard's "up" line is read from it)."""

    prepare_s: float  # from Preparing to Committed
    paused_s: float  # sequences paused between two steps (0 without a plan it replaced)
    fetched_bytes: int  # model files the workers downloaded to load it
    replaced: int | None = None  # the plan it replaced
    moved: Mapping = field(default_factory=dict)  # quiesce_s, kv_moved, kv_moved_bytes, kv_recomputed (``migration``)


@dataclass(frozen=True)
class Committed:
    deployment: Deployment
    now: float
    timings: UpTimings | None = None  # None: no line (a test's or a replayed commit that carried none)


@dataclass(frozen=True)
class PlanFailed:
    why: str
    attempted: bool = True  # False: no plan could fit, so none was tried (the dashboard gets no line)


@dataclass(frozen=True)
class SpareChosen:
    stages: tuple[StageAssignment, ...] | None


@dataclass(frozen=True)
class SpareLoaded:
    """A stage of the spare ``stages``, loaded as plan ``plan_id`` (negative), answered: ``built``,
    its session is built (it can take KV checkpoints), or not (it holds the files at most);
    ``error``: the load failed, and why (the dashboard's ``spare_unbuilt`` line)."""

    plan_id: int
    stages: tuple[StageAssignment, ...]
    worker_id: str
    built: bool
    error: str | None = None


@dataclass(frozen=True)
class Pinned:
    """An operator's plan: the re-planner keeps it until ``until`` (None: unpinned)."""

    plan_id: int | None
    until: float


@dataclass(frozen=True)
class Repriced:
    """A plan (active or being prepared) priced again with measured speeds (its stages timed on their own ranges)."""

    plan_id: int
    predicted: dict


@dataclass(frozen=True)
class SecretsIssued:
    """The data-port secrets of a plan being prepared, by worker (``net.auth``): kept until a
    commit replaces the plans they belong to."""

    plan_id: int
    secrets: Mapping[str, str] = field(repr=False)


@dataclass(frozen=True)
class SwitchStarted:
    """Sequences pause between two steps while ``plan_id`` is swapped in (in-flight steps drain, KV moves)."""

    plan_id: int
    now: float


@dataclass(frozen=True)
class SwitchEnded:
    """The swap is over (committed or not): sequences step again."""

    plan_id: int
    now: float


@dataclass(frozen=True)
class RequestStarted:
    rid: str
    positions: int
    now: float = 0.0  # its progress is counted from here (``Progress.last_progress``)


@dataclass(frozen=True)
class StepPlanned:
    """``rid``'s next step goes to ``plan`` under ``seq`` (epoch ``epoch``): resumed, or replayed
    on a plan that does not hold its KV (``replay``: a new id, or a checkpoint's); once fed, its KV
    lives on ``fed_plan``. ``rewind``: the step tells the stages to forget positions past its
    start; ``resume``: the checkpoint on the spare it resumes from (``rules.progress.plan_step``)."""

    rid: str
    plan: int
    seq: str
    epoch: int
    fed_plan: int | None
    rewind: bool = False
    resume: Resume | None = None
    replay: bool = False


@dataclass(frozen=True)
class StepBroke:
    """``rid``'s step broke (``PipelineBroken``): its KV is no longer known whole on any plan, so
    the retry replays; one more consecutive break (``Progress.breaks``)."""

    rid: str
    why: str
    now: float


@dataclass(frozen=True)
class RequestFed:
    """A step's token came back: the sequence's KV lives on ``plan`` with ``kv_len`` tokens (it
    ends a pause: the dashboard's ``recovered`` line)."""

    rid: str
    seq: str
    plan: int | None
    kv_len: int
    now: float | None = None
    rewind: bool = False  # the stages hold drafts the verify rejected: the next step forgets them


@dataclass(frozen=True)
class RequestPaused:
    """``rid``'s step ``step`` broke (its plan was lost, or gave the step up): it waits for a plan
    to take it again, paused from ``now`` until its next ``RequestFed``."""

    rid: str
    step: int
    why: str
    now: float


@dataclass(frozen=True)
class Routed:
    """The sequence of ``rid`` steps on ``plan`` through ``route`` (a worker per stage: its
    replicas, ``cluster.replicas``) for as long as it lives there."""

    rid: str
    plan: int
    route: tuple[str, ...]


@dataclass(frozen=True)
class KvMoved:
    rid: str
    plan: int | None  # the plan that now holds its KV (None: the move was abandoned)


@dataclass(frozen=True)
class KvMoveSent:
    """A KV move of a switch is in flight (``kv_moves``): ``src`` sends units [start, end) of
    ``rid``'s KV to ``dst`` for plan ``plan``, until its ``KvMoveEnded``."""

    move: int
    rid: str
    src: str
    dst: str
    plan: int
    start: int
    end: int


@dataclass(frozen=True)
class KvMoveEnded:
    move: int
    ok: bool  # acknowledged by its destination in time


@dataclass(frozen=True)
class RequestEnded:
    rid: str


@dataclass(frozen=True)
class ProbeAccepting:
    """``worker_id``'s data port accepts link probes that carry ``secret`` (``links``): a probe
    to it needs no new secret until it leaves. The secret is kept out of reprs."""

    worker_id: str
    secret: str = field(repr=False)


Event = (WorkerJoined | Heard | Ponged | Suspected | WorkerLost | Misbehaved | PlanAbandoned | Calibrating | EmulationChanged | Preparing | PrepareFailed
         | LoadRefused
         | Committing | Committed | PlanFailed | SpareChosen | SpareLoaded | Pinned | Repriced | SecretsIssued | SwitchStarted | SwitchEnded | Noted
         | RequestStarted | StepPlanned | StepBroke | RequestFed | RequestPaused | Routed | KvMoved | KvMoveSent | KvMoveEnded
         | RequestEnded | ProbeAccepting)
