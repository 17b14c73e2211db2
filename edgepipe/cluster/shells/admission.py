"""Admission (shell): which API requests run now, which wait in line, which are refused.

At most ``max_active`` sequences run, and their KV must fit what the workers' budgets hold; the
next ``max_queue`` wait in arrival order; beyond that :class:`QueueFull` (the API turns it into a
429 with ``Retry-After``). The rule and the book of tickets are state (``admission_book``,
``ClusterState.admission``), the decision is the core's (``core.AdmitAsked``, ``core.AdmitLeft``),
carried out by the executor (``executor``), whose ``StartRequest`` and ``RefuseRequest`` come
back here (``start``, ``refuse``). This shell keeps only the futures of the requests in line.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Mapping

from ..rules import core
from ..state import admission_book as AB
from ..state.state import ClusterState
from .executor import Executor


class AdmissionError(RuntimeError):
    """A request cannot be admitted now (``retry_after_s``: when to try again)."""

    def __init__(self, message: str, retry_after_s: int = 1, code: str = "queue_full"):
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code


class QueueFull(AdmissionError):
    pass


class Admission:
    """The book itself (who runs, who waits) is ``ClusterState.admission``: the coordinator's once
    bound to it (``bind``: its inputs go through the coordinator's executor, so its events are
    logged with every other), a state of its own before."""

    def __init__(self, max_active: int = 16, max_queue: int = 64, retry_after_s: int = 1, capacity=lambda: None):
        self.limits = AB.Limits(max_active, max_queue, retry_after_s)
        self.capacity = capacity  # () -> KV positions the workers' budgets hold, or None
        self._own = ClusterState()
        self._executor = Executor(lambda: self._own, self._adopt_own, core.Config())
        self._executor.admission = self
        self._waiters: dict[int, asyncio.Future] = {}  # ticket -> the future its caller awaits, while it waits in line
        self._tickets = itertools.count(1)

    def bind(self, coordinator) -> None:
        """Keep the book in ``coordinator``'s state (before any request is admitted)."""
        self._executor = coordinator.executor
        self._executor.admission = self
        self.capacity = lambda: coordinator.kv_capacity

    def _state(self) -> ClusterState:
        return self._executor.state()

    @property
    def max_active(self) -> int:
        return self.limits.max_active

    @property
    def running(self) -> Mapping[int, int]:
        """Ticket -> KV positions it may grow to."""
        return self._state().admission.running

    @property
    def active(self) -> int:
        return len(self.running)

    @property
    def queued(self) -> int:
        return len(self._state().admission.waiting)

    @property
    def limit(self) -> int:
        """Sequences that could run at once if each grew to the longest running one."""
        return AB.limit(self._state().admission, self.capacity(), self.limits)

    async def admit(self, positions: int = 0) -> int:
        """Wait for a slot for a request whose KV may grow to ``positions``; returns its ticket
        (``QueueFull`` when the line is full)."""
        ticket = next(self._tickets)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        try:
            self._executor.handle(core.AdmitAsked(ticket, positions, self.capacity(), self.limits))
            return await fut
        except asyncio.CancelledError:
            self._leave(ticket)  # out of the line, or the slot it was handed as it left goes back
            raise
        finally:
            self._waiters.pop(ticket, None)

    def release(self, ticket: int | None) -> None:
        if ticket is not None:
            self._leave(ticket)

    def _leave(self, ticket: int) -> None:
        self._executor.handle(core.AdmitLeft(ticket, self.capacity(), self.limits))

    # -- the core's admission commands, as the executor carries them out ---------------------------
    def start(self, ticket: int) -> None:
        """``core.StartRequest``: the waiter of ``ticket`` goes on (one already gone gives the slot back)."""
        fut = self._waiters.get(ticket)
        if fut is None or fut.done():
            self._leave(ticket)
        else:
            fut.set_result(ticket)

    def refuse(self, ticket: int, why: str, retry_after_s: int) -> None:
        """``core.RefuseRequest``: the waiter of ``ticket`` is refused with ``QueueFull``."""
        fut = self._waiters.get(ticket)
        if fut is not None and not fut.done():
            fut.set_exception(QueueFull(why, retry_after_s))

    def _adopt_own(self, state: ClusterState, events: tuple) -> None:
        self._own = state
