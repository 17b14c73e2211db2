"""The coordinator's asyncio shell: worker connections in, events into ``ClusterState``, decisions out.

It never touches activations. The parts, one concern per file:
``state`` (the frozen cluster state and its one reducer ``apply``), ``core`` (one ``handle``:
inputs in, state, events and commands out, for heartbeats, frames heard, LOADED, prompt
prefills, admission and, in ``step_path``, the step path), ``executor`` (the one shell that
carries out every command of the core), ``membership`` (suspect / lose decisions),
``scheduling`` (bounded waits, resume or replay), ``admission`` (the API's tickets), ``deploy``
(plan change as actions, pure), ``deployer`` (carries out re-planning, loads, KV moves, the
spare), ``requests`` (the token loop of every request, replay), ``steps`` (one step on the
wire; the steps in flight and the lanes are state: ``step_book``, ``batching``),
``connections`` (worker channels in, heartbeats out), ``calibration``, ``checkpoints``
(live sequences' KV copied to the spare plan, so a recovery replays less), ``event_log`` (every
event and measurement, indexed) and ``narrate`` (the dashboard's line of a logged event).
The deployer, the calibrator, the connections, the requests, the KV migration, the prefix
cache, the KV checkpoints, the drafter workers and the steps are lent ``ports.Ports`` (read and
change the state, send to a worker), never the coordinator. This file holds the state, applies
events to it (and logs them: the dashboard's lines come only from that log), takes workers out,
and offers the public views.
States follow Down -> Preparing -> Committing -> Up (see ``deployer``); a worker that dies
pauses the sequences that need it, and they continue on the next plan, losing no token.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Callable

from ...net import limits
from ...net.channel import Channel, ChannelClosed
from ...net.messages import Bye, Emulate
from ..rules import core, deploy
from ..state import measurements, state as S
from . import narrate, views
from ..state.event_log import EventLog
from .calibration import Calibrator
from .checkpointing import Checkpoints
from ..state.checkpoints import CheckpointSettings
from .connections import Connections
from .deployer import Deployer
from .drafting import Drafting
from .executor import Executor
from .migration import KvMigration
from ..state.placement import Deployment, StageAssignment
from ..rules.planning import MemoryProportional, PlanContext, PlanPolicy
from .ports import Ports
from .prefix_cache import PrefixCaching
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES, ClusterProfile
from ..state.settings import CoordinatorSettings
from .requests import Requests
from .speculation import Speculation
from .steps import PipelineBroken, RequestFailed, StepRecord, Steps
from ..state.state import ClusterState, Phase
from .views import Link, WorkerView

log = logging.getLogger("edgepipe.coordinator")
DEFAULT_RECOVERY_S = 1.0  # assumed outage per failure until one is measured
State = Phase  # the name the HTTP views and tests know

__all__ = ["Coordinator", "CoordinatorSettings", "PipelineBroken", "RequestFailed", "State", "StepRecord", "WorkerView"]


class Coordinator:
    def __init__(self, package, settings: CoordinatorSettings | None = None, plan_fn: PlanPolicy | None = None,
                 on_step: Callable[[StepRecord], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 speculation: Speculation | None = None):
        self.package = package
        self.settings = settings or CoordinatorSettings()
        self.plan_fn = plan_fn or MemoryProportional()
        self.on_step = on_step or (lambda record: None)
        self.clock = clock  # every time the control plane reads (the simulation injects a virtual one)
        self.speculation = speculation  # the drafter of speculative decoding (needs settings.speculative)
        if speculation is not None and not self.settings.speculative:
            raise ValueError("a drafter needs CoordinatorSettings(speculative=True): the stages must run the verify form")
        self.cluster = ClusterState(phase_since=clock())
        self.links: dict[str, Link] = {}
        self.events = limits.EventLog()  # bounded per kind: one noisy kind cannot flush the others
        self.up = asyncio.Event()  # set exactly while the phase is Up
        self.gate = asyncio.Event()  # set exactly while no plan is being swapped in (sequences may step)
        self.gate.set()
        self.profile = ClusterProfile(self.manifest, variant_disk_bytes=self.settings.variant_disk_bytes)
        if self.settings.calibration_file:
            self.profile.load_known(Path(self.settings.calibration_file))
        # every state event and measurement, indexed (bounded): replays into ``cluster`` and ``profile``
        self.history = EventLog(self.cluster, self.profile)
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=256)  # (positions fed, wall seconds)
        self.replan_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.stopped = False
        self.stopped_why = ""  # why it halted: what a request between its steps fails with
        ports = Ports(state=lambda: self.cluster, emit=self.emit, measure=self.measure, note=self.event, clock=self.clock, spawn=self.spawn,
                      links=lambda: self.links, replan_wanted=self.replan_wanted, settings=self.settings, package=package,
                      profile=self.profile, adopt=self.adopt)
        # the one executor of the core's commands: every shell below hands the core's inputs to it
        self.executor = Executor(ports.state, ports.carry, core.Config.of(self.settings))
        self.prefix = PrefixCaching(ports, lambda: self.kv_capacity, self.executor)
        self.steps = Steps(ports, self.prefix, self.executor, self.lose)
        # drafter workers (--role drafter) get the draft model, where there is one to hand out
        self.drafting = (Drafting(ports, speculation.placed, speculation.pool, speculation.drafter_moved)
                         if speculation is not None and speculation.placed else None)
        self.checkpoints = Checkpoints(ports, CheckpointSettings(self.settings.kv_checkpoint_tokens, self.settings.kv_checkpoint_in_flight))
        self.requests = Requests(ports, self.steps, self.checkpoints, speculation, self.up, self.gate, lambda: self.stopped_why if self.stopped else None,
                                 lambda record: self.on_step(record), self.recent_steps)
        views = lambda: self.workers  # noqa: E731 - the worker views as they stand when asked
        self.calibrator = Calibrator(ports, self.plan_fn, self.plan_context, views)
        self.deployer = Deployer(ports, self.calibrator, self.plan_fn, self.plan_context, views, self.requests.lacking,
                                 lambda: bool(self.cluster.steps.inflight))
        self.deployer.migration = KvMigration(ports, self.steps.route)
        self.connections = Connections(ports, self.executor, self.calibrator, self.steps, self.requests, self.lose,
                                       lambda: self.stopped, self.drafting)
        self.executor.bind(ports=ports, lose=self.lose, quarantine=self.quarantine, connections=self.connections, steps=self.steps,
                           prefix=self.prefix, migration=self.deployer.migration, checkpoints=self.checkpoints)

    # -- state ------------------------------------------------------------------------------------
    def emit(self, event: S.Event) -> ClusterState:
        """The one way the cluster state changes."""
        self.cluster = S.apply(self.cluster, event)
        self._logged(event)
        return self._flags()

    def adopt(self, state: ClusterState, events: tuple) -> None:
        """``emit`` for the events of a ``core.handle`` that already applied them to the state now
        (its result is ``state``): each is logged, none applied a second time. Where one has a
        dashboard line, which reads the state right after it, they go through ``emit`` one by one."""
        if not events:
            return
        if any(type(e) not in narrate.SILENT for e in events):
            for e in events:
                self.emit(e)
            return
        self.cluster = state
        wall = time.time()
        for e in events:
            self.history.append(e, wall)
        self._flags()

    def _flags(self) -> ClusterState:
        """Up and the gate, as the state now says."""
        if self.cluster.phase is Phase.UP and self.cluster.active is not None:
            self.up.set()
        else:
            self.up.clear()
        if deploy.steps_may_start(self.cluster):
            self.gate.set()
        else:
            self.gate.clear()
        return self.cluster

    def measure(self, m: measurements.Measurement) -> None:
        """The one way the profile changes: a measurement, applied and logged."""
        self.profile.apply(m)
        self._logged(m)

    def event(self, kind: S.NoteKind, **fields) -> None:
        """A dashboard line that changes no state: logged as a ``Noted`` event like every other
        (``ValueError``: ``kind`` is not a ``NoteKind``)."""
        self.emit(S.Noted(S.NoteKind(kind), fields, self.clock()))

    def _logged(self, event) -> None:
        """Into the event log; the dashboard's line, if the event has one, derived from it (``narrate.entry``)."""
        wall = time.time()
        self.history.append(event, wall)
        line = narrate.entry(event, self.cluster, self.profile, wall)
        if line is not None:
            self.events.append(line)
            log.info("%s %s", line["kind"], {k: v for k, v in line.items() if k not in ("t", "kind")},
                     extra={"narrated": line})  # the serve terminal's line in words (cluster.operator_log)

    @property
    def manifest(self):
        """The package's manifest (a variant added at a join reloads it)."""
        return self.package.manifest

    @property
    def n_units(self) -> int:
        return len(self.manifest.units)

    @property
    def state(self) -> Phase:
        return self.cluster.phase

    @property
    def active(self) -> Deployment | None:
        return self.cluster.active

    @property
    def preparing(self) -> Deployment | None:
        return self.cluster.preparing

    @property
    def spare(self) -> list[StageAssignment] | None:
        return list(self.cluster.spare) if self.cluster.spare else None

    @property
    def ever_up(self) -> bool:
        return self.cluster.ever_up

    @property
    def last_switch(self) -> float:
        return self.cluster.last_switch

    @property
    def requests_in_flight(self) -> int:
        return len(self.cluster.requests)

    @property
    def reserved(self) -> dict[str, int]:
        return {rid: q.positions for rid, q in self.cluster.requests.items()}

    @property
    def workers(self) -> dict[str, WorkerView]:
        return {wid: WorkerView(info, self.links[wid]) for wid, info in self.cluster.workers.items() if wid in self.links}

    @property
    def running_prediction(self) -> dict | None:
        return self.plan_fn.running_prediction

    def plan_context(self, workers: list[WorkerView]) -> PlanContext:
        """What the plan function decides from (it is given no more than this)."""
        ids = [w.id for w in workers]
        forms = deploy.worker_forms(self.cluster, self.manifest, self.settings.precision, ids)
        return PlanContext(self.cluster, self.profile, workers, self.clock(), self.kv_plan_positions(), self.recovery_s(),
                           deploy.budget_form(self.cluster, self.manifest, self.settings.precision, ids), forms,
                           deploy.new_stage_room(self.cluster, self.manifest, forms, RUNTIME_OVERHEAD_BYTES))

    @property
    def kv_capacity(self) -> int | None:
        return self.deployer.kv_capacity()

    def kv_plan_positions(self) -> int:
        return self.deployer.kv_plan_positions()

    def recovery_s(self) -> float:
        """Median time from losing the running plan to the next one up (recent outages)."""
        return statistics.median(self.cluster.outages) if self.cluster.outages else DEFAULT_RECOVERY_S

    def state_durations(self) -> dict[str, float]:
        out = dict(self.cluster.phase_time)
        out[self.cluster.phase.value] += self.clock() - self.cluster.phase_since
        return out

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self.connections.heartbeats()), asyncio.create_task(self.deployer.replanner())]

    def halt(self, why: str) -> None:
        """Take no more work: every open request fails with ``why`` now (a stream ends with its API's
        error event); the workers stay connected until ``stop``."""
        self.stopped, self.stopped_why = True, self.stopped_why or why  # the first reason stays (a signal's, not stop's)
        self.steps.lost(None, why, final=True)

    async def stop(self) -> None:
        self.halt("the coordinator stopped")
        for task in self._tasks:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        for wid, link in list(self.links.items()):
            try:
                await link.send(Bye().to_message())
                await link.channel.close()
            except ChannelClosed:
                pass

    def spawn(self, coro) -> asyncio.Task:
        """A background task with a strong reference (the loop keeps only weak ones)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- membership (the channels themselves: connections.py) ---------------------------------------
    async def attach(self, channel: Channel) -> None:
        """Serve one worker's control channel until it closes (called by the API endpoint)."""
        await self.connections.attach(channel)

    async def lose(self, wid: str, why: str, failure: bool = True) -> None:
        """Take a worker out: its plan (if active) goes down, what it owed fails, its channel closes."""
        link = self.links.pop(wid, None)
        if link is None:
            return
        info = self.cluster.workers.get(wid)
        if info is not None:
            self.measure(measurements.DeviceLeft(wid, info.name, info.identity, self.clock(), failure))
        self.calibrator.lost(wid)
        if self.drafting is not None:
            self.drafting.lost(wid, why)  # its pending drafts are made here instead
        broken = PipelineBroken(f"worker {wid} {why}")
        for fut in list(link.loads.values()) + list(link.probes.values()):
            if not fut.done():
                fut.set_exception(broken)
        self.deployer.migration.abort_moves(broken)  # those sequences are rebuilt by replay instead
        self.checkpoints.lost(wid)
        plan = self.cluster.active.plan_id if self.cluster.uses(wid) else None
        self.emit(S.WorkerLost(wid, why, self.clock()))  # its dashboard line: narrate.entry
        if plan is not None:
            self.steps.lost(plan, str(broken))
        self.replan_wanted.set()
        try:
            await link.channel.close(why)
        except ChannelClosed:
            pass

    async def quarantine(self, wid: str, why: str) -> None:
        """A worker that answers pings but drops work: lost now, and not planned again for a while."""
        if wid not in self.cluster.workers:
            return  # already taken out (several steps may blame it at once)
        self.emit(S.Misbehaved(wid, why, self.clock()))
        await self.lose(wid, f"quarantined: {why}")

    async def set_emulation(self, worker_id: str, slowdown: float) -> None:
        """Change a worker's emulated slowdown (labelled emulation; benchmarks)."""
        await self.links[worker_id].send(Emulate(float(slowdown)).to_message())
        self.emit(S.EmulationChanged(worker_id, slowdown))

    # -- requests and planning (see requests.py, deployer.py) ---------------------------------------
    def new_sequence(self, prompt_ids, params, decode_fn):
        return self.requests.new_sequence(prompt_ids, params, decode_fn)

    def stream(self, state, rid: str | None = None):
        return self.requests.stream(state, rid)

    async def replan(self, force: bool = False) -> Deployment | None:
        return await self.deployer.replan(force)

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None,
                     pin_s: float = 0.0) -> Deployment:
        return await self.deployer.deploy(stages, reason, predicted, pin_s)

    # -- views ------------------------------------------------------------------------------------
    def status(self) -> dict:
        return views.status(self)
