"""Scheduling decisions: which requests run (admission), how long one may wait for the cluster.

Admission: at most ``max_active`` sequences run, and their KV must fit what the workers'
budgets hold: a stage keeps one row per sequence, each as long as the longest, so a request is
admitted while ``(running + 1) x max(longest running, its own prompt + max_tokens)`` fits in
``capacity()`` KV positions (None: unbounded). One request always runs alone, so a request the
plan can hold at all is never starved. The next ``max_queue`` wait in arrival order; beyond
that :class:`QueueFull` (the API turns it into a 429 with ``Retry-After``).

Waiting for Up: a request whose cluster is not Up waits, but not forever (``wait_verdict``):
when the connected workers cannot hold the model at all it fails after ``capacity_wait_s``
with one line saying what they hold and what the model needs; otherwise after ``max_wait_s``.
The micro-batch lanes are in ``batching``; replay (rebuilding a sequence's KV) in ``requests``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass

from .state import ClusterState, Phase


class AdmissionError(RuntimeError):
    """A request cannot be admitted now (``retry_after_s``: when to try again)."""

    def __init__(self, message: str, retry_after_s: int = 1, code: str = "queue_full"):
        super().__init__(message)
        self.retry_after_s, self.code = retry_after_s, code


class QueueFull(AdmissionError):
    pass


class Admission:
    def __init__(self, max_active: int = 16, max_queue: int = 64, retry_after_s: int = 1, capacity=lambda: None):
        self.max_active, self.max_queue, self.retry_after_s = max_active, max_queue, retry_after_s
        self.capacity = capacity  # () -> KV positions the workers' budgets hold, or None
        self.running: dict[int, int] = {}  # ticket -> KV positions it may grow to
        self._waiting: deque[tuple[asyncio.Future, int]] = deque()
        self._tickets = itertools.count(1)

    @property
    def active(self) -> int:
        return len(self.running)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def limit(self) -> int:
        """Sequences that could run at once if each grew to the longest running one."""
        cap = self.capacity()
        if cap is None or not self.running:
            return self.max_active
        return max(1, min(self.max_active, cap // max(self.running.values())))

    def fits(self, positions: int) -> bool:
        if not self.running:
            return True
        if len(self.running) >= self.max_active:
            return False
        cap = self.capacity()
        return cap is None or (len(self.running) + 1) * max(positions, *self.running.values()) <= cap

    async def admit(self, positions: int = 0) -> int:
        """Wait for a slot for a request whose KV may grow to ``positions``; returns its ticket."""
        if not self._waiting and self.fits(positions):
            return self._start(positions)
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"server busy: {self.active} requests running and {len(self._waiting)} queued; retry later",
                            self.retry_after_s)
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, positions)
        self._waiting.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(fut.result())  # we were handed a slot as we left
            raise

    def release(self, ticket: int | None) -> None:
        self.running.pop(ticket, None)
        while self._waiting:  # in arrival order: the head goes first, or nobody does
            fut, positions = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self.fits(positions):
                return
            self._waiting.popleft()
            fut.set_result(self._start(positions))

    def _start(self, positions: int) -> int:
        ticket = next(self._tickets)
        self.running[ticket] = positions
        return ticket


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
