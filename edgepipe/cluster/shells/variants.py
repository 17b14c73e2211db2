"""Weight variants built as stages need them (I/O around a few pure rules): a tab's fp32 units, unit by unit, within a disk budget.

A tab on WebAssembly asks for the ``fp32`` variant. Built whole at its join, that took two minutes
on a 1.5B model (the tab waiting at "connecting…") and grew the package from 1.5 to 9.2 GB, for a
tab that holds a few units. Here a variant is built only for the units a LOAD sends a worker (a
calibration probe's range, a plan's stage: ``Variants.ensure``, awaited just before the LOAD), so
the worker is welcomed at once and calibrated while its units are built. The planner sizes such a
worker's stage in its variant (``ClusterProfile.model_profile``, with ``importer.estimated_weight_bytes``
for units not built yet), so the units a tab may be given are bounded by the memory it declared.

What the variants add to the package is counted against ``CoordinatorSettings.variant_disk_bytes``
(``budget_problem``: a build that would exceed it, or the free disk, is refused with one line). The
forms of the file's own model (``gguf``, ``native``) are not counted: they are the model itself, added
whole (``add_form``). A build says what it does: a ``Notice`` to the worker waiting for it (its page
shows it), a dashboard line when it starts and when it ends, and ``on_progress`` (``serve``: one
terminal line).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ...net.channel import ChannelClosed
from ...net.messages import Notice
from ..rules import deploy
from ..state import state as S
from ..rules.variant_rules import _mb, _span, budget_problem, estimated_bytes, missing_units
from .ports import Ports

log = logging.getLogger("edgepipe.coordinator")


class VariantRefused(ValueError):
    """A variant build refused: it would exceed the disk budget (or the free disk)."""


class BuildStopped(RuntimeError):
    """A build ended between two units because the coordinator stops."""


# -- the shell ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildProgress:
    """Where a variant build stands (``Variants.on_progress`` receives one per unit, and at the end)."""

    precision: str
    units: tuple[int, ...]
    worker: str | None  # the worker whose LOAD waits for it
    done: int
    estimated_bytes: int
    seconds: float
    status: str = "building"  # "building" | "ready" | "failed"
    error: str | None = None

    def line(self) -> str:
        head = f"{self.precision} variant of {_span(self.units)}" + (f" for {self.worker}" if self.worker else "")
        if self.status == "ready":
            return f"{head}: built ({len(self.units)} units, ~{_mb(self.estimated_bytes)}, {self.seconds:.1f} s)"
        if self.status == "failed":
            return f"{head}: failed ({self.error})"
        return f"building the {head}: {self.done}/{len(self.units)} units (~{_mb(self.estimated_bytes)}, {self.seconds:.0f} s)"


def log_progress(progress: BuildProgress) -> None:
    """The default ``on_progress``: one log line when a build ends (serve draws its own line)."""
    if progress.status != "building":
        log.info("%s", progress.line())


class Variants:
    """Builds the variants workers ask for (one build at a time, ``add_variant`` in an executor)."""

    def __init__(self, ports: Ports, on_progress: Callable[[BuildProgress], None] = log_progress):
        self.ports = ports
        self.on_progress = on_progress
        self._lock = asyncio.Lock()

    def refusal(self, precision: str, start: int, end: int) -> str | None:
        """Why ``[start, end)`` of ``precision`` could not be built now (None: it could, or needs nothing)."""
        p = self.ports
        missing = missing_units(p.package.manifest, precision, start, end)
        return budget_problem(p.package.manifest, precision, missing, p.settings.variant_disk_bytes, self._free()) if missing else None

    async def ensure(self, precision: str | None, start: int, end: int, worker_id: str | None = None) -> None:
        """Build ``precision``'s variant for the units of ``[start, end)`` that lack it, before a
        LOAD of that range (``VariantRefused``: over the budget; the worker is told either way)."""
        if missing_units(self.ports.package.manifest, precision, start, end):
            # its own task: a waiter cancelled (its worker left) leaves the build to finish and the
            # manifest to be re-read, never a half-noted build or two builds writing the package at once
            task = self.ports.spawn(self._ensure(precision, start, end, worker_id))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a refusal nobody waits for any more is no traceback
            await asyncio.shield(task)

    async def _ensure(self, precision: str, start: int, end: int, worker_id: str | None) -> None:
        p = self.ports
        async with self._lock:  # one build at a time; the one before may have built these units
            manifest = p.package.manifest
            missing = missing_units(manifest, precision, start, end)
            if not missing:
                return
            problem = budget_problem(manifest, precision, missing, p.settings.variant_disk_bytes, self._free())
            if problem:
                p.note(S.NoteKind.VARIANT, precision=precision, status="refused", units=list(missing), worker=worker_id, reason=problem)
                await self._tell(worker_id, f"the coordinator refused to build this stage: {problem}")
                raise VariantRefused(problem)
            await self._build(precision, missing, worker_id, estimated_bytes(manifest, precision, missing))

    async def add_form(self, precision: str) -> None:
        """The whole ``precision`` variant: a form of the file's own model a native worker runs
        (``deploy.form_to_add``), added at its join; not counted against the budget when it is one."""
        from ...model.weights import PRECISIONS

        p = self.ports
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        async with self._lock:
            if all(precision in u.variants for u in p.package.manifest.units):
                return
            if precision == deploy.KERNEL_FORM:  # offered only where this machine's own library builds and loads
                from ...native import native_library

                library = await asyncio.get_running_loop().run_in_executor(None, native_library)
                if library.path is None:
                    raise RuntimeError(f"the coordinator has no GGUF kernel library: {library.reason}")
            manifest = p.package.manifest
            missing = tuple(u.index for u in manifest.units if precision not in u.variants)
            await self._build(precision, missing, None, estimated_bytes(manifest, precision, missing))

    async def _build(self, precision: str, units: tuple[int, ...], worker_id: str | None, estimate: int) -> None:
        from ...model.importer import add_variant

        p, loop, t0 = self.ports, asyncio.get_running_loop(), time.monotonic()
        p.note(S.NoteKind.VARIANT, precision=precision, status="building", units=list(units), worker=worker_id, estimated_bytes=estimate)

        def report(done: int) -> None:  # on the loop
            progress = BuildProgress(precision, units, worker_id, done, estimate, time.monotonic() - t0)
            self.on_progress(progress)
            p.spawn(self._tell(worker_id, progress.line(), done, len(units)))

        stop = threading.Event()  # set when the build's task is cancelled (the coordinator stops): it ends after the unit under way

        def from_thread(phase: str, done: int, total: int) -> None:
            if stop.is_set():
                raise BuildStopped(f"the {precision} build stopped after {done} of {total} units")
            if phase == "build":
                loop.call_soon_threadsafe(report, done)

        report(0)
        try:
            await loop.run_in_executor(None, lambda: add_variant(p.package.root, precision, from_thread, units))
        except asyncio.CancelledError:
            stop.set()  # add_variant removes what it wrote; the package stays as it was
            raise
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.on_progress(BuildProgress(precision, units, worker_id, 0, estimate, time.monotonic() - t0, "failed", why))
            p.note(S.NoteKind.VARIANT, precision=precision, status="failed", units=list(units), worker=worker_id, reason=why)
            raise
        p.package.reload()
        p.profile.manifest = p.package.manifest  # the coordinator reads ``package.manifest`` too
        done = BuildProgress(precision, units, worker_id, len(units), estimate, time.monotonic() - t0, "ready")
        self.on_progress(done)
        p.note(S.NoteKind.VARIANT, precision=precision, status="ready", units=list(units), worker=worker_id,
               seconds=round(done.seconds, 2))
        await self._tell(worker_id, f"{done.line()}; loading the stage", len(units), len(units))

    async def _tell(self, worker_id: str | None, text: str, done: int | None = None, total: int | None = None) -> None:
        """A ``Notice`` to the worker, if it is still connected (it may have left meanwhile: no matter)."""
        if worker_id is None or worker_id not in self.ports.links():
            return
        try:
            await self.ports.send(worker_id, Notice(text, done, total).to_message())
        except (ChannelClosed, KeyError):
            pass

    def _free(self) -> int | None:
        try:
            return shutil.disk_usage(self.ports.package.root).free
        except (OSError, AttributeError):  # no package directory (the simulation's)
            return None
