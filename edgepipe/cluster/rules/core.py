"""The coordinator's decisions as data (sans-IO): one ``handle(state, input, config) -> Handled(state,
events, commands)`` over one union of inputs, ``Input``.

An input is something that happened at the coordinator's edge: a heartbeat is due, a frame or a
pong came from a worker, a worker's LOADED came (whose it is: a LOAD's waiter, a switch's KV
move, a checkpoint's copy), a prompt prefill is about to be sent, the frame that carried a prefix
decision came back, an API request asks for a slot or leaves it (admit, queue or refuse it; when
one leaves, who in line starts: the book is ``ClusterState.admission``, ``admission_book``), and
the step path's inputs (``step_path``: a sequence asks for a step or its lane, a TOKEN or ERROR
frame came from a stage, a step timed out or was given up, a plan's steps were lost).
``handle`` returns the state after the events that input makes, those events (the shell logs
them, and narrates them like every other, without applying them again) and the commands the
shell must carry out (``Command``: take a worker out, fail a plan's steps, wake the re-planner,
ping every worker, record a measurement, send a prefill with its prefix decision, hand a LOADED
to its owner, start or refuse a request, settle or fail a step's future, send a lane's batch,
arm a lane's timer, quarantine a worker).

One shell carries out every command: ``shells.executor.Executor`` (a total match over
``Command``). The shells that meet these inputs (``connections``: heartbeats, frames heard,
pongs, LOADED; ``prefix_cache``: prefills; ``steps``: the step path, whose in-flight table and
lanes are ``ClusterState.steps``, ``step_book``; ``admission``: the API's tickets) hand them to
it. A request's token loop once admitted is still its shell's own code (``requests``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ...net.messages import Loaded
from ..state import admission_book as AB, measurements as M, prefix, prefix_book as PB
from . import membership, scheduling, step_path
from .profiling import RUNTIME_OVERHEAD_BYTES
from ..state.state import ClusterState, Event, Heard, Ponged, apply
from .step_path import (ArmLane, DirectForgotten, ErrorHeard, FailStep, Quarantine, SendBatch, SettleStep, StepAsked, StepGivenUp, StepInput,  # noqa: F401
                        StepResult, StepsLost, StepTimedOut, TokenHeard)  # the step path's inputs and commands, as core.X

HEARD_EVERY_S = 0.05  # frames closer than this tell the failure detector nothing new


# -- inputs -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeartbeatDue:
    last: float  # when the previous heartbeat ran
    now: float
    replay_s: float  # rough time to rebuild the active plan's live KV by replay (what abandoning it costs)
    weight_bytes: int  # what the model needs of the workers: its weights...
    kv_bytes: int  # ...and KV for the tokens every plan reserves (``scheduling.shortfall``)


@dataclass(frozen=True)
class FrameHeard:
    worker_id: str
    now: float


@dataclass(frozen=True)
class PongHeard:
    worker_id: str
    sent_at: float | None  # the ping's time it echoes (None: a worker that echoes none)
    stats: Mapping
    now: float


@dataclass(frozen=True)
class PrefillAsked:
    """A prompt prefill of ``ids`` from position 0 for ``rid`` on ``plan`` (the cache is on there)."""

    plan: int
    rid: str
    ids: list[int]
    reuse: bool  # False: every position must be computed (prompt logprobs)
    room: int  # blocks the cache may hold (``prefix.room_blocks``)


@dataclass(frozen=True)
class PrefillEnded:
    rid: str
    ok: bool  # the frame came back from the last stage (False: it failed or was given up part-way)


@dataclass(frozen=True)
class LoadAnswered:
    """A worker's LOADED: the answer to a LOAD, or (``kv_received``) the acknowledgement of a KV copy."""

    worker_id: str
    reply: Loaded


