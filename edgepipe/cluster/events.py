"""What happens to the cluster, as data: one frozen dataclass per event ``state.apply`` understands.

Every event that concerns time carries ``now`` (the clock of whoever emitted it), so a log of
events replays into the same state. Events say what happened, never what to do about it: the
decisions are in ``membership``, ``scheduling`` and ``deploy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..net.messages import Hello
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
class Committing:
    now: float


@dataclass(frozen=True)
class Committed:
    deployment: Deployment
    now: float


@dataclass(frozen=True)
class PlanFailed:
    why: str


@dataclass(frozen=True)
class SpareChosen:
    stages: tuple[StageAssignment, ...] | None


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
class RequestStarted:
    rid: str
    positions: int


@dataclass(frozen=True)
class RequestFed:
    """A step's token came back: the sequence's KV lives on ``plan`` with ``kv_len`` tokens."""

    rid: str
    seq: str
    plan: int | None
    kv_len: int


@dataclass(frozen=True)
class KvMoved:
    rid: str
    plan: int | None  # the plan that now holds its KV (None: the move was abandoned)


@dataclass(frozen=True)
class RequestEnded:
    rid: str


Event = (WorkerJoined | Heard | Ponged | Suspected | WorkerLost | Misbehaved | PlanAbandoned | Calibrating | EmulationChanged | Preparing | PrepareFailed
         | Committing | Committed | PlanFailed | SpareChosen | Pinned | Repriced | RequestStarted | RequestFed | KvMoved | RequestEnded)
