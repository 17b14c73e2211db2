"""Admission control: at most ``limit`` sequences run (``max_active``, lowered to what the
workers' KV budgets hold at full context); the next ``max_queue`` wait their turn in arrival
order; beyond that the API answers 429 with ``Retry-After``."""

from __future__ import annotations

import asyncio
from collections import deque

from .errors import APIError


class Admission:
    def __init__(self, max_active: int = 16, max_queue: int = 64, retry_after_s: int = 1, capacity=lambda: None):
        self.max_active, self.max_queue, self.retry_after_s = max_active, max_queue, retry_after_s
        self.capacity = capacity  # () -> sequences the workers' KV budgets hold, or None
        self.active = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def limit(self) -> int:
        cap = self.capacity()
        return self.max_active if cap is None else max(1, min(self.max_active, cap))

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def admit(self) -> object:
        if self.active < self.limit and not self._waiting:
            self.active += 1
            return object()
        if len(self._waiting) >= self.max_queue:
            raise APIError(429, f"server busy: {self.active} requests running and {len(self._waiting)} queued; retry later",
                           type_="rate_limit_error", code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self._waiting:
                self._waiting.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release(None)  # we were handed a slot as we left
            raise
        return object()

    def release(self, ticket: object) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next in line
                return
        self.active -= 1
