"""The cluster as data: a frozen ``ClusterState`` changed only by events through ``apply``.

Everything the control plane decides from lives here: the workers (what they declared, when
they were last heard, how regular their heartbeats are, whether they are suspected:
``worker_info``), the plan slots (active, preparing, spare), the running requests (their KV
reservation, the sequence id and plan that hold their KV), the API's admission tickets
(``admission_book``) and the phase (Down -> Preparing -> Committing -> Up).
Channels, futures and tasks are I/O and stay in the coordinator's shell.

``apply(state, event) -> state`` is pure and total: an event about a worker or request that is
not (or no longer) known leaves the state as it was, so a late or duplicated event is harmless.
Every event carries the time it happened (``now``), so replaying events rebuilds the state; the
event types are defined in ``events``, the log that keeps and replays them in ``event_log``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from . import admission_book as AB, step_book as SB  # the API's admission ledger; the steps in flight and the lanes
# The event types (``events``), re-exported so callers write ``state.Heard(...)``.
from .events import (
    WorkerJoined, Heard, Ponged, Suspected, WorkerLost, Misbehaved, PlanAbandoned, Calibrating,
    EmulationChanged, Preparing, PrepareFailed, LoadRefused, Committing, Committed, PlanFailed, SpareChosen, SpareLoaded, Pinned, Repriced,
    SecretsIssued, SwitchStarted, SwitchEnded, Noted, NoteKind, UpTimings, RequestStarted, StepPlanned, StepBroke, RequestFed, RequestPaused, Routed, KvMoved, KvMoveSent,
    KvMoveEnded, RequestEnded, Event, ProbeAccepting,
)
from . import checkpoints as K, prefix_book as PB, sequence_ids
from .checkpoints import (Checkpoint, CheckpointDropped, CheckpointSending, CheckpointStored, CheckpointVoid, CopyBook,  # noqa: F401
                          CopySent, Resume, RoundEnded)  # events and values, as state.X
from .placement import Deployment, StageAssignment
# What the state keeps of one worker (``worker_info``), re-exported as state.X.
from .worker_info import (HEARTBEAT_WINDOW, QUARANTINE_MAX_S, QUARANTINE_S, STALL_S, STALL_WINDOW,  # noqa: F401
                          Quarantine, WorkerInfo, heard, struck)
from .prefix_book import PrefixBook, PrefixDecided, PrefixDone  # noqa: F401 - events, as state.X

OUTAGE_WINDOW = 32


class Phase(str, Enum):
    DOWN = "down"
    PREPARING = "preparing"
    COMMITTING = "committing"
    UP = "up"


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class Progress:
    """Where a request's token loop stands, changed by ``StepPlanned``, ``RequestFed`` and
    ``StepBroke`` and read by ``rules.progress``: the sequence id its steps go under and its
    epoch, the plan its KV was fed on, the plan its latest step went to, whether the stages hold
    positions the next step must forget, the checkpoint it resumed from, its consecutive broken
    steps and when it last made progress."""

    seq: str
    epoch: int = 0
    fed_plan: int | None = None  # whose workers hold its KV once its latest step is fed (-1: that step broke; None: none yet)
    sent_plan: int | None = None  # the plan its id's latest step went to (its KV is there, token or not)
    rewind: bool = False  # the stages hold positions past the count (rejected drafts): the next step forgets them
    resume: Resume | None = None  # the checkpoint on the spare its latest step resumed from
    breaks: int = 0  # consecutive broken steps
    last_progress: float = 0.0  # when it started or its latest step was fed


@dataclass(frozen=True)
class RequestInfo:
    rid: str
    positions: int  # KV positions it may grow to (prompt + max_tokens): its reservation
    seq: str  # the sequence id its KV lives under now (<rid>.<epoch>)
    plan: int | None = None  # plan whose workers hold its KV (None: none yet / lost)
    kv_len: int = 0  # tokens in that KV
    migrated_to: int | None = None  # a plan that received its KV by a move (resume there without replay)
    resume: Resume | None = None  # a committed plan that holds a checkpoint of its KV (replay only what came after it)
    route: tuple[int, tuple[str, ...]] | None = None  # (plan, a worker per stage): its replicas there (cluster.replicas)
    paused: tuple[float, int] | None = None  # (since, step): a step broke and none was fed since (``RequestPaused``)
    recovered: tuple[float, int] | None = None  # the pause its last fed step ended (the dashboard's ``recovered`` line)
    progress: Progress | None = None  # its token loop (``Progress``; set by ``RequestStarted``)


@dataclass(frozen=True)
class ClusterState:
    phase: Phase = Phase.DOWN
    phase_since: float = 0.0
    workers: Mapping[str, WorkerInfo] = field(default_factory=lambda: _frozen({}))
    active: Deployment | None = None
    preparing: Deployment | None = None
    spare: tuple[StageAssignment, ...] | None = None
    requests: Mapping[str, RequestInfo] = field(default_factory=lambda: _frozen({}))
    ever_up: bool = False
    last_switch: float = 0.0
    down_since: float | None = None  # left Up at (None: Up, or never up)
    outages: tuple[float, ...] = ()  # seconds from leaving Up to the next Up
    phase_time: Mapping[str, float] = field(default_factory=lambda: _frozen({p.value: 0.0 for p in Phase}))
    last_failure: str | None = None  # the last reason a plan could not be made or loaded
    # the stages of the last plan that failed to prepare while another served, and when (not
    # prepared again in a row: ``deploy.repeats_failure``); cleared by a commit or a change of membership
    failed_stages: tuple[StageAssignment, ...] | None = None
    failed_at: float = 0.0
    refusals: Mapping[str, LoadRefused] = field(default_factory=lambda: _frozen({}))  # worker -> its last LOAD refused over budget
    joins: int = 0  # workers ever joined (numbers their ids)
    # by device identity, so that reconnecting does not clear it
    quarantine: Mapping[tuple, Quarantine] = field(default_factory=lambda: _frozen({}))
    pin: tuple[int, float] | None = None  # (plan id, until): an operator's plan the re-planner keeps
    switching: int | None = None  # the plan being swapped in while sequences pause between steps (None: they step)
    # plan -> worker -> data-port secret (``net.auth``); kept out of reprs (logs, assertion messages)
    secrets: Mapping[int, Mapping[str, str]] = field(default_factory=lambda: _frozen({}), repr=False)
    spare_plan: int | None = None  # the plan id the spare's stages were loaded under
    spare_built: frozenset[str] = frozenset()  # the spare's workers whose session is built (they take KV checkpoints)
    checkpoints: Mapping[str, Checkpoint] = field(default_factory=lambda: _frozen({}))  # rid -> what the spare holds of its KV
    moves: Mapping[int, KvMoveSent] = field(default_factory=lambda: _frozen({}))  # KV moves of a switch in flight, by id
    steps: SB.StepBook = SB.StepBook()  # the steps in flight and the lanes (``step_book``)
    prefix: PrefixBook = PrefixBook()  # the blocks the active plan's stages cache, decisions in flight, counts (``prefix_book``)
    checkpoint_copies: CopyBook = CopyBook()  # checkpoint copies in flight, and where checkpoint KV may be held (``checkpoints``)
    admission: AB.AdmissionBook = AB.AdmissionBook()  # the API's tickets running and waiting in line (``admission_book``)

    def live(self, now: float | None = None) -> list[WorkerInfo]:
        """Workers not suspected (nor quarantined at ``now``), in join order: the ones a new plan may use."""
        return sorted((w for w in self.workers.values() if w.suspected_since is None and not self.quarantined(w, now)),
                      key=lambda w: (w.joined_at, w.id))

    def quarantined(self, worker: WorkerInfo, now: float | None) -> bool:
        q = self.quarantine.get(worker.identity)
        return now is not None and q is not None and q.until > now

    def uses(self, worker_id: str) -> bool:
        return self.active is not None and worker_id in self.active.workers

    def pinned(self, now: float) -> bool:
        """The active plan is an operator's, pinned until a later time (a lost worker ends it:
        the plan is abandoned and its successor is not pinned)."""
        return self.active is not None and self.pin is not None and self.pin[0] == self.active.plan_id and now < self.pin[1]


# -- the reducer --------------------------------------------------------------------------------
def apply(state: ClusterState, event: Event) -> ClusterState:
    """The state after ``event`` (pure; unknown workers/requests leave it unchanged)."""
    match event:
        case WorkerJoined(wid, name, hello, now):
            info = WorkerInfo(wid, name, hello, joined_at=now, last_seen=now)
            return _replace(state, workers=_with(state.workers, wid, info), joins=state.joins + 1, failed_stages=None)
        case Heard(wid, now) if wid in state.workers:
            return _worker(state, heard(state.workers[wid], now))
        case Ponged(wid, rtt, stats, now) if wid in state.workers:
            return _worker(state, _replace(state.workers[wid], rtt_s=rtt, stats=_frozen(stats), stats_at=now))
        case Suspected(wid, now) if wid in state.workers and state.workers[wid].suspected_since is None:
            return _worker(state, _replace(state.workers[wid], suspected_since=now))
        case WorkerLost(wid, why, now) if wid in state.workers:
            state = _replace(state, workers=_without(state.workers, wid), refusals=_without(state.refusals, wid), failed_stages=None)
            if state.spare and any(s.worker_id == wid for s in state.spare):
                # a holder is gone: no checkpoint is whole
                state = _replace(state, spare=None, spare_plan=None, spare_built=frozenset(), checkpoints=_frozen({}))
            if state.preparing is not None and wid in state.preparing.workers:
                state = _replace(state, preparing=None)
            return _down(state, now) if state.uses(wid) else state
        case PlanAbandoned(plan_id, why, now) if state.active is not None and state.active.plan_id == plan_id:
            return _down(_replace(state, last_failure=why), now)
        case Misbehaved(wid, why, now) if wid in state.workers:
            identity = state.workers[wid].identity
            return _replace(state, quarantine=_with(state.quarantine, identity, struck(state.quarantine.get(identity), why, now)))
        case Calibrating(wid, busy) if wid in state.workers:
            return _worker(state, _replace(state.workers[wid], calibrating=busy))
        case ProbeAccepting(wid, secret) if wid in state.workers:
            return _worker(state, _replace(state.workers[wid], probe_secret=secret))
        case EmulationChanged(wid, slowdown) if wid in state.workers:
            w = state.workers[wid]
            return _worker(state, _replace(w, hello=w.hello.with_slowdown(slowdown)))
        case Preparing(dep, now):
            state = _replace(state, preparing=dep)
            gone = K.displaced(state.spare, dep.stages)
            if gone:  # they drop their spare session for the new stage: the checkpoints in it go too
                state = _replace(state, spare_built=state.spare_built - gone, checkpoints=K.without_holders(state.checkpoints, gone))
            return _phase(state, Phase.PREPARING, now) if state.active is None else state
        case PrepareFailed(plan_id, why, now):
            if state.preparing is not None and state.preparing.plan_id == plan_id:
                state = _replace(state, preparing=None, failed_stages=state.preparing.stages if state.active is not None else None,
                                 failed_at=now)
            state = _replace(state, last_failure=why)
            return _phase(state, Phase.DOWN, now) if state.active is None else state
        case LoadRefused(wid) if wid in state.workers:
            return _replace(state, refusals=_with(state.refusals, wid, event))
        case Committing(now) if state.active is None:
            return _phase(state, Phase.COMMITTING, now)
        case Committed(dep, now, _):
            resumes = K.resumable(state.checkpoints, state.spare, dep.stages, dep.plan_id)
            if resumes:  # the spare plan came up: its workers hold these sequences' checkpoints
                state = _replace(state, requests=_frozen({r: _replace(q, resume=resumes[r]) if r in resumes else q
                                                          for r, q in state.requests.items()}))
            # the secrets of the new plan and of the one it replaces are kept, those of other (failed) plans go
            kept = {dep.plan_id} | ({state.active.plan_id} if state.active is not None else set())
            secrets = _frozen({p: s for p, s in state.secrets.items() if p in kept})
            state = _replace(state, active=dep, preparing=None, ever_up=True, last_switch=now, last_failure=None, secrets=secrets, failed_stages=None,
                             prefix=PB.switched(state.prefix, dep.plan_id))  # the cache of another plan's stages is void
            return _phase(state, Phase.UP, now)
        case SecretsIssued(plan_id, secrets):
            return _replace(state, secrets=_with(state.secrets, plan_id, _frozen(secrets)))
        case SwitchStarted(plan_id, _):
            return _replace(state, switching=plan_id)
        case SwitchEnded(plan_id, _) if state.switching == plan_id:
            return _replace(state, switching=None)
        case PlanFailed(why, _):
            return _replace(state, last_failure=why)
        case SpareChosen(stages):
            # checkpoints are of the spare they were copied to
            return _replace(state, spare=stages, spare_plan=None, spare_built=frozenset(), checkpoints=_frozen({}))
        case SpareLoaded(plan_id, stages, wid, built) if stages == state.spare and state.spare_plan in (None, plan_id):
            kept = state.spare_built | {wid} if built else state.spare_built - {wid}
            return _replace(state, spare_plan=plan_id, spare_built=kept)
        case Pinned(plan_id, until):
            return _replace(state, pin=None if plan_id is None else (plan_id, until))
        case Repriced(plan_id, predicted):
            repriced = {slot: _replace(dep, predicted=dict(predicted)) for slot in ("active", "preparing")
                        if (dep := getattr(state, slot)) is not None and dep.plan_id == plan_id}
            return _replace(state, **repriced) if repriced else state
        case Noted():
            return state  # a dashboard line: logged, changes nothing
        case KvMoveSent(move):
            return _replace(state, moves=_with(state.moves, move, event))
        case KvMoveEnded(move, _) if move in state.moves:
            return _replace(state, moves=_without(state.moves, move))
        case PrefixDecided() | PrefixDone():
            return _replace(state, prefix=PB.apply(state.prefix, event))
        case RequestStarted(rid, positions, now):
            seq = sequence_ids.live(rid, 0)
            return _replace(state, requests=_with(state.requests, rid, RequestInfo(rid, positions, seq, progress=Progress(seq, last_progress=now))))
        case StepPlanned(rid, plan, seq, epoch, fed_plan, rewind, resume) if rid in state.requests:
            q = state.requests[rid]
            progress = _replace(q.progress or Progress(q.seq), seq=seq, epoch=epoch, fed_plan=fed_plan, sent_plan=plan, rewind=rewind, resume=resume)
            return _replace(state, requests=_with(state.requests, rid, _replace(q, progress=progress)))
        case StepBroke(rid) if rid in state.requests:
            q = state.requests[rid]
            progress = q.progress or Progress(q.seq)
            progress = _replace(progress, fed_plan=-1, breaks=progress.breaks + 1)
            return _replace(state, requests=_with(state.requests, rid, _replace(q, progress=progress)))
        case RequestFed(rid, seq, plan, kv_len, now, rewind) if rid in state.requests:
            q = state.requests[rid]
            progress = q.progress and _replace(q.progress, fed_plan=plan, rewind=rewind, breaks=0,
                                               last_progress=q.progress.last_progress if now is None else now)
            q = _replace(q, seq=seq, plan=plan, kv_len=kv_len, migrated_to=None, resume=None, paused=None, recovered=q.paused,
                         progress=progress)
            return _replace(state, requests=_with(state.requests, rid, q))
        case RequestPaused(rid, step, _, now) if rid in state.requests and state.requests[rid].paused is None:
            return _replace(state, requests=_with(state.requests, rid, _replace(state.requests[rid], paused=(now, step))))
        case CheckpointSending():  # its names are placed whatever became of the request (``checkpoints.book``)
            state = _replace(state, checkpoint_copies=K.book(state.checkpoint_copies, event))
            return _replace(state, checkpoints=K.sending(state.checkpoints, state.spare, event)) if event.rid in state.requests else state
        case CopySent() | RoundEnded() | CheckpointDropped():
            return _replace(state, checkpoint_copies=K.book(state.checkpoint_copies, event))
        case CheckpointStored() if event.rid in state.requests:
            return _replace(state, checkpoints=K.stored(state.checkpoints, state.spare, state.spare_built, event))
        case CheckpointVoid(rid) if rid in state.requests:
            q = state.requests[rid]
            return _replace(state, checkpoints=_without(state.checkpoints, rid),
                            requests=_with(state.requests, rid, _replace(q, resume=None)) if q.resume else state.requests)
        case Routed(rid, plan, route) if rid in state.requests:
            return _replace(state, requests=_with(state.requests, rid, _replace(state.requests[rid], route=(plan, tuple(route)))))
        case KvMoved(rid, plan) if rid in state.requests:
            return _replace(state, requests=_with(state.requests, rid, _replace(state.requests[rid], migrated_to=plan)))
        case RequestEnded(rid) if rid in state.requests:
            return _replace(state, requests=_without(state.requests, rid), checkpoints=_without(state.checkpoints, rid))
        case (SB.StepSent() | SB.StepEnded() | SB.LaneAsked() | SB.LaneReturned() | SB.LaneLeft() | SB.LaneExpired() | SB.DirectFed()
              | SB.DirectHeard() | SB.DirectEnded()):
            return _replace(state, steps=SB.apply(state.steps, event))
        case AB.Admitted() | AB.Queued() | AB.Refused() | AB.AdmissionEnded():
            return _replace(state, admission=AB.apply(state.admission, event))
    return state


def _replace(obj, **changes):
    """``dataclasses.replace`` for this module's frozen dataclasses (no ``__post_init__``, no
    ``init=False`` fields), without re-running ``__init__``: the reducer's hot path (12% of a
    simulated schedule went to ``dataclasses.replace``)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


