"""The API's admission ledger as state: which tickets run, which wait in line (``ClusterState.admission``).

A request the HTTP routes accept asks for a slot under a ticket (``core.AdmitAsked``); the
decision is ``decide`` (admit, queue or refuse: a pure function of the book, the request's KV
positions, the workers' KV capacity and the limits) and, when a slot frees, ``starts`` (which
heads of the line go now, in arrival order). What happened is an event here, applied by
``apply`` (``state.apply`` delegates): ``Admitted`` (it runs, from the line or at once),
``Queued``, ``Refused`` (counted) and ``AdmissionEnded`` (it left: released, or gave up its
place in line). The futures the shell's callers await stay in the shell (``scheduling.Admission``).

The rule (``fits``): at most ``max_active`` sequences run, and their KV must fit what the
workers' budgets hold: a stage keeps one row per sequence, each as long as the longest, so a
request is admitted while ``(running + 1) x max(longest running, its own positions)`` fits the
capacity (None: unbounded). One request always runs alone, so one the plan can hold at all is
never starved. The next ``max_queue`` wait in arrival order; beyond that it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class Limits:
    max_active: int = 16  # sequences running at once at most
    max_queue: int = 64  # waiting in line at most; beyond it a request is refused
    retry_after_s: int = 1  # what a refusal tells the client (``Retry-After``)


@dataclass(frozen=True)
class AdmissionBook:
    running: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))  # ticket -> KV positions it may grow to
    waiting: tuple[tuple[int, int], ...] = ()  # (ticket, positions) in arrival order
    refused: int = 0  # requests refused since the start


# -- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    """``ticket`` runs (taken from the line, or admitted at once); its KV may grow to ``positions``."""

    ticket: int
    positions: int


@dataclass(frozen=True)
class Queued:
    ticket: int
    positions: int


@dataclass(frozen=True)
class Refused:
    ticket: int
    why: str


@dataclass(frozen=True)
class AdmissionEnded:
    """``ticket`` left: its slot was released, or it gave up its place in line."""

    ticket: int


AdmissionEvent = Admitted | Queued | Refused | AdmissionEnded


def apply(book: AdmissionBook, event: AdmissionEvent) -> AdmissionBook:
    """The book after ``event`` (pure; a ticket not known leaves it unchanged)."""
    match event:
        case Admitted(ticket, positions):
            waiting = tuple(w for w in book.waiting if w[0] != ticket)
            return replace(book, running=MappingProxyType({**book.running, ticket: positions}), waiting=waiting)
        case Queued(ticket, positions):
            return replace(book, waiting=(*book.waiting, (ticket, positions)))
        case Refused():
            return replace(book, refused=book.refused + 1)
        case AdmissionEnded(ticket) if ticket in book.running:
            return replace(book, running=MappingProxyType({t: p for t, p in book.running.items() if t != ticket}))
        case AdmissionEnded(ticket) if any(w[0] == ticket for w in book.waiting):
            return replace(book, waiting=tuple(w for w in book.waiting if w[0] != ticket))
    return book


# -- decisions --------------------------------------------------------------------------------------
class Verdict(str, Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REFUSE = "refuse"


def fits(book: AdmissionBook, positions: int, capacity: int | None, limits: Limits) -> bool:
    """A request of ``positions`` may run beside the running ones (see the module docstring)."""
    if not book.running:
        return True
    if len(book.running) >= limits.max_active:
        return False
    return capacity is None or (len(book.running) + 1) * max(positions, *book.running.values()) <= capacity


def decide(book: AdmissionBook, positions: int, capacity: int | None, limits: Limits) -> Verdict:
    """Admit, queue or refuse a new request: nobody overtakes the line."""
    if not book.waiting and fits(book, positions, capacity, limits):
        return Verdict.ADMIT
    return Verdict.QUEUE if len(book.waiting) < limits.max_queue else Verdict.REFUSE


def starts(book: AdmissionBook, capacity: int | None, limits: Limits) -> tuple[Admitted, ...]:
    """Who leaves the line for a slot now: the head goes first, or nobody does."""
    out = []
    for ticket, positions in book.waiting:
        if not fits(book, positions, capacity, limits):
            break
        out.append(event := Admitted(ticket, positions))
        book = apply(book, event)
    return tuple(out)


def limit(book: AdmissionBook, capacity: int | None, limits: Limits) -> int:
    """Sequences that could run at once if each grew to the longest running one."""
    if capacity is None or not book.running:
        return limits.max_active
    return max(1, min(limits.max_active, capacity // max(book.running.values())))
