"""A drafter worker as a ``runtime.speculative.Drafter`` (I/O, on the drafting thread).

A worker started with ``--role drafter`` holds no stage (``deploy.plannable`` leaves it out); it
is given the whole draft model (``drafting``) and asked for drafts over the control channel
(``DRAFT`` / ``DRAFTED``). :class:`RemoteDrafter` is one such worker seen from the drafting
thread: it sends a request on the coordinator's loop and waits for the answer, keeps per
sequence the ids the worker holds (sending only what is new), and measures the worker's draft
step and the round trip. A drafter that fails, times out or leaves raises ``DrafterLost``; where
drafts are made then is ``draft_placement``'s concern.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout

import numpy as np

from ...net.messages import Draft, Drafted, Drop
from ...plan.draft_site import DraftSite
from ...runtime.speculative import Distribution, common_prefix

DRAFT_TIMEOUT_S = 5.0  # a drafter worker silent this long on a draft request is dropped
UNKNOWN = "unknown sequence"  # the drafter lost the sequence's ids: send them from the start


class DrafterLost(RuntimeError):
    """A drafter worker did not answer a draft request (gone, failed, or too slow)."""


class RemoteDrafter:
    """One drafter worker as a ``runtime.speculative.Drafter``. Its methods run on the drafting
    thread and wait for the answer; ``send(message)`` is a coroutine run on the coordinator's loop."""

    def __init__(self, wid: str, send, loop: asyncio.AbstractEventLoop, step_s: float, rtt_s: float = 0.0,
                 timeout_s: float = DRAFT_TIMEOUT_S):
        self.wid, self.send, self.loop, self.timeout_s = wid, send, loop, timeout_s
        self.step_s = step_s  # measured by the worker when it loaded the model
        self.rtt_s = rtt_s  # its heartbeat round trip: a draft request's until one is measured
        self.round_trips: deque[float] = deque(maxlen=64)  # seconds a request waited beyond the worker's compute
        self.steps: deque[float] = deque(maxlen=64)  # the worker's seconds per draft step, as it answers
        self.sent: dict[str, list[int]] = {}  # per sequence: the ids it holds
        self.pending: dict[int, Future] = {}
        self.answered_count = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.gone = False

    def site(self) -> DraftSite:
        """Its measured figures for ``plan.draft_site``."""
        step_s = statistics.median(self.steps) if self.steps else self.step_s
        call_s = statistics.median(self.round_trips) if self.round_trips else self.rtt_s
        return DraftSite(self.wid, max(0.0, step_s), max(0.0, call_s))

    # -- the drafting thread ------------------------------------------------------------------
    def _ask(self, seq: str, ids: list[int], k: int, params, step: int, rule: bool) -> Drafted:
        if self.gone:
            raise DrafterLost(f"drafter {self.wid} is gone")
        held = self.sent.get(seq, [])
        keep = common_prefix(held, ids)
        answer = self._request(seq, ids, keep, k, params, step, rule)
        if not answer.ok and answer.error == UNKNOWN and keep:  # it lost the sequence (rejoined): everything again
            answer = self._request(seq, ids, 0, k, params, step, rule)
        if not answer.ok:
            self.sent.pop(seq, None)
            raise DrafterLost(f"drafter {self.wid}: {answer.error or 'failed'}")
        self.sent[seq] = list(ids)
        return answer

    def _request(self, seq, ids, keep, k, params, step, rule) -> Drafted:
        sampling = None
        if params is not None and not params.greedy:
            sampling = {"temperature": float(params.temperature), "top_k": int(params.top_k), "top_p": float(params.top_p),
                        "seed": int(params.seed)}
            if params.min_p:
                sampling["min_p"] = float(params.min_p)
        fut: Future = Future()
        with self._lock:
            rid = next(self._ids)
            self.pending[rid] = fut
        msg = Draft(rid, seq, keep, k, step, sampling, True if rule else None).to_message({"ids": np.asarray(ids[keep:], np.int32)})
        t0 = self.loop.time()
        asyncio.run_coroutine_threadsafe(self._send(rid, msg), self.loop)
        try:
            answer = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise DrafterLost(f"drafter {self.wid} did not answer within {self.timeout_s:.0f} s") from None
        finally:
            with self._lock:
                self.pending.pop(rid, None)
        if answer.ok and k > 0 and answer.compute_s is not None:
            self.round_trips.append(max(0.0, self.loop.time() - t0 - answer.compute_s))
            self.steps.append(answer.compute_s / k)
        return answer

    async def _send(self, rid: int, msg) -> None:
        try:
            await self.send(msg)
        except Exception as exc:  # noqa: BLE001 - a closed channel: the waiting thread hears it now, not at its timeout
            self._fail(rid, f"cannot send to drafter {self.wid}: {exc}")

    def _fail(self, rid: int, why: str) -> None:
        with self._lock:
            fut = self.pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(DrafterLost(why))

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        return list(self._ask(seq, ids, k, params, step, False).tokens or [])

    def draft_sampled(self, seq: str, ids: list[int], k: int, params, step: int = 0) -> tuple[list[int], list[Distribution]]:
        answer = self._ask(seq, ids, k, params, step, True)
        tokens = list(answer.tokens or [])
        if answer.q_ids is None or len(answer.q_ids) != len(tokens):
            raise DrafterLost(f"drafter {self.wid} sent rule drafts without their distributions")
        return tokens, [Distribution.of(i, p) for i, p in zip(answer.q_ids, answer.q_probs)]

    def prime(self, seq: str, ids: list[int]) -> None:
        self._ask(seq, ids, 0, None, 0, False)

    def forget(self, seq: str) -> None:
        if self.sent.pop(seq, None) is not None and not self.gone:
            asyncio.run_coroutine_threadsafe(self._quiet_send(Drop(seq).to_message()), self.loop)

    async def _quiet_send(self, msg) -> None:
        try:
            await self.send(msg)
        except Exception:  # noqa: BLE001 - a gone drafter forgets by itself
            pass

    # -- the coordinator's loop ---------------------------------------------------------------
    def answered(self, answer: Drafted) -> None:
        with self._lock:
            fut = self.pending.get(answer.id)
        if fut is not None and not fut.done():
            self.answered_count += 1
            fut.set_result(answer)

    def lost(self, why: str) -> None:
        self.gone = True
        with self._lock:
            pending, self.pending = list(self.pending.values()), {}
        for fut in pending:
            if not fut.done():
                fut.set_exception(DrafterLost(f"drafter {self.wid} {why}"))