def _with(m: Mapping, key, value) -> Mapping:
    return _frozen({**m, key: value})


def _without(m: Mapping, key) -> Mapping:
    return _frozen({k: v for k, v in m.items() if k != key})


def _down(state: ClusterState, now: float) -> ClusterState:
    """No active plan: Down, no sequence's KV is on a plan any more, nor any cached prefix."""
    state = _phase(_replace(state, active=None, prefix=PB.switched(state.prefix, None)), Phase.DOWN, now)
    return _replace(state, requests=_frozen({r: _replace(q, plan=None, migrated_to=None) for r, q in state.requests.items()}))


def _worker(state: ClusterState, w: WorkerInfo) -> ClusterState:
    return _replace(state, workers=_with(state.workers, w.id, w))


def _phase(state: ClusterState, phase: Phase, now: float) -> ClusterState:
    spent = {**state.phase_time, state.phase.value: state.phase_time[state.phase.value] + max(0.0, now - state.phase_since)}
    down_since, outages = state.down_since, state.outages
    if phase is not state.phase:
        if state.phase is Phase.UP:
            down_since = now
        elif phase is Phase.UP and down_since is not None:
            outages = (outages + (now - down_since,))[-OUTAGE_WINDOW:]
            down_since = None
    return _replace(state, phase=phase, phase_since=now, phase_time=_frozen(spent), down_since=down_since, outages=outages)
