"""The steps in flight, as part of the cluster state (pure): which sequence's step went out on
which plan and through which workers, and the lanes the decode steps wait in (``batching``),
changed only by ``StepSent``/``StepEnded`` and the lane events through ``apply``.

A step is in flight from the moment its sequence asks for it (it may first wait for its lane,
``batching``) until its token comes back, it fails, or it is given up. The decisions over the
table are plain functions of it: which step a TOKEN or ERROR frame settles (``settled_by``,
``errored``), what a lost plan fails (``on_plan``), and whom a timed-out step blames
(``alone``, and the stages' computed counts at sending, for ``membership.idle_stage``). The
futures a request awaits are the shell's (``steps``), keyed by the step ids given out here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Mapping

from . import batching
from .batching import LaneAsked, LaneBook, LaneExpired, LaneLeft, LaneReturned  # noqa: F401 - the lanes' events, as step_book.X

class StepEnd(str, Enum):
    TOKEN = "token"  # its token came back from the last stage
    FAILED = "failed"  # a worker's ERROR, a send that failed, or its plan was lost
    TIMED_OUT = "timed_out"  # no token within the step timeout (the request retries on a new plan)
    GIVEN_UP = "given_up"  # its sequence ended and stopped waiting for it (``Steps.finish``)


@dataclass(frozen=True)
class InFlight:
    step_id: int
    seq: str
    step: int
    plan: int
    rid: str
    path: tuple[str, ...]  # its workers in pipeline order (its route on a plan with replicated stages)
    computed_before: Mapping[str, int | None]  # each of them's computed rows at sending (``membership.computed_counts``)
    sent_at: float
    crowded: bool  # another sequence's step on its plan was in flight when it was sent
    sent_index: int  # steps sent on its plan up to this one (any sent after it: ``StepBook.sent_on`` moved on)


@dataclass(frozen=True)
class Ahead:
    """The direct token path (``cluster.direct``): the last stage of ``plan`` feeds the sequence's
    step ``step`` itself (no frame from the coordinator), and ``early`` holds the results
    of its steps that came back before the sequence asked for them (step -> ``step_path.StepResult``)."""

    plan: int
    step: int
    early: Mapping[int, object] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class StepBook:
    inflight: Mapping[int, InFlight] = field(default_factory=lambda: MappingProxyType({}))  # by step id
    sent_on: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))  # plan -> steps ever sent on it
    next_id: int = 1
    lanes: LaneBook = LaneBook()  # the micro-batch lanes: members, steps waiting for their lane, lanes out
    ahead: Mapping[str, Ahead] = field(default_factory=lambda: MappingProxyType({}))  # seq -> the step its stage feeds itself


@dataclass(frozen=True)
class StepSent:
    """``seq`` asked for its step ``step`` on ``plan`` through ``path`` (it goes out with its lane,
    or alone as a prefill); its step id is ``StepBook.next_id`` before this event."""

    seq: str
    step: int
    plan: int
    rid: str
    path: tuple[str, ...]
    computed_before: Mapping[str, int | None]
    now: float


@dataclass(frozen=True)
class StepEnded:
    step_id: int
    how: StepEnd
    now: float


@dataclass(frozen=True)
class DirectFed:
    """The stage fed ``seq``'s step ``step`` on ``plan`` itself (its TOKEN frame said so)."""

    seq: str
    plan: int
    step: int


@dataclass(frozen=True)
class DirectHeard:
    """The result of ``seq``'s step ``step``, fed by its stage, came before the sequence asked for it."""

    seq: str
    plan: int
    step: int
    result: object  # ``step_path.StepResult``


@dataclass(frozen=True)
class DirectEnded:
    """``seq``'s stage no longer feeds it (it ended, its plan was lost, it went another way)."""

    seq: str


DirectEvent = DirectFed | DirectHeard | DirectEnded


