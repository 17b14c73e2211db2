"""The coordinator's asyncio shell: worker connections in, events into ``ClusterState``, decisions out.

It never touches activations. The parts, one concern per file:
``state`` (the frozen cluster state and its one reducer ``apply``), ``membership`` (suspect /
lose decisions), ``scheduling`` (admission, bounded waits), ``deploy`` (plan change as
actions, pure), ``deployer`` (carries out re-planning, loads, KV moves, the spare),
``requests`` (the token loop of every request, lanes, replay), ``calibration``. This file
connects workers, turns every frame and timer into events, and offers the public views.
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

from ..net import auth, limits, validate
from ..net.channel import Channel, ChannelClosed
from ..net.messages import Bye, Emulate, ErrorCode, Ping, Welcome, parse
from ..net.protocol import Message, MessageType as T, ProtocolError, decode, error_frame
from . import membership, state as S, views
from .calibration import Calibrator
from .deployer import Deployer
from .placement import Deployment, StageAssignment, proportional_split
from .profiling import ClusterProfile
from .requests import PipelineBroken, RequestFailed, Requests, StepRecord
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


PlanFn = Callable[["Coordinator", list[WorkerView]], tuple[list[StageAssignment], str, dict]]


def memory_proportional_plan(coord: "Coordinator", workers: list[WorkerView]):
    stages = proportional_split(coord.n_units, [(w.id, w.memory_bytes) for w in sorted(workers, key=lambda w: w.joined_at)])
    return stages, "layers split in proportion to declared memory", {}


class Coordinator:
    def __init__(self, package, settings: CoordinatorSettings | None = None, plan_fn: PlanFn | None = None,
                 on_step: Callable[[StepRecord], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.package = package
        self.manifest = package.manifest
        self.settings = settings or CoordinatorSettings()
        self.plan_fn = plan_fn or memory_proportional_plan
        self.on_step = on_step or (lambda record: None)
        self.clock = clock  # every time the control plane reads (the simulation injects a virtual one)
        self.cluster = ClusterState(phase_since=clock())
        self.links: dict[str, Link] = {}
        self.events = limits.EventLog()  # bounded per kind: one noisy kind cannot flush the others
        self.up = asyncio.Event()  # set exactly while the phase is Up
        self.profile = ClusterProfile(self.manifest)
        if self.settings.calibration_file:
            self.profile.load_known(Path(self.settings.calibration_file))
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=256)  # (positions fed, wall seconds)
        self._replan_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.stopped = False
        self.requests = Requests(self)
        self.deployer = Deployer(self)
        self.calibrator = Calibrator(self)

    # -- state ------------------------------------------------------------------------------------
    def emit(self, event: S.Event) -> ClusterState:
        """The one way the cluster state changes."""
        self.cluster = S.apply(self.cluster, event)
        if self.cluster.phase is Phase.UP and self.cluster.active is not None:
            self.up.set()
        else:
            self.up.clear()
        return self.cluster

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
        return getattr(self.plan_fn, "running_prediction", None)

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
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self.deployer.replanner())]

    async def stop(self) -> None:
        self.stopped = True
        for task in self._tasks:
            task.cancel()
        self.requests.fail_all(RequestFailed("the coordinator stopped"))
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

    # -- membership -------------------------------------------------------------------------------
    async def attach(self, channel: Channel) -> None:
        """Serve one worker's control channel until it closes (called by the API endpoint)."""
        try:
            hello = decode(await asyncio.wait_for(channel.recv(), timeout=10))
            if hello.type is not T.HELLO:
                raise ProtocolError(f"expected hello, got {hello.type.value}")
        except (ProtocolError, asyncio.TimeoutError) as exc:
            await self._refuse(channel, str(exc) or "no hello within 10 s")
            return
        except ChannelClosed:
            return
        if self.stopped:
            await self._refuse(channel, "the coordinator is stopping")
            return
        if self.settings.join_token and not auth.same_secret(hello.get("token"), self.settings.join_token):
            await self._refuse(channel, "wrong or missing join token" if hello.get("token") else "missing join token")
            return
        wanted = hello.get("precision")
        if wanted and any(wanted not in u.variants for u in self.manifest.units):
            try:
                await self.calibrator.add_variant(wanted)
            except (ValueError, OSError) as exc:
                await self._refuse(channel, f"cannot provide the {wanted} variant: {exc}")
                return
        name = str(hello.get("name", "worker"))[:32]
        wid = f"w{self.cluster.joins + 1}-{name}"[:40]
        link = self.links[wid] = Link(channel)
        self.emit(S.WorkerJoined(wid, name, hello.fields, self.clock()))
        await link.send(Welcome(wid).to_message())
        info = self.cluster.workers[wid]
        self.event("join", worker=wid, memory=info.memory_bytes, emulation=hello.get("emulation"), device_kind=hello.get("kind"))
        self.profile.joined(name, self.clock())
        self.calibrator.joined(wid)
        self._replan_wanted.set()
        try:
            await self._read_worker(wid, link)
        finally:
            await self.lose(wid, "disconnected")

    async def _refuse(self, channel: Channel, reason: str) -> None:
        self.event("refused", peer=channel.peer, reason=reason)
        try:
            await channel.send(error_frame(reason, code=ErrorCode.REFUSED.value))
            await channel.close(reason)
        except ChannelClosed:
            pass

    async def _read_worker(self, wid: str, link: Link) -> None:
        vocab = getattr(self.manifest, "vocab_size", None) or (1 << 31)
        while self.links.get(wid) is link:
            try:
                raw = await link.channel.recv()
            except ChannelClosed:
                return
            try:
                msg = decode(raw)
                typed = parse(msg, vocab)
                if msg.type is T.PONG:
                    validate.pong_stats(msg.fields)
            except (ProtocolError, validate.InvalidWorkerFrame) as exc:
                await self._refuse(link.channel, f"bad frame from {wid}: {exc}")
                return
            seen = self.cluster.workers.get(wid)
            if seen is not None and (seen.suspected_since is not None or self.clock() - seen.last_seen >= 0.05):
                self.emit(S.Heard(wid, self.clock()))  # frames closer than 50 ms apart tell the detector nothing new
            self._dispatch(wid, link, msg, typed)

    def _dispatch(self, wid: str, link: Link, msg: Message, typed) -> None:
        if msg.type is T.TOKEN:
            self.requests.tokens(wid, typed)
        elif msg.type is T.PONG:
            rtt = self.clock() - typed.t if typed.t is not None and typed.t <= self.clock() else None
            if rtt is not None:
                self.profile.heartbeat(wid, rtt)
            self.emit(S.Ponged(wid, rtt, {"kv_bytes": typed.kv_bytes, "queue": typed.queue, "busy_s": typed.busy_s,
                                          "computed": typed.computed}, self.clock()))
        elif msg.type is T.LOADED:
            if typed.kv_received is not None:
                self.deployer.moved(typed)
            else:
                fut = link.loads.pop(typed.plan, None)
                if fut and not fut.done():
                    fut.set_result(typed)
        elif msg.type is T.PROBED:
            fut = link.probes.pop(typed.probe, None)
            if fut and not fut.done():
                fut.set_result(typed)
        elif msg.type is T.FORWARD and typed.relay_to:
            dep = self.cluster.active
            try:  # only a stage of the active plan may relay, and only to the stage after it
                validate.relay_frame(msg.fields, sender=wid, stages=dep.workers if dep else (), plan_id=dep.plan_id if dep else -1)
            except validate.InvalidWorkerFrame as exc:
                self.event("ignored", worker=wid, why=str(exc))
                return
            target = self.links.get(typed.relay_to)
            if target:
                fields = {k: v for k, v in msg.fields.items() if k != "relay_to"}
                self.spawn(self.requests.relay(typed.relay_to, target, Message(T.FORWARD, fields, msg.tensors)))
        elif msg.type is T.ERROR:
            self.requests.worker_error(wid, typed)
        elif msg.type is T.BYE:  # it is leaving: drop it now, not after the suspect / lose timeouts
            final = bool(msg.get("final"))
            self.spawn(self.lose(wid, "shut down (final bye)" if final else "said bye", failure=not final))

    async def lose(self, wid: str, why: str, failure: bool = True) -> None:
        """Take a worker out: its plan (if active) goes down, what it owed fails, its channel closes."""
        link = self.links.pop(wid, None)
        if link is None:
            return
        info = self.cluster.workers.get(wid)
        if info is not None:
            self.profile.forget(wid, info.identity)
            self.profile.left(info.name, self.clock(), failure)
        self.calibrator.lost(wid)
        broken = PipelineBroken(f"worker {wid} {why}")
        for fut in list(link.loads.values()) + list(link.probes.values()):
            if not fut.done():
                fut.set_exception(broken)
        self.deployer.abort_moves(broken)  # those sequences are rebuilt by replay instead
        plan = self.cluster.active.plan_id if self.cluster.uses(wid) else None
        self.emit(S.WorkerLost(wid, why, self.clock()))
        self.event("leave", worker=wid, why=why)
        if plan is not None:
            self.requests.fail_plan(plan, broken)
        self._replan_wanted.set()
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

    async def _heartbeats(self) -> None:
        liveness = membership.LivenessSettings(self.settings.heartbeat_s, min_suspect_s=self.settings.dead_after_s,
                                               lose_after_s=self.settings.lose_after_s)
        last = self.clock()
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            now = self.clock()
            if membership.quarantine_ended(self.cluster, last, now):
                self._replan_wanted.set()  # a quarantined device may be planned again
            last = now
            suspects = []
            for verdict in membership.verdicts(self.cluster, now, liveness):
                if isinstance(verdict, membership.Lose):
                    self.spawn(self.lose(verdict.worker_id, verdict.why))
                else:
                    self.emit(S.Suspected(verdict.worker_id, now))
                    self.event("suspect", worker=verdict.worker_id, silent_s=round(verdict.silent_s, 2))
                    suspects.append(verdict.worker_id)
            if suspects and membership.abandon_active(self.cluster, suspects, self.requests.lacking()):
                # A frozen stage would hold every request until it wakes or the step times out:
                # serve from the others now; it rejoins the plans when heard from again.
                plan = self.cluster.active.plan_id
                why = f"plan {plan}: stage {', '.join(suspects)} went silent"
                self.emit(S.PlanAbandoned(plan, why, now))
                self.event("abandon", plan=plan, why=why)
                self.requests.fail_plan(plan, PipelineBroken(why))
                self._replan_wanted.set()
            for wid, link in list(self.links.items()):
                try:
                    await link.send(Ping(now).to_message())
                except ChannelClosed:
                    self.spawn(self.lose(wid, "disconnected"))

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

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None) -> Deployment:
        return await self.deployer.deploy(stages, reason, predicted)

    # -- views ------------------------------------------------------------------------------------
    def status(self) -> dict:
        return views.status(self)