@dataclass(frozen=True)
class AdmitAsked:
    """An accepted API request asks for a slot under ``ticket``; its KV may grow to ``positions``."""

    ticket: int
    positions: int
    capacity: int | None  # KV positions the workers' budgets hold now (None: unbounded; ``deploy.kv_capacity``)
    limits: AB.Limits  # the admission's (``scheduling.Admission``: the API's, set by ``serve``)


@dataclass(frozen=True)
class AdmitLeft:
    """``ticket`` is done with its slot, or gives up its place in line (a client gone while it waited)."""

    ticket: int
    capacity: int | None
    limits: AB.Limits


Input = HeartbeatDue | FrameHeard | PongHeard | LoadAnswered | PrefillAsked | PrefillEnded | AdmitAsked | AdmitLeft | StepInput


# -- commands ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoseWorker:
    worker_id: str
    why: str


@dataclass(frozen=True)
class FailPlan:
    """Fail every step in flight on ``plan`` (it was given up): those sequences pause and continue on the next."""

    plan: int
    why: str


@dataclass(frozen=True)
class Replan:
    """Wake the re-planner."""


@dataclass(frozen=True)
class PingAll:
    now: float


@dataclass(frozen=True)
class Measure:
    measurement: M.Measurement


@dataclass(frozen=True)
class CarryPrefix:
    """Send ``rid``'s prefill with ``decision`` (every stage applies it in frame order)."""

    rid: str
    decision: prefix.PrefillDecision


@dataclass(frozen=True)
class AnswerLoad:
    """Hand ``reply`` to whoever awaits ``worker_id``'s LOAD of ``reply.plan`` (none: a late answer, dropped)."""

    worker_id: str
    reply: Loaded


@dataclass(frozen=True)
class AckKvMove:
    """A KV move of a switch was acknowledged (``ClusterState.moves``)."""

    reply: Loaded


@dataclass(frozen=True)
class AckCheckpointCopy:
    """A checkpoint's copy was acknowledged (``ClusterState.checkpoint_copies``)."""

    reply: Loaded


@dataclass(frozen=True)
class StartRequest:
    """``ticket`` has its slot: hand it to its waiter, whose token loop starts (a waiter already gone gives it back)."""

    ticket: int


@dataclass(frozen=True)
class RefuseRequest:
    """Refuse ``ticket`` now (the API's 429 with ``Retry-After``)."""

    ticket: int
    why: str
    retry_after_s: int


Command = (LoseWorker | FailPlan | Replan | PingAll | Measure | CarryPrefix | AnswerLoad | AckKvMove | AckCheckpointCopy
           | StartRequest | RefuseRequest | step_path.StepCommand)


@dataclass(frozen=True)
class Config:
    liveness: membership.LivenessSettings = membership.LivenessSettings()
    prefix_block: int = 32  # token ids per cached prefix block

    @classmethod
    def of(cls, settings) -> "Config":
        """From ``CoordinatorSettings``."""
        liveness = membership.LivenessSettings(settings.heartbeat_s, min_suspect_s=settings.dead_after_s,
                                               lose_after_s=settings.lose_after_s)
        return cls(liveness, settings.prefix_block)


@dataclass(frozen=True)
class Handled:
    state: ClusterState  # the state after ``events``
    events: tuple[Event, ...] = ()
    commands: tuple[Command, ...] = field(default=())


