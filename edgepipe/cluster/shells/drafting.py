"""The coordinator's drafter workers (I/O): load the draft model on each that joins, hear their
answers, drop the ones that leave.

On joining, a drafter worker is sent the draft package's files (``DRAFT_LOAD``: the whole draft
model's graph, its head stating its sampler's distribution, and weights, fetched from
``/v1/blobs/`` like a stage's) and answers with the measured time of a draft step; it is then
offered to the ``draft_placement.PlacedDrafter`` as a site. Each change of site is a dashboard
line (``NoteKind.DRAFT_SITE``).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ...net.messages import DraftLoad, Drafted, DraftReady
from ..state import state as S
from .draft_placement import PlacedDrafter
from .drafters import DrafterLost, RemoteDrafter
from .ports import Ports

LOAD_TIMEOUT_S = 600.0  # fetching and building the draft model (a first fetch of ~1 GB)


class Drafting:
    """Given the coordinator's ``Ports``, the ``PlacedDrafter`` it feeds, the drafting thread's
    ``pool`` (this process's draft step is timed there) and ``on_moved`` (the drafts now run
    elsewhere: ``Speculation.drafter_moved``, their costs are measured afresh)."""

    def __init__(self, ports: Ports, placed: PlacedDrafter, pool, on_moved: Callable[[], None]):
        self.ports, self.placed, self.pool, self.on_moved = ports, placed, pool, on_moved
        self.loading: dict[str, asyncio.Future] = {}  # drafter worker -> its DRAFT_READY awaited (handles only)
        self.loop: asyncio.AbstractEventLoop | None = None
        placed.on_move = self._moved

    def _moved(self, site: str, why: str) -> None:
        """A dashboard line for a change of site (it may be decided on the drafting thread)."""
        self.on_moved()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(lambda: self.ports.note(S.NoteKind.DRAFT_SITE, site=site, why=why))

    def blob(self, sha: str):
        """A file of the draft package (drafter workers fetch it like a stage's), or None."""
        path = self.placed.package.blob(sha)
        return path if path.is_file() else None

    async def attach(self, wid: str, link) -> None:
        """Load the draft model on a drafter worker that joined, and offer it as a site."""
        p, package = self.ports, self.placed.package
        loop = self.loop = asyncio.get_running_loop()
        m = package.manifest
        graph = await loop.run_in_executor(None, lambda: package.stage_graph(0, len(m.units), sampler=True))
        fut = self.loading[wid] = loop.create_future()
        await link.send(DraftLoad(package.name, graph, list(m.stage_files(0, len(m.units))), m.max_context).to_message())
        p.note(S.NoteKind.DRAFTER, worker=wid, status="loading", model=package.name)
        try:
            ready: DraftReady = await asyncio.wait_for(fut, LOAD_TIMEOUT_S)
        except (asyncio.TimeoutError, DrafterLost) as exc:
            p.note(S.NoteKind.DRAFTER, worker=wid, status="failed", reason=str(exc) or "no answer")
            return
        finally:
            self.loading.pop(wid, None)
        if not ready.ok or ready.step_s is None:
            p.note(S.NoteKind.DRAFTER, worker=wid, status="failed", reason=ready.error or "no step time")
            return
        await loop.run_in_executor(self.pool, self.placed.calibrate)  # this process's draft step, on the drafting thread
        if wid not in p.links():  # it left while we timed
            return
        p.note(S.NoteKind.DRAFTER, worker=wid, status="ready", step_ms=round(ready.step_s * 1e3, 2),
                coordinator_step_ms=round(self.placed.local_step_s * 1e3, 2))
        info = p.state().workers.get(wid)
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
