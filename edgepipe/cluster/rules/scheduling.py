"""Scheduling decisions: which requests run (admission), how long one may wait for the cluster.

Admission: at most ``max_active`` sequences run, and their KV must fit what the workers'
budgets hold; the next ``max_queue`` wait in arrival order; beyond that :class:`QueueFull` (the
API turns it into a 429 with ``Retry-After``). The rule and the book of tickets are state
(``admission_book``, ``ClusterState.admission``), the decision is ``core.handle`` (``AdmitAsked``, ``AdmitLeft``);
:class:`Admission` is its shell, keeping only the futures of the requests in line.

Waiting for Up: a request whose cluster is not Up waits, but not forever (``wait_verdict``):
when the connected workers cannot hold the model at all it fails after ``capacity_wait_s``
with one line saying what they hold and what the model needs; otherwise after ``max_wait_s``.
The micro-batch lanes are in ``batching``; replay (rebuilding a sequence's KV) in ``requests``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Callable, Mapping

from ..state import admission_book as AB
from . import core  # core imports this module too: its names are read at call time
from ..state.state import ClusterState, Phase, apply


class AdmissionError(RuntimeError):
    """A request cannot be admitted now (``retry_after_s``: when to try again)."""

    def __init__(self, message: str, retry_after_s: int = 1, code: str = "queue_full"):
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code


class QueueFull(AdmissionError):
    pass


class Admission:
    """The admission shell: asks ``core.handle`` and carries out its commands; the futures of
    the requests waiting in line are the only thing it keeps. The book itself (who runs, who
    waits) is ``ClusterState.admission``: the coordinator's once bound to it (``bind``: its events
    go through the coordinator's ``emit``, so they are logged), a state of its own before."""

    def __init__(self, max_active: int = 16, max_queue: int = 64, retry_after_s: int = 1, capacity=lambda: None):
        self.limits = AB.Limits(max_active, max_queue, retry_after_s)
        self.capacity = capacity  # () -> KV positions the workers' budgets hold, or None
        self._own = ClusterState()
        self._state: Callable[[], ClusterState] = lambda: self._own
        self._emit: Callable[[object], object] = self._apply_own
        self._waiters: dict[int, asyncio.Future] = {}  # ticket -> the future its caller awaits, while it waits in line
        self._tickets = itertools.count(1)

    def bind(self, coordinator) -> None:
        """Keep the book in ``coordinator``'s state (before any request is admitted)."""
        self._state, self._emit = (lambda: coordinator.cluster), coordinator.emit
        self.capacity = lambda: coordinator.kv_capacity

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
            self._carry(core.handle(self._state(), core.AdmitAsked(ticket, positions, self.capacity(), self.limits), core.Config()))
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
        self._carry(core.handle(self._state(), core.AdmitLeft(ticket, self.capacity(), self.limits), core.Config()))

    def _carry(self, handled) -> None:
        for event in handled.events:
            self._emit(event)
        for command in handled.commands:
            match command:
                case core.StartRequest(ticket):
                    fut = self._waiters.get(ticket)
                    if fut is None or fut.done():  # its caller is gone: the slot goes back
                        self._leave(ticket)
                    else:
                        fut.set_result(ticket)
                case core.RefuseRequest(_, why, retry_after_s):
                    raise QueueFull(why, retry_after_s)

    def _apply_own(self, event) -> None:
        self._own = apply(self._own, event)


# -- waiting for the cluster ----------------------------------------------------------------------
@dataclass(frozen=True)
class WaitSettings:
    capacity_wait_s: float = 30.0  # the connected workers cannot hold the model: fail after this
    max_wait_s: float = 300.0  # not Up for any other reason: fail after this


def shortfall(state: ClusterState, weight_bytes: int, kv_bytes: int, overhead_bytes: int, now: float | None = None) -> str | None:
    """One line saying why the connected workers cannot hold the model, or None if they may.

    A plan needs the weights, the KV room every stage keeps (``kv_bytes`` over all layers) and
    each worker's runtime overhead; only declared budgets are counted (see below). Workers a plan
    may not use at ``now`` (suspected, quarantined) hold nothing for it."""
    workers = state.live(now)
    if not workers:
        benched = len(state.workers)
        return f"no usable workers: {benched} connected, all suspected or quarantined" if benched else "no workers are connected"
    budget = [w for w in workers if w.hello.memory_budget]
    if len(budget) < len(workers):  # a worker without a declared budget is bounded by its host's RAM: assume it fits
        return None
    held = sum(max(0, w.memory_bytes - overhead_bytes) for w in workers)
    if held >= weight_bytes + kv_bytes:
        return None
    benched = len(state.workers) - len(workers)
    return (f"not enough memory: the {len(workers)} connected worker(s){f' ({benched} more suspected or quarantined)' if benched else ''} "
            f"hold {held / 1e6:.0f} MB for the model, "
            f"it needs {(weight_bytes + kv_bytes) / 1e6:.0f} MB ({weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.0f} MB KV room)")


def wait_verdict(state: ClusterState, waited_s: float, lacking: str | None, settings: WaitSettings) -> str | None:
    """None to keep waiting for Up, or the one-line reason the request fails now."""
    if state.phase is Phase.UP and state.active is not None:
        return None
    if lacking is not None and waited_s >= settings.capacity_wait_s:
        return f"cluster lacks capacity after waiting {waited_s:.0f} s: {lacking}"
    if waited_s >= settings.max_wait_s:
        why = f": {state.last_failure}" if state.last_failure else ""
        return f"cluster not up after waiting {waited_s:.0f} s{why}"
    return None


@dataclass(frozen=True)
class NextFeed:
    """What a sequence's next step feeds, and on which footing (``next_feed``)."""

    fed_plan: int | None  # the plan whose workers hold its KV once this step is fed
    new_epoch: bool  # its KV on the old plan is void: drop it there and replay under a new sequence id
    feed: list[int]  # the token ids to send
    replay_from: int | None  # a replay: positions before this go as one prefill frame, the rest one by one


def next_feed(fed_plan: int | None, active_plan: int, moved_to: int | None, prompt_ids: list[int], generated: list[int]) -> NextFeed:
    """Resume or replay: where the sequence's KV was last fed (``fed_plan``; -1 after a broken
    step, None before the first), the active plan, and where a KV move brought it (``moved_to``).

    On the plan that holds its KV, or the one its KV moved to with its layers, it resumes with the
    last token; on any other plan it replays every token so far (the prompt as a prefill, each
    generated token as a decode step, so the rebuilt KV is exactly the one it had)."""
    if fed_plan != active_plan and moved_to == active_plan:
        fed_plan = active_plan  # its KV moved with its layers: carry on
    if fed_plan == active_plan:
        return NextFeed(fed_plan, False, generated[-1:], None)
    feed = prompt_ids + generated
    return NextFeed(fed_plan, fed_plan is not None, feed, len(prompt_ids) if len(feed) > len(prompt_ids) else None)
