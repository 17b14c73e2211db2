"""Where the draft model runs (I/O): the coordinator's own process, or a drafter worker.

A worker started with ``--role drafter`` holds no stage (``deploy.plannable`` leaves it out). On
joining it is sent the draft package's files (``DRAFT_LOAD``: the whole draft model's graph, its
head stating its sampler's distribution, and weights, fetched from ``/v1/blobs/`` like a
stage's) and answers with the measured time of a draft step. ``plan.draft_site`` then decides
from those measurements (its step time and round trip against the coordinator's own draft step)
where drafts are made, and :class:`PlacedDrafter` sends them there: a drafter worker is asked
over the control channel (``DRAFT`` / ``DRAFTED``) from the drafting thread, which waits for its
answer. A drafter that fails, times out or leaves is dropped, and the pass drafts in the
coordinator's process instead: drafts never change which tokens a greedy request gets, and
a sampled one's drafts are drawn from the same model with the same draws, so no request is lost
or changed by the move.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout

import numpy as np

from ..net.messages import Draft, DraftLoad, Drafted, DraftReady, Drop
from ..plan.draft_site import COORDINATOR, DraftSite, choose_draft_site
from ..runtime.speculative import Distribution, ModelDrafter, common_prefix, time_draft_steps
from . import state as S

DRAFT_TIMEOUT_S = 5.0  # a drafter worker silent this long on a draft request is dropped
LOAD_TIMEOUT_S = 600.0  # fetching and building the draft model (a first fetch of ~1 GB)
UNKNOWN = "unknown sequence"  # the drafter lost the sequence's ids: send them from the start
RECHECK_EVERY = 64  # draft requests between looks at where the draft is cheapest


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


class PlacedDrafter:
    """The draft model where ``plan.draft_site`` says: this process's ``ModelDrafter`` (``local``,
    also the fallback) or one of the drafter workers. ``package``: the draft model's package (its
    files go to the drafter workers). ``on_move(site, why)`` hears every change of site."""

    def __init__(self, local: ModelDrafter, package, on_move=None):
        self.local, self.package, self.name = local, package, local.name
        self.remotes: dict[str, RemoteDrafter] = {}
        self.site = COORDINATOR
        self.local_step_s: float | None = None  # measured once a drafter worker offers to draft (calibration)
        self.on_move = on_move or (lambda site, why: None)
        self.remote_drafts = 0  # passes drafted by a drafter worker
        self.fallbacks = 0  # requests a drafter worker failed, drafted here instead
        self.pinned: str | None = None  # serve --draft-on: "coordinator" or "workers" (None: the cheapest)
        self._asked = 0

    @property
    def states_distributions(self) -> bool:
        return self.local.states_distributions

    def sites(self) -> list[DraftSite]:
        local = [DraftSite(COORDINATOR, self.local_step_s)] if self.local_step_s is not None else []
        return local + [r.site() for r in self.remotes.values() if not r.gone]

    def place(self, why: str) -> str:
        """Decide where drafts are made now (the drafting thread or the loop may call it)."""
        sites = self.sites()
        if self.pinned == COORDINATOR or not self.remotes:
            chosen = COORDINATOR
        elif self.pinned == "workers":
            live = sorted(s.id for s in sites if s.id != COORDINATOR)
            chosen = self.site if self.site in live else (choose_draft_site([s for s in sites if s.id != COORDINATOR], None) if live else COORDINATOR)
        else:
            chosen = choose_draft_site(sites, self.site) if sites else COORDINATOR
        if chosen != self.site:
            self.site = chosen
            self.on_move(chosen, why)
        return chosen

    def _with_fallback(self, call_remote, call_local):
        remote = self.remotes.get(self.site)
        if remote is not None:
            try:
                out = call_remote(remote)
                self.remote_drafts += 1
                self._asked += 1
                if self._asked % RECHECK_EVERY == 0 and self.pinned is None:
                    self.place("measured draft costs")
                return out
            except DrafterLost as exc:
                self.fallbacks += 1
                self.drop(remote.wid, str(exc))
        return call_local()

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        return self._with_fallback(lambda r: r.draft(seq, ids, k, params, step), lambda: self.local.draft(seq, ids, k, params, step))

    def draft_sampled(self, seq: str, ids: list[int], k: int, params, step: int = 0):
        return self._with_fallback(lambda r: r.draft_sampled(seq, ids, k, params, step),
                                   lambda: self.local.draft_sampled(seq, ids, k, params, step))

    def prime(self, seq: str, ids: list[int]) -> None:
        remote = self.remotes.get(self.site)
        if remote is None:
            return self.local.prime(seq, ids)
        try:
            remote.prime(seq, ids)
        except DrafterLost as exc:
            self.drop(remote.wid, str(exc))
            self.local.prime(seq, ids)

    def forget(self, seq: str) -> None:
        self.local.forget(seq)
        for remote in list(self.remotes.values()):
            remote.forget(seq)

    def calibrate(self) -> float:
        """Time this process's draft step once (on the drafting thread), as a drafter worker times its own."""
        if self.local_step_s is None:
            self.local_step_s = time_draft_steps(self.local)
        return self.local_step_s

    def add(self, remote: RemoteDrafter) -> None:
        self.remotes[remote.wid] = remote
        self.place(f"drafter {remote.wid} ready ({remote.step_s * 1e3:.1f} ms a draft step)")

    def drop(self, wid: str, why: str) -> None:
        remote = self.remotes.pop(wid, None)
        if remote is None:
            return
        remote.lost(why)
        if self.site == wid:
            self.site = COORDINATOR  # at once: the next pass must not wait on it
            self.on_move(COORDINATOR, why)
        self.place(why)


