"""Calibrating joining workers: time two unit ranges (one batched too) and the uplink, one worker at a time.

Calibrations never run concurrently (a lock): on shared cores, timing two workers at once
measures their contention, not their speed. A round whose per-cost times spread too much
(``spread`` above ``STABLE_SPREAD``: something else ran meanwhile) is repeated, up to
``MAX_ROUNDS``; the steadiest round is kept. A worker that comes back with the same identity
reuses its calibration (``ClusterProfile.recall``).

Links between workers are measured in ``links`` (``LinkProber``), under the same lock. What it
decides (steadiness, which times to believe, a plan priced again) is pure, in ``calibration_rules``.

The first plan's stages are timed again on the ranges they will actually run, before it serves
(``time_stages``): the join calibration times one and four layers, while a stage holds the
embedding or the head too, whose cost relative to a layer differs between the importer and
the device. Each device's speed is set from its own range (repeated until steady) and the
plan's prediction is made again from those speeds; the first requests then refine them
(``ClusterProfile.step``).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping

from ...net.channel import ChannelClosed
from ...net.messages import CALIBRATION_PLANS, Activate, Probe
from ..rules import deploy
from ..state import measurements as M, state as S
from .links import LinkProber
from .ports import Ports
from .variants import Variants
from ..rules.calibration_rules import (MAX_ROUNDS, PROBE_REPS, ROW_PROBE, ROW_REPS, STABLE_SPREAD, STAGE_REPS, TRUST_RATIO,  # noqa: F401
                                busy, on_join, reprice, spread, trusted_step_times)

log = logging.getLogger("edgepipe.coordinator")

class Calibrator:
    """Calibrates joining workers and times a first plan's stages. It is given the coordinator's
    ``Ports`` and the plan policy with its context and the worker views (to price a plan again);
    which workers it holds is state (``WorkerInfo.calibrating``: ``busy``), its tasks are kept
    only as handles, to cancel when a worker is lost and to wait for when settling."""

    def __init__(self, ports: Ports, plan_fn, plan_context: Callable[[list], object], views: Callable[[], Mapping],
                 variants: Variants | None = None):
        self.ports = ports
        self.variants = variants or Variants(ports)  # a worker's variant, built for the units its probes load
        self.plan_fn, self.plan_context, self.views = plan_fn, plan_context, views
        self.lock = asyncio.Lock()  # one calibration at a time
        self._running: dict[str, asyncio.Task] = {}  # worker -> the task holding it (handles only: the ledger is the state)
        self._probes = 0
        self.links = LinkProber(ports, self.probe, self.lock)

    async def settled(self) -> None:
        pending = [t for t in self._running.values() if not t.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def joined(self, wid: str) -> None:
        p = self.ports
        info = p.state().workers[wid]
        step = on_join(p.settings.calibrate, info.identity in p.profile.known)
        if step is None:
            return
        if step == "recall":
            p.measure(M.Recalled(wid, info.identity))  # its dashboard line: narrate.entry
        p.emit(S.Calibrating(wid, True))
        self._running[wid] = p.spawn(self._holding(wid, step))

    async def _holding(self, wid: str, step: str) -> None:
        # The work's coroutine is made here, inside the task: made in ``joined`` and handed in,
        # it was never awaited when the task was cancelled before its first step (a worker lost
        # at once, a run torn down), and Python warned "coroutine ... was never awaited".
        try:
            await (self.links.probe_peers_locked(wid) if step == "recall" else self.calibrate(wid))
        finally:
            self.ports.emit(S.Calibrating(wid, False))

    def lost(self, wid: str) -> None:
        task = self._running.pop(wid, None)
        if task:
            task.cancel()

    async def probe(self, wid: str, **fields):
        self._probes += 1
        probe = self._probes
        return await self.ports.ask(wid, "probes", probe, Probe(probe, **fields).to_message(), self.ports.settings.load_timeout_s)

    async def probe_neighbours(self, stages) -> None:
        """After a deployment: planned neighbours measure the links nobody measured (``links``)."""
        await self.links.probe_neighbours(stages)

    # -- the first plan's own ranges ---------------------------------------------------------
    async def time_stages(self, dep):
        """Time each stage of the first deployment on its own range (one stage at a time,
        rounds repeated while their spread is above ``STABLE_SPREAD``), set each device's
        speed from it, and price the plan again (a ``Repriced`` event; the calibration-only
        figure is kept as ``calibrated_tpot_s``)."""
        p = self.ports
        if not p.settings.calibrate or p.state().ever_up or not dep.predicted:
            return dep
        timed = {}
        try:
            async with self.lock:
                for s in dep.stages:
                    cost = p.profile.unit_cost(s.start, s.end)
                    rounds = []
                    for _ in range(MAX_ROUNDS):
                        t0 = p.clock()
                        timing = await self.probe(s.worker_id, plan=dep.plan_id, reps=STAGE_REPS, context=32)
                        t1 = p.clock()
                        await self.probe(s.worker_id, plan=dep.plan_id, reps=2, context=32)
                        times, _ = trusted_step_times((timing.times or [])[2:], t1 - t0, p.clock() - t1, STAGE_REPS - 2)
                        if not times:
                            break
                        rounds.append((spread([(cost, t) for t in times]), times))
                        if rounds[-1][0] <= STABLE_SPREAD:
                            break
                    if rounds:
                        seconds = statistics.median(min(rounds, key=lambda r: r[0])[1])
                        p.measure(M.RangeTimed(s.worker_id, s.start, s.end, seconds))
                        timed[s.worker_id] = round(seconds * 1e3, 3)
        except (asyncio.TimeoutError, ChannelClosed, KeyError) as exc:
            p.note(S.NoteKind.STAGE_TIMING_FAILED, plan=dep.plan_id, error=str(exc) or type(exc).__name__)
            return dep
        repriced = reprice(self.plan_fn, self.plan_context, self.views(), p.profile, dep)
        if repriced:
            event = S.Repriced(dep.plan_id, {**dep.predicted, "calibrated_tpot_s": dep.predicted.get("tpot_s"), **repriced})
            p.emit(event)
            dep = replace(dep, predicted=dict(event.predicted))
        p.note(S.NoteKind.STAGES_TIMED, plan=dep.plan_id, step_ms=timed, tpot_ms=round(dep.predicted["tpot_s"] * 1e3, 3))
        p.replan_wanted.set()  # the speeds moved: the policy decides whether another plan is now better
        return dep

    @staticmethod
    def span(manifest) -> tuple[int, int]:
        """The units a calibration loads (its widest range: ``calibrate`` times one layer and four)."""
        layers = [u.index for u in manifest.units if u.kind == "layer"]
        return layers[0], layers[min(3, len(layers) - 1)] + 1

    async def _load_probe_plan(self, wid: str, start: int, end: int) -> int:
        p, state = self.ports, self.ports.state()
        precision = deploy.precision_of(state, wid, p.package.manifest, p.settings.precision)
        await self.variants.ensure(precision, start, end, wid)  # a tab's fp32 units, built now if not yet
        plan_id = CALIBRATION_PLANS - self._probes
        self._probes += 1
        msg = deploy.load_message(p.package, plan_id, start, end, deploy.stage_form(state, wid, p.package.manifest, p.settings),
                                  {"kind": "coordinator"}, keep=[])
        result = await p.load(wid, msg)
        if not result.ok:
            raise RuntimeError(result.error)
        return plan_id

    async def _release_probe_plan(self, wid: str) -> None:
        active = self.ports.state().active
        await self.ports.send(wid, Activate([plan for plan in ([active.plan_id] if active else []) if plan > 0]).to_message())

    async def _rows(self, wid: str, start: int, end: int) -> None:
        """Time ``[start, end)`` at 1 row and at ``ROW_PROBE`` rows stepped together: what a
        further row of a batched step costs (``ClusterProfile.rows_timed``). Not with the verify
        form (``--speculative``), whose decode steps attend on two positions and so run one
        sequence per call; a probe the worker could not run leaves the cost unmeasured."""
        if self.ports.settings.speculative:
            return
        plan_id = await self._load_probe_plan(wid, start, end)
        replies = [await self.probe(wid, plan=plan_id, reps=ROW_REPS, context=32, rows=rows) for rows in (1, ROW_PROBE)]
        if all(r.ok and len(r.times or ()) > 2 for r in replies):
            self.ports.measure(M.RowsTimed(wid, start, end, ROW_PROBE, *(statistics.median(r.times[2:]) for r in replies)))
        else:
            log.warning("worker %s: the batched timing probe failed (%s): its cost per further row stays unmeasured", wid,
                        next((r.error for r in replies if r.error), "no times"))
        await self._release_probe_plan(wid)

    async def _round(self, wid: str, ranges) -> list[tuple[float, float]]:
        p = self.ports
        samples = []
        for start, end in ranges:
            plan_id = await self._load_probe_plan(wid, start, end)
            t0 = p.clock()
            timing = await self.probe(wid, plan=plan_id, reps=PROBE_REPS, context=32)
            t1 = p.clock()
            await self.probe(wid, plan=plan_id, reps=2, context=32)
            times, overruled = trusted_step_times((timing.times or [])[2:], t1 - t0, p.clock() - t1, PROBE_REPS - 2)
            if overruled:
                # nor are its step timings believed from now on (its line: narrate.entry)
                p.measure(M.Distrusted(wid, (start, end), statistics.median(timing.times[2:]), times[0]))
            cost = p.profile.unit_cost(start, end)
            samples += [(cost, t) for t in times]
            await self._release_probe_plan(wid)
        return samples

    async def calibrate(self, wid: str) -> None:
        """Time a 1-layer and a 4-layer range, the 4-layer one batched too, and the uplink (000 §5:
        speed + per-call overhead; a batched step's cost per row)."""
        from .requests import PipelineBroken

        p = self.ports
        start, end = self.span(p.package.manifest)
        ranges = [(start, start + 1), (start, end)]
        try:
            async with self.lock:  # one at a time: calibrations must not share the CPU
                # its variant's units first (a tab's fp32), all at once: the build is not timed
                await self.variants.ensure(deploy.precision_of(p.state(), wid, p.package.manifest, p.settings.precision), start, end, wid)
                rounds = []
                for _ in range(MAX_ROUNDS):
                    samples = await self._round(wid, ranges)
                    rounds.append((spread(samples), samples))
                    if rounds[-1][0] <= STABLE_SPREAD:
                        break
                samples = min(rounds, key=lambda r: r[0])[1]
                await self._rows(wid, *ranges[-1])
                # Two sizes back to back: the difference cancels the round trip and fixed costs
                # (a heartbeat RTT measured meanwhile queues behind the payload on a slow link).
                timings = {}
                for size in (1 << 12, 1 << 18):
                    t0 = p.clock()
                    await self.probe(wid, kind="link", bytes=size)
                    timings[size] = p.clock() - t0
                small, large = sorted(timings)
                if timings[large] > timings[small]:
                    p.measure(M.Uploaded(wid, large - small, timings[large] - timings[small], round_trip=timings[small]))
                else:  # noise left no difference (a fast link, a busy CPU): the large probe's own time bounds it from below
                    p.measure(M.Uploaded(wid, large, timings[large], round_trip=timings[small]))
                await self.links.probe_peers(wid)
            info = p.state().workers.get(wid)
            p.measure(M.Calibrated(wid, tuple(samples), info.identity if info is not None else None, rounds=len(rounds)))
            if info is not None:
                if p.settings.calibration_file:
                    try:
                        p.profile.save_known(Path(p.settings.calibration_file))
                    except OSError as exc:
                        p.note(S.NoteKind.CALIBRATION_NOT_SAVED, error=str(exc))
        except (PipelineBroken, asyncio.TimeoutError, ChannelClosed, RuntimeError, ValueError, KeyError) as exc:
            p.note(S.NoteKind.CALIBRATION_FAILED, worker=wid, error=str(exc) or type(exc).__name__)
        finally:
            p.replan_wanted.set()
