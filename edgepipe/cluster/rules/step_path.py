"""The step path's part of the coordinator's core (pure): its inputs, its commands and
``decide(state, input) -> (events, commands)``, which ``core.handle`` folds into the state.

A sequence asks for a step (``StepAsked``: its ``StepSent``); a decode step then waits for its
lane, which goes out as one frame (the lane events of ``batching``, inputs and events at once:
``SendBatch`` sends what a lane lets go, ``ArmLane`` starts the wait for its late members); the
last stage's TOKEN frame settles the steps it names (``SettleStep``), a worker's ERROR fails one
(``FailStep``, retried on the next plan or final), a timed-out step ends and may blame the stage
that dropped it (``Quarantine``), a sequence that ended gives up its step, and a lost plan (or
a frame that could not be sent) fails its steps. The table they change is ``ClusterState.steps``
(``step_book``); the futures the requests await are the shell's (``steps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...net.messages import Error, ErrorCode, Token
from ..state import batching, step_book as SB
from . import membership, replicas
from ..state.events import Noted, NoteKind


# -- inputs -----------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class DirectForgotten:
    """``seq`` ended: its stage's run ahead of it is of no use (its KV is dropped)."""

    seq: str


LaneInput = SB.LaneAsked | SB.LaneReturned | SB.LaneLeft | SB.LaneExpired  # a lane's input is its own event
StepInput = StepAsked | TokenHeard | ErrorHeard | StepTimedOut | StepGivenUp | StepsLost | DirectForgotten | LaneInput


# -- commands ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """What the last stage returned for one step."""

    token: int
    timings: list  # [[worker_id, compute_s, positions, bytes/elem, batch], ...]: one per stage, shared by a batch
    first: bool  # the batch's first entry (its other entries carry the same timings: count stage times once)
    logprobs: dict | list | None
    verified: list | None
    fed: bool = False  # the stage fed the sequence's next step itself (the direct token path: ``step_book.Ahead``)


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


@dataclass(frozen=True)
class SendBatch:
    """Send these decode steps (one plan, one first worker) as one FORWARD frame."""

    step_ids: tuple[int, ...]


@dataclass(frozen=True)
class ArmLane:
    """Start lane ``index``'s wait for its late members (``lane_wait_s``), then ``LaneExpired(index, departure)``."""

    index: int
    departure: int


StepCommand = SettleStep | FailStep | Quarantine | SendBatch | ArmLane


