"""The coordinator's decisions as data (sans-IO): ``handle(state, input, config) -> Handled(state,
events, commands)``.

An input is something that happened at the coordinator's edge: a heartbeat is due, a frame or a
pong came from a worker, a prompt prefill is about to be sent, the frame that carried a prefix
decision came back, a sequence asks for a step, a TOKEN or ERROR frame came from a stage, a step
timed out or was given up, a plan's steps were lost. ``handle`` returns the events that input
makes (the state after them is ``state``: the shell emits each one, so they are logged and
narrated like every other) and the commands the shell must carry out (take a worker out, fail a
plan's steps, wake the re-planner, ping every worker, record a measurement, send a prefill with
its prefix decision, settle or fail a step's future, quarantine a worker).

Driven by ``connections`` (heartbeats, frames heard, pongs), ``prefix_cache`` (prefills) and
``steps`` (the step path: the in-flight table is ``ClusterState.steps``, ``step_book``). The rest
of the coordinator's inputs (LOADED, API requests) still go through their shells' own code
(``deployer``, ``requests``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ..net.messages import Error, ErrorCode, Token
from . import measurements as M, membership, prefix, prefix_book as PB, replicas, scheduling, step_book as SB
from .events import Noted, NoteKind
from .profiling import RUNTIME_OVERHEAD_BYTES
from .state import ClusterState, Event, Heard, Ponged, apply

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
class StepAsked:
    """``seq`` asks for its step ``step`` on ``plan`` through ``path`` (its stages' workers in order)."""

    seq: str
    step: int
    plan: int
    rid: str
    path: tuple[str, ...]
    now: float


@dataclass(frozen=True)
class TokenHeard:
    """A TOKEN frame from ``worker_id``: the results of a batch's steps."""

    worker_id: str
    token: Token
    now: float


@dataclass(frozen=True)
class ErrorHeard:
    """An ERROR frame from ``worker_id`` (about a sequence's step, or about nothing in flight)."""

    worker_id: str
    error: Error
    now: float


@dataclass(frozen=True)
class StepTimedOut:
    step_id: int
    timeout_s: float
    now: float


@dataclass(frozen=True)
class StepGivenUp:
    """The sequence ended and waited for its step in flight as long as it would."""

    step_id: int
    now: float


@dataclass(frozen=True)
class StepsLost:
    """Steps that will not come back: every step on ``plan`` (None: on every plan) or, with
    ``step_ids``, those (a frame that could not be sent). ``final``: the requests fail rather than
    retry on the next plan."""

    plan: int | None
    why: str
    now: float
    final: bool = False
    step_ids: tuple[int, ...] | None = None


Input = (HeartbeatDue | FrameHeard | PongHeard | PrefillAsked | PrefillEnded | StepAsked | TokenHeard | ErrorHeard | StepTimedOut
         | StepGivenUp | StepsLost)


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
class StepResult:
    """What the last stage returned for one step."""

    token: int
    timings: list  # [[worker_id, compute_s, positions, bytes/elem, batch], ...]: one per stage, shared by a batch
    first: bool  # the batch's first entry (its other entries carry the same timings: count stage times once)
    logprobs: dict | list | None
    verified: list | None


@dataclass(frozen=True)
class SettleStep:
    step_id: int
    result: StepResult


@dataclass(frozen=True)
class FailStep:
    step_id: int
    why: str
    final: bool  # the request fails (``RequestFailed``) rather than retrying on the next plan (``PipelineBroken``)


@dataclass(frozen=True)
class Quarantine:
    """A worker that answers pings but dropped a step: out now, and out of new plans a while."""

    worker_id: str
    why: str


Command = LoseWorker | FailPlan | Replan | PingAll | Measure | CarryPrefix | SettleStep | FailStep | Quarantine


@dataclass(frozen=True)
class Config:
    liveness: membership.LivenessSettings
    prefix_block: int  # token ids per cached prefix block

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
        case PrefillAsked(plan, rid, ids, reuse, room):
            decided = PB.decide(state.prefix, plan, rid, ids, room, config.prefix_block, reuse)
            if decided is not None:
                return _after(state, (decided,), () if decided.decision.empty else (CarryPrefix(rid, decided.decision),))
        case PrefillEnded(rid, ok):
            return _after(state, (PB.PrefixDone(rid, ok),))
        case StepAsked(seq, step, plan, rid, path, now):
            return _after(state, (SB.StepSent(seq, step, plan, rid, path, membership.computed_counts(state, path), now),))
        case TokenHeard() | ErrorHeard() | StepTimedOut() | StepGivenUp() | StepsLost():
            return _step_ended(state, event)
    return Handled(state)


def _step_ended(state: ClusterState, event: Input) -> Handled:
    """The step path's answers: which steps a frame settles or fails, whom a timeout blames."""
    book = state.steps
    match event:
        case TokenHeard(wid, msg, now):
            dep = state.active
            if dep is not None and dep.plan_id == msg.plan and not replicas.last_stage(dep, wid):
                why = f"token frame for plan {msg.plan} from a stage that is not its last"
                return _after(state, (Noted(NoteKind.IGNORED, {"worker": wid, "why": why}, now),))
            events, commands = [], []
            for i, entry in enumerate(msg.entries()):
                flight = SB.settled_by(book, msg.plan, entry.seq, entry.step)
                if flight is not None and flight.step_id not in {e.step_id for e in events}:
                    events.append(SB.StepEnded(flight.step_id, SB.StepEnd.TOKEN, now))
                    commands.append(SettleStep(flight.step_id, StepResult(entry.token, msg.timings, i == 0, entry.logprobs, entry.verified)))
            return _after(state, tuple(events), tuple(commands))
        case ErrorHeard(wid, err, now):
            flight = SB.errored(book, err.seq, err.step)
            if flight is None:
                return Handled(state)
            events = [SB.StepEnded(flight.step_id, SB.StepEnd.FAILED, now)]
            if err.code is ErrorCode.CORRUPT_INPUT:  # the previous stage sent garbage: never served, retried on a new plan
                events.append(Noted(NoteKind.INVALID_FRAME, {"worker": wid, "why": err.message}, now))
            why = err.message if err.retryable else f"worker {wid}: {err.message}"
            return _after(state, tuple(events), (FailStep(flight.step_id, why, final=not err.retryable),))
        case StepTimedOut(step_id, timeout_s, now) if step_id in book.inflight:
            flight = book.inflight[step_id]
            idle = membership.idle_stage(state, flight.path, flight.computed_before, flight.sent_at, SB.alone(book, flight))
            why = f"computed nothing for {flight.seq} step {flight.step} in {timeout_s} s while answering pings"
            return _after(state, (SB.StepEnded(step_id, SB.StepEnd.TIMED_OUT, now),), (Quarantine(idle, why),) if idle else ())
        case StepGivenUp(step_id, now) if step_id in book.inflight:
            return _after(state, (SB.StepEnded(step_id, SB.StepEnd.GIVEN_UP, now),))
        case StepsLost(plan, why, now, final, ids):
            lost = [f for f in SB.on_plan(book, None) if f.step_id in ids] if ids is not None else SB.on_plan(book, plan)
            return _after(state, tuple(SB.StepEnded(f.step_id, SB.StepEnd.FAILED, now) for f in lost),
                          tuple(FailStep(f.step_id, why, final) for f in lost))
    return Handled(state)


def _after(state: ClusterState, events: tuple, commands: tuple = ()) -> Handled:
    for e in events:
        state = apply(state, e)
    return Handled(state, tuple(events), tuple(commands))
