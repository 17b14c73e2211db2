"""A drafter worker's draft model (``edgepipe worker --role drafter``): a device that holds no
stage and drafts for a speculative coordinator beside the pipeline.

``DRAFT_LOAD`` names the draft model's graph and weight files; they are fetched into the blob
cache like a stage's (content-addressed, hash-checked), built whole into one runner, and a few
draft steps are timed (as calibration times a stage) for the coordinator's choice of where the
draft runs. ``DRAFT`` asks for ``k`` drafts after a sequence's ids (``runtime.speculative.ModelDrafter``
keeps each sequence's KV between requests and rewinds what the target rejected); ``DROP``
forgets a sequence. Compute runs on one thread of its own, in arrival order, so the event loop
keeps answering heartbeats. Needs only onnxruntime and numpy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..emulate.slowdown import SlowdownPolicy
from dataclasses import replace

from ..net.messages import Draft, Drafted, DraftLoad, DraftReady
from ..runtime.sequence import GenerationParams
from ..runtime.speculative import ModelDrafter, time_draft_steps

log = logging.getLogger("edgepipe.worker")
UNKNOWN = "unknown sequence"  # a Drafted error the coordinator answers by sending the ids from the start


class DrafterRole:
    """The draft model of one drafter worker. ``fetch(sha) -> bytes downloaded`` and ``path(sha)``
    are the worker's blob cache; ``send(message)`` its control channel."""

    def __init__(self, fetch, path, send, threads: int | None, slowdown: float = 1.0):
        self.fetch, self.path, self.send = fetch, path, send
        self.threads, self.slowdown = threads, slowdown
        self.drafter: ModelDrafter | None = None
        self.ids: dict[str, list[int]] = {}  # per sequence: the ids sent so far
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="draft")

    async def load(self, load: DraftLoad) -> None:
        loop, t0 = asyncio.get_running_loop(), time.perf_counter()
        try:
            fetched = 0
            for sha in [load.graph, *load.files]:
                fetched += await loop.run_in_executor(None, self.fetch, sha)
            step_s = await loop.run_in_executor(self.pool, self._build, load)
        except Exception as exc:  # noqa: BLE001 - a failed load is reported, the worker stays
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("draft model %s: %s", load.name, text)
            return await self.send(DraftReady(False, load.name, error=text[:200]).to_message())
        log.info("draft model %s ready: %.1f ms a draft step (%d bytes downloaded)", load.name, step_s * 1e3, fetched)
        await self.send(DraftReady(True, load.name, step_s, time.perf_counter() - t0, fetched).to_message())

    def _build(self, load: DraftLoad) -> float:
        from ..runtime.stage_runner import StageRunner

        runner = StageRunner(self.path(load.graph), threads=self.threads, max_context=load.max_context)
        self.drafter, self.ids = ModelDrafter(runner, load.name), {}
        return time_draft_steps(self.drafter, int(load.reps or 8)) * SlowdownPolicy(self.slowdown).factor

    async def draft(self, draft: Draft, ids) -> None:
        try:
            reply, cpu_s = await asyncio.get_running_loop().run_in_executor(self.pool, self._draft, draft, ids)
        except Exception as exc:  # noqa: BLE001 - a failed draft is answered: the coordinator drafts elsewhere
            reply, cpu_s = Drafted(draft.id, False, error=(str(exc).splitlines() or [type(exc).__name__])[0][:200]), None
        cpu_s = cpu_s if self.threads == 1 else None  # thread time counts one thread's compute only
        extra = SlowdownPolicy(self.slowdown).extra_wait(reply.compute_s or 0.0, cpu_s)
        if extra > 0:  # EMULATION: a weaker device
            await asyncio.sleep(extra)
            reply = replace(reply, compute_s=(reply.compute_s or 0.0) + extra)
        await self.send(reply.to_message())

    def _draft(self, draft: Draft, ids) -> tuple[Drafted, float | None]:
        """The answer to ``draft`` and the CPU seconds it took (None: no draft ran)."""
        if self.drafter is None:
            return Drafted(draft.id, False, error="no draft model loaded"), None
        held = self.ids.get(draft.seq)
        if draft.keep and (held is None or len(held) < draft.keep):
            return Drafted(draft.id, False, error=UNKNOWN), None
        new = [] if ids is None else [int(t) for t in np.asarray(ids).reshape(-1)]
        all_ids = (held or [])[:draft.keep] + new
        self.ids[draft.seq] = all_ids
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if draft.k == 0:
            self.drafter.prime(draft.seq, all_ids)
            return Drafted(draft.id, True, [], compute_s=time.perf_counter() - t0), time.thread_time() - cpu0
        params = None
        if draft.sampling is not None:
            s = draft.sampling
            params = GenerationParams(temperature=float(s["temperature"]), top_k=int(s["top_k"]), top_p=float(s["top_p"]), seed=int(s["seed"]),
                                      min_p=float(s.get("min_p") or 0.0))
        q_ids = q_probs = None
        if draft.rule:
            tokens, q = self.drafter.draft_sampled(draft.seq, all_ids, draft.k, params, draft.step)
            q_ids, q_probs = [[int(t) for t in d.ids] for d in q], [[float(w) for w in d.weights / d.total] for d in q]
        else:
            tokens = self.drafter.draft(draft.seq, all_ids, draft.k, params, draft.step)
        return (Drafted(draft.id, True, [int(t) for t in tokens], q_ids, q_probs, time.perf_counter() - t0),
                time.thread_time() - cpu0)

    async def forget(self, seq: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self._forget, seq)  # after the drafts asked before it

    def _forget(self, seq: str) -> None:
        self.ids.pop(seq, None)
        if self.drafter is not None:
            self.drafter.forget(seq)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