def apply(book: StepBook, event: StepSent | StepEnded | batching.LaneEvent | DirectEvent) -> StepBook:
    """The book after one of its events (pure; the end of a step not in flight changes nothing).
    A sequence has one step in flight: a new one replaces an older one still listed."""
    match event:
        case StepSent(seq, step, plan, rid, path, before, now):
            kept = {i: f for i, f in book.inflight.items() if f.seq != seq}
            crowded = any(f.plan == plan for f in kept.values())
            index = book.sent_on.get(plan, 0) + 1
            flight = InFlight(book.next_id, seq, step, plan, rid, tuple(path), MappingProxyType(dict(before)), now, crowded, index)
            return StepBook(MappingProxyType({**kept, book.next_id: flight}), MappingProxyType({**book.sent_on, plan: index}),
                            book.next_id + 1, book.lanes, book.ahead)
        case StepEnded(step_id, _, _) if step_id in book.inflight:
            return StepBook(MappingProxyType({i: f for i, f in book.inflight.items() if i != step_id}), book.sent_on, book.next_id,
                            book.lanes, book.ahead)
        case LaneAsked() | LaneReturned() | LaneLeft() | LaneExpired():
            return StepBook(book.inflight, book.sent_on, book.next_id, batching.apply(book.lanes, event), book.ahead)
        case DirectFed(seq, plan, step):
            was = book.ahead.get(seq)
            early = {s: r for s, r in was.early.items() if s >= step} if was is not None and was.plan == plan else {}
            return _ahead(book, {**book.ahead, seq: Ahead(plan, step, MappingProxyType(early))})
        case DirectHeard(seq, plan, step, result) if seq in book.ahead and book.ahead[seq].plan == plan and step >= book.ahead[seq].step:
            was = book.ahead[seq]
            return _ahead(book, {**book.ahead, seq: Ahead(was.plan, was.step, MappingProxyType({**was.early, step: result}))})
        case DirectEnded(seq) if seq in book.ahead:
            return _ahead(book, {k: v for k, v in book.ahead.items() if k != seq})
    return book


def _ahead(book: StepBook, ahead: dict) -> StepBook:
    return StepBook(book.inflight, book.sent_on, book.next_id, book.lanes, MappingProxyType(ahead))


# -- decisions --------------------------------------------------------------------------------------
def of_seq(book: StepBook, seq: str) -> InFlight | None:
    """``seq``'s step in flight, if any."""
    return next((f for f in book.inflight.values() if f.seq == seq), None)


def settled_by(book: StepBook, plan: int, seq: str, step: int) -> InFlight | None:
    """The step a token for ``seq``'s step ``step`` on ``plan`` settles (None: a late or stray one)."""
    f = of_seq(book, seq)
    return f if f is not None and f.step == step and f.plan == plan else None


def errored(book: StepBook, seq: str | None, step: int | None) -> InFlight | None:
    """The step a worker's ERROR about ``seq`` (its step ``step``, when it names one) fails."""
    f = of_seq(book, seq) if seq else None
    return f if f is not None and (step is None or step == f.step) else None


def on_plan(book: StepBook, plan: int | None) -> list[InFlight]:
    """The steps in flight on ``plan`` (None: every plan), in the order they were sent."""
    return [f for _, f in sorted(book.inflight.items()) if plan is None or f.plan == plan]


def fed_by_stage(book: StepBook, seq: str, step: int, plan: int) -> bool:
    """``seq``'s step ``step`` on ``plan`` is one its stage feeds itself (the direct token path):
    no frame goes out for it, its token comes (or came: ``Ahead.early``) all the same."""
    a = book.ahead.get(seq)
    return a is not None and a.plan == plan and a.step == step


def alone(book: StepBook, flight: InFlight) -> bool:
    """No other step of its plan was in flight when it was sent, nor was one sent after it."""
    return not flight.crowded and book.sent_on.get(flight.plan) == flight.sent_index