class Drafting:
    """The coordinator's drafter workers: load the draft model on each, hear their answers, and
    drop the ones that leave. ``coord``: the coordinator (``speculation``, ``spawn``, ``event``)."""

    def __init__(self, coord, placed: PlacedDrafter, pool):
        self.coord, self.placed, self.pool = coord, placed, pool
        self.loading: dict[str, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        placed.on_move = self._moved

    def _moved(self, site: str, why: str) -> None:
        """A dashboard line for a change of site (it may be decided on the drafting thread)."""
        self.coord.speculation.drafter_moved()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(lambda: self.coord.event(S.NoteKind.DRAFT_SITE, site=site, why=why))

    def blob(self, sha: str):
        """A file of the draft package (drafter workers fetch it like a stage's), or None."""
        path = self.placed.package.blob(sha)
        return path if path.is_file() else None

    async def attach(self, wid: str, link) -> None:
        """Load the draft model on a drafter worker that joined, and offer it as a site."""
        c, package = self.coord, self.placed.package
        loop = self.loop = asyncio.get_running_loop()
        m = package.manifest
        graph = await loop.run_in_executor(None, lambda: package.stage_graph(0, len(m.units), sampler=True))
        fut = self.loading[wid] = loop.create_future()
        await link.send(DraftLoad(package.name, graph, list(m.stage_files(0, len(m.units))), m.max_context).to_message())
        c.event(S.NoteKind.DRAFTER, worker=wid, status="loading", model=package.name)
        try:
            ready: DraftReady = await asyncio.wait_for(fut, LOAD_TIMEOUT_S)
        except (asyncio.TimeoutError, DrafterLost) as exc:
            c.event(S.NoteKind.DRAFTER, worker=wid, status="failed", reason=str(exc) or "no answer")
            return
        finally:
            self.loading.pop(wid, None)
        if not ready.ok or ready.step_s is None:
            c.event(S.NoteKind.DRAFTER, worker=wid, status="failed", reason=ready.error or "no step time")
            return
        await loop.run_in_executor(self.pool, self.placed.calibrate)  # this process's draft step, on the drafting thread
        if wid not in c.links:  # it left while we timed
            return
        c.event(S.NoteKind.DRAFTER, worker=wid, status="ready", step_ms=round(ready.step_s * 1e3, 2),
                coordinator_step_ms=round(self.placed.local_step_s * 1e3, 2))
        info = c.cluster.workers.get(wid)
        self.placed.add(RemoteDrafter(wid, link.send, loop, ready.step_s, (info.rtt_s or 0.0) if info else 0.0))

    def answered(self, wid: str, typed) -> None:
        if isinstance(typed, DraftReady):
            fut = self.loading.get(wid)
            if fut is not None and not fut.done():
                fut.set_result(typed)
        elif isinstance(typed, Drafted):
            remote = self.placed.remotes.get(wid)
            if remote is not None:
                remote.answered(typed)

    def lost(self, wid: str, why: str) -> None:
        fut = self.loading.pop(wid, None)
        if fut is not None and not fut.done():
            fut.set_exception(DrafterLost(f"drafter {wid} {why}"))
        self.placed.drop(wid, f"drafter {wid} {why}")

    def view(self) -> dict:
        p = self.placed
        return {"site": p.site, "pinned": p.pinned, "coordinator_step_ms": None if p.local_step_s is None else round(p.local_step_s * 1e3, 2),
                "remote_drafts": p.remote_drafts, "fallbacks": p.fallbacks,
                "workers": {wid: {"step_ms": round(s.step_s * 1e3, 2), "round_trip_ms": round(s.call_s * 1e3, 2)}
                            for wid, s in ((r.wid, r.site()) for r in p.remotes.values())}}
