"""The coordinator's asyncio shell: worker connections in, events into ``ClusterState``, decisions out.

It never touches activations. The parts, one concern per file:
``state`` (the frozen cluster state and its one reducer ``apply``), ``membership`` (suspect /
lose decisions), ``scheduling`` (admission, bounded waits), ``deploy`` (plan change as
actions, pure), ``deployer`` (carries out re-planning, loads, KV moves, the spare),
``requests`` (the token loop of every request, replay), ``steps`` (one step on the wire, lanes,
timeouts), ``connections`` (worker channels in, heartbeats out), ``calibration``, ``checkpoints``
(live sequences' KV copied to the spare plan, so a recovery replays less). This file holds
the state, applies events to it, takes workers out, and offers the public views.
States follow Down -> Preparing -> Committing -> Up (see ``deployer``); a worker that dies
pauses the sequences that need it, and they continue on the next plan, losing no token.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..net import limits
from ..net.channel import Channel, ChannelClosed
from ..net.messages import Bye, Emulate
from . import measurements, state as S, views
from .calibration import Calibrator
from .checkpoints import Checkpoints, CheckpointSettings
from .connections import Connections
from .deployer import Deployer
from .placement import Deployment, StageAssignment
from .planning import MemoryProportional, PlanContext, PlanPolicy
from .prefix_cache import PrefixCaching
from .profiling import ClusterProfile
from .requests import Requests
from .speculation import Speculation
from .steps import PipelineBroken, RequestFailed, StepRecord, Steps
from .state import ClusterState, Phase
from .views import Link, WorkerView

log = logging.getLogger("edgepipe.coordinator")
DEFAULT_RECOVERY_S = 1.0  # assumed outage per failure until one is measured
State = Phase  # the name the HTTP views and tests know

__all__ = ["Coordinator", "CoordinatorSettings", "PipelineBroken", "RequestFailed", "State", "StepRecord", "WorkerView"]


@dataclass
class CoordinatorSettings:
    min_workers: int = 1
    join_token: str | None = None
    heartbeat_s: float = 0.5
    dead_after_s: float = 2.0  # silence before a worker may be suspected (then probed; lost after lose_after_s)
    lose_after_s: float = 10.0  # a suspected worker is lost after this much silence (or 3x its longest gap)
    load_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    precision: str | None = None
    calibrate: bool = True  # time two unit ranges on each joining worker
    replan_every_s: float = 10.0  # periodic check for drift
    lane_wait_s: float = 0.005  # how long a micro-batch waits for a member that is late
    capacity_wait_s: float = 30.0  # a request waits this long for workers that can hold the model, then fails
    issue_data_secrets: bool = True  # False: stages derive data-port secrets from the join token (net.auth)
    max_wait_s: float = 300.0  # a request without progress for this long fails (cluster down, pipeline failing)
    calibration_file: str | None = None  # calibrations kept here survive a coordinator restart
    batch_invariant: bool = False  # stages run graphs that give a sequence the same bits alone as batched (graphs.pad_lone_rows)
    speculative: bool = False  # stages run the verify form (graphs.verify_form): decode steps may carry drafted tokens
    replay_in_one_prefill: bool = False  # with the verify form: a lost sequence's KV is rebuilt by one prefill (serve --verify-form)
    prefix_cache_positions: int = 4096  # KV positions each stage may keep of cached prompt prefixes (0: no prefix cache)
    prefix_block: int = 32  # token ids per cached block (cluster.prefix)
    kv_checkpoint_tokens: int = 32  # copy a live sequence's KV to the spare plan every this many tokens (0: never; cluster.checkpoints)
    kv_checkpoint_in_flight: int = 2  # sequences whose checkpoint is being copied at once


class Coordinator:
    def __init__(self, package, settings: CoordinatorSettings | None = None, plan_fn: PlanPolicy | None = None,
                 on_step: Callable[[StepRecord], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 speculation: Speculation | None = None):
        self.package = package
        self.manifest = package.manifest
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
        self.profile = ClusterProfile(self.manifest)
        if self.settings.calibration_file:
            self.profile.load_known(Path(self.settings.calibration_file))
        # every state event and measurement, indexed (bounded): replays into ``cluster`` and ``profile``
        self.history = S.EventLog(self.cluster, self.profile)
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=256)  # (positions fed, wall seconds)
        self.replan_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.stopped = False
        self.prefix = PrefixCaching(self)
        self.steps = Steps(self)
        self.requests = Requests(self, self.steps)
        self.deployer = Deployer(self)
        self.checkpoints = Checkpoints(self, CheckpointSettings(self.settings.kv_checkpoint_tokens, self.settings.kv_checkpoint_in_flight))
        self.calibrator = Calibrator(self)
        self.connections = Connections(self)

    # -- state ------------------------------------------------------------------------------------
    def emit(self, event: S.Event) -> ClusterState:
        """The one way the cluster state changes."""
        self.cluster = S.apply(self.cluster, event)
        self.history.append(event)
        if self.cluster.phase is Phase.UP and self.cluster.active is not None:
            self.up.set()
        else:
            self.up.clear()
        return self.cluster

    def measure(self, m: measurements.Measurement) -> None:
        """The one way the profile changes: a measurement, applied and logged."""
        self.profile.apply(m)
        self.history.append(m)

    def event(self, kind: str, **fields) -> None:
        """A line for the dashboard and the log (not state)."""
        self.events.append(limits.json_safe({"t": time.time(), "kind": kind, **fields}))
        log.info("%s %s", kind, fields)

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
        return PlanContext(self.cluster, self.profile, workers, self.clock(), self.kv_plan_positions(), self.recovery_s())

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

    async def stop(self) -> None:
        self.stopped = True
        for task in self._tasks:
            task.cancel()
        self.steps.fail_all(RequestFailed("the coordinator stopped"))
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
        broken = PipelineBroken(f"worker {wid} {why}")
        for fut in list(link.loads.values()) + list(link.probes.values()):
            if not fut.done():
                fut.set_exception(broken)
        self.deployer.migration.abort_moves(broken)  # those sequences are rebuilt by replay instead
        self.checkpoints.lost(wid)
        plan = self.cluster.active.plan_id if self.cluster.uses(wid) else None
        self.emit(S.WorkerLost(wid, why, self.clock()))
        self.event("leave", worker=wid, why=why)
        if plan is not None:
            self.steps.fail_plan(plan, broken)
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
        q = self.cluster.quarantine.get(self.cluster.workers[wid].identity)
        self.event("quarantine", worker=wid, why=why, seconds=round(q.until - self.clock(), 1), strikes=q.strikes)
        await self.lose(wid, f"quarantined: {why}")

    async def set_emulation(self, worker_id: str, slowdown: float) -> None:
        """Change a worker's emulated slowdown (labelled emulation; benchmarks)."""
        await self.links[worker_id].send(Emulate(float(slowdown)).to_message())
        self.emit(S.EmulationChanged(worker_id, slowdown))
        self.event("emulation", worker=worker_id, slowdown=float(slowdown))

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