def handle(state: ClusterState, event: Input, config: Config) -> Handled:
    """The events ``event`` makes, the state after them and the commands to carry out (pure)."""
    match event:
        case HeartbeatDue(last, now, replay_s, weight_bytes, kv_bytes):
            lacking = lambda st: scheduling.shortfall(st, weight_bytes, kv_bytes, RUNTIME_OVERHEAD_BYTES, now)  # noqa: E731
            beat = membership.beat(state, last, now, config.liveness, replay_s, lacking)
            commands: list[Command] = [LoseWorker(v.worker_id, v.why) for v in beat.lose]
            if beat.abandoned is not None:
                commands.append(FailPlan(beat.abandoned, beat.events[-1].why))
            commands += [Replan()] if beat.replan else []
            return _after(state, beat.events, (*commands, PingAll(now)))
        case FrameHeard(wid, now):
            seen = state.workers.get(wid)
            if seen is not None and (seen.suspected_since is not None or now - seen.last_seen >= HEARD_EVERY_S):
                return _after(state, (Heard(wid, now),))
        case PongHeard(wid, sent_at, stats, now):
            rtt = now - sent_at if sent_at is not None and sent_at <= now else None
            return _after(state, (Ponged(wid, rtt, stats, now),), (Measure(M.HeartbeatRtt(wid, rtt)),) if rtt is not None else ())
        case LoadAnswered():
            return _loaded(state, event)
        case AdmitAsked() | AdmitLeft():
            return _admission(state, event)
        case PrefillAsked(plan, rid, ids, reuse, room):
            decided = PB.decide(state.prefix, plan, rid, ids, room, config.prefix_block, reuse)
            if decided is not None:
                return _after(state, (decided,), () if decided.decision.empty else (CarryPrefix(rid, decided.decision),))
        case PrefillEnded(rid, ok):
            return _after(state, (PB.PrefixDone(rid, ok),))
        case (StepAsked() | TokenHeard() | ErrorHeard() | StepTimedOut() | StepGivenUp() | StepsLost() | DirectForgotten()
              | step_path.SB.LaneAsked() | step_path.SB.LaneReturned() | step_path.SB.LaneLeft() | step_path.SB.LaneExpired()):
            return _after(state, *step_path.decide(state, event))
    return Handled(state)


def _after(state: ClusterState, events: tuple, commands: tuple = ()) -> Handled:
    for e in events:
        state = apply(state, e)
    return Handled(state, tuple(events), tuple(commands))




def _loaded(state: ClusterState, answer: LoadAnswered) -> Handled:
    """Whose a LOADED is: a LOAD's answer, a switch's KV move or a checkpoint's copy in flight; an
    acknowledgement of a copy no longer in flight (its round or switch is over) is dropped.
    Changes no state: the shell that awaits it records the outcome."""
    reply = answer.reply
    if reply.kv_received is None:
        return Handled(state, (), (AnswerLoad(answer.worker_id, reply),))
    if reply.kv_received in state.moves:
        return Handled(state, (), (AckKvMove(reply),))
    if reply.kv_received in state.checkpoint_copies.copies:
        return Handled(state, (), (AckCheckpointCopy(reply),))
    return Handled(state)


def _admission(state: ClusterState, asked: AdmitAsked | AdmitLeft) -> Handled:
    """Admit, queue or refuse a request; when one leaves, who in line starts. A ticket queued gets
    no command: its waiter waits for a ``StartRequest``."""
    book = state.admission
    match asked:
        case AdmitAsked(ticket, positions, capacity, limits):
            verdict = AB.decide(book, positions, capacity, limits)
            if verdict is AB.Verdict.ADMIT:
                return _after(state, (AB.Admitted(ticket, positions),), (StartRequest(ticket),))
            if verdict is AB.Verdict.QUEUE:
                return _after(state, (AB.Queued(ticket, positions),))
            why = f"server busy: {len(book.running)} requests running and {len(book.waiting)} queued; retry later"
            return _after(state, (AB.Refused(ticket, why),), (RefuseRequest(ticket, why, limits.retry_after_s),))
        case AdmitLeft(ticket, capacity, limits) if ticket in book.running:
            ended = apply(state, AB.AdmissionEnded(ticket))
            started = AB.starts(ended.admission, capacity, limits)
            return _after(state, (AB.AdmissionEnded(ticket), *started), tuple(StartRequest(e.ticket) for e in started))
        case AdmitLeft(ticket, _, _) if any(t == ticket for t, _ in book.waiting):
            # as before the book: a place given up in line starts nobody (the next release does)
            return _after(state, (AB.AdmissionEnded(ticket),))
    return Handled(state)
