"""Admission control: which requests run now, which wait, which are turned away.

At most ``max_active`` sequences run, and their KV must fit what the workers' budgets hold:
a stage keeps one row per sequence, each as long as the longest, so a request is admitted
while ``(running + 1) x max(longest running, its own prompt + max_tokens)`` fits in
``capacity()`` KV positions (None: unbounded). One request always runs alone, so a request the
plan can hold at all is never starved. The next ``max_queue`` wait in arrival order; beyond
that the API answers 429 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from .errors import APIError


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
            raise APIError(429, f"server busy: {self.active} requests running and {len(self._waiting)} queued; retry later",
                           type_="rate_limit_error", code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
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