def decide(state, event: StepInput) -> tuple[tuple, tuple]:
    """The events and commands of one step-path input (``state``: the ``ClusterState`` before it)."""
    book = state.steps
    match event:
        case StepAsked(seq, step, plan, rid, path, now):
            sent = SB.StepSent(seq, step, plan, rid, path, membership.computed_counts(state, path), now)
            ahead = book.ahead.get(seq)
            # A fed token keeps its lane out (its stage runs the next step). A step asked another way
            # means that run ended unseen (a new plan, a replay, a failure): the lane comes back
            # first, or the step would wait behind it until its timeout.
            back = (SB.LaneReturned(rid),) if batching.out(book.lanes, rid) and not SB.fed_by_stage(book, seq, step, plan) else ()
            if ahead is None:
                return (*back, sent), ()
            if not SB.fed_by_stage(book, seq, step, plan):  # it went another way (a replay, a new plan): the stage's run is void
                return (SB.DirectEnded(seq), *back, sent), ()
            early = ahead.early.get(step)
            if early is None:  # its stage computes it: the token comes as for a step sent
                return (sent,), ()
            # it came before it was asked for: settled at once
            return (sent, SB.StepEnded(book.next_id, SB.StepEnd.TOKEN, now), _chained(seq, plan, step, early.fed)), \
                (SettleStep(book.next_id, early),)
        case SB.LaneAsked() | SB.LaneReturned() | SB.LaneLeft() | SB.LaneExpired():
            gone = batching.departures(book.lanes, event)
            if gone.book == book.lanes:
                return (), ()
            return (event,), (*(ArmLane(i, d) for i, d in gone.armed), *(SendBatch(tuple(it.step_id for it in b)) for b in gone.batches))
        case TokenHeard(wid, msg, now):
            dep = state.active
            if dep is not None and dep.plan_id == msg.plan and not replicas.last_stage(dep, wid):
                why = f"token frame for plan {msg.plan} from a stage that is not its last"
                return (Noted(NoteKind.IGNORED, {"worker": wid, "why": why}, now),), ()
            events, commands = [], []
            for i, entry in enumerate(msg.entries()):
                result = StepResult(entry.token, msg.timings, i == 0, entry.logprobs, entry.verified, entry.fed)
                flight = SB.settled_by(book, msg.plan, entry.seq, entry.step)
                if flight is not None and flight.step_id not in {e.step_id for e in events if isinstance(e, SB.StepEnded)}:
                    events.append(SB.StepEnded(flight.step_id, SB.StepEnd.TOKEN, now))
                    commands.append(SettleStep(flight.step_id, result))
                    if entry.fed or entry.seq in book.ahead:
                        events.append(_chained(entry.seq, msg.plan, entry.step, entry.fed))
                elif flight is None and _awaited_ahead(book, msg.plan, entry.seq, entry.step):
                    events.append(SB.DirectHeard(entry.seq, msg.plan, entry.step, result))
            return tuple(events), tuple(commands)
        case ErrorHeard(wid, err, now):
            flight = SB.errored(book, err.seq, err.step)
            if flight is None:
                return (), ()
            events = [SB.StepEnded(flight.step_id, SB.StepEnd.FAILED, now), *_unfed(book, flight.seq)]
            if err.code is ErrorCode.CORRUPT_INPUT:  # the previous stage sent garbage: never served, retried on a new plan
                events.append(Noted(NoteKind.INVALID_FRAME, {"worker": wid, "why": err.message}, now))
            why = err.message if err.retryable else f"worker {wid}: {err.message}"
            return tuple(events), (FailStep(flight.step_id, why, final=not err.retryable),)
        case StepTimedOut(step_id, timeout_s, now) if step_id in book.inflight:
            flight = book.inflight[step_id]
            idle = membership.idle_stage(state, flight.path, flight.computed_before, flight.sent_at, SB.alone(book, flight))
            why = f"computed nothing for {flight.seq} step {flight.step} in {timeout_s} s while answering pings"
            return (SB.StepEnded(step_id, SB.StepEnd.TIMED_OUT, now), *_unfed(book, flight.seq)), (Quarantine(idle, why),) if idle else ()
        case StepGivenUp(step_id, now) if step_id in book.inflight:
            return (SB.StepEnded(step_id, SB.StepEnd.GIVEN_UP, now), *_unfed(book, book.inflight[step_id].seq)), ()
        case StepsLost(plan, why, now, final, ids):
            lost = [f for f in SB.on_plan(book, None) if f.step_id in ids] if ids is not None else SB.on_plan(book, plan)
            unfed = {f.seq for f in lost} | ({s for s, a in book.ahead.items() if plan is None or a.plan == plan} if ids is None else set())
            return (tuple(SB.StepEnded(f.step_id, SB.StepEnd.FAILED, now) for f in lost) + tuple(SB.DirectEnded(s) for s in sorted(unfed)
                                                                                             if s in book.ahead),
                    tuple(FailStep(f.step_id, why, final) for f in lost))
        case DirectForgotten(seq) if seq in book.ahead:
            return (SB.DirectEnded(seq),), ()
    return (), ()


def _chained(seq: str, plan: int, step: int, fed: bool):
    """After ``seq``'s step ``step`` settled: its stage feeds the next one itself, or no longer."""
    return SB.DirectFed(seq, plan, step + 1) if fed else SB.DirectEnded(seq)


def _awaited_ahead(book, plan: int, seq: str, step: int) -> bool:
    """A token no step waits for yet, of a step its stage fed itself: kept until it is asked for."""
    a = book.ahead.get(seq)
    return a is not None and a.plan == plan and step >= a.step and step not in a.early


def _unfed(book, seq: str) -> tuple:
    """A sequence whose step failed: what its stage may still compute of it is void (replayed)."""
    return (SB.DirectEnded(seq),) if seq in book.ahead else ()
