"""The coordinator: membership, deployment, and the token loop of every request.

It never touches activations. Per decode step it sends a sequence's token ids to the first
stage and waits for the sampled id that the last stage returns; decode steps travel in
micro-batches ("lanes", see ``batching``), one frame per lane, so that with many sequences
every stage works on a different lane. States follow
Down -> Preparing (workers fetch files, build sessions) -> Committing (switch) -> Up; a new
plan is prepared in an inactive slot while the active one keeps serving, and swapped in
between two steps. A worker that dies pauses the sequences that need it; once a new plan is
up they re-run prefill over prompt + tokens so far and continue, losing no token.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import AsyncIterator, Callable

import numpy as np

from .. import PROTOCOL_VERSION
from ..net.channel import Channel, ChannelClosed
from ..net.protocol import Message, MessageType as T, ProtocolError, decode, encode, error_frame
from ..runtime.sequence import GenerationParams, SequenceState, TextDelta, uniform_draw
from .batching import LaneItem, Lanes
from .placement import Deployment, StageAssignment, proportional_split
from .profiling import RUNTIME_OVERHEAD_BYTES, ClusterProfile

log = logging.getLogger("edgepipe.coordinator")
DEFAULT_RECOVERY_S = 1.0  # assumed outage per failure until one is measured
MOVE_TIMEOUT_S = 10.0  # KV moves still missing after this are rebuilt by replay instead


class State(str, Enum):
    DOWN = "down"
    PREPARING = "preparing"
    COMMITTING = "committing"
    UP = "up"


class PipelineBroken(RuntimeError):
    """The plan a step ran on lost a worker; the step must be retried on a new plan."""


class RequestFailed(RuntimeError):
    """A request cannot continue (the message says why, in one line)."""


@dataclass
class WorkerHandle:
    id: str
    name: str
    channel: Channel
    hello: dict
    joined: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    rtt_s: float | None = None
    alive: bool = True
    stats: dict = field(default_factory=dict)
    loads: dict[int, asyncio.Future] = field(default_factory=dict)
    probes: dict[int, asyncio.Future] = field(default_factory=dict)

    @property
    def memory_bytes(self) -> int:
        return int(self.hello.get("memory_bytes") or 0)

    @property
    def relay(self) -> bool:
        return self.hello.get("kind") == "browser"

    @property
    def identity(self) -> tuple:
        """Name and declared hardware: a device that comes back with these is the same device."""
        h = self.hello
        return (self.name, h.get("kind"), h.get("memory_bytes"), h.get("threads"), repr(h.get("emulation")), h.get("precision"))

    async def send(self, msg: Message) -> None:
        await self.channel.send(encode(msg))


@dataclass
class CoordinatorSettings:
    min_workers: int = 1
    join_token: str | None = None
    heartbeat_s: float = 0.5
    dead_after_s: float = 2.0
    load_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    precision: str | None = None
    calibrate: bool = True  # time two unit ranges on each joining worker
    replan_every_s: float = 10.0  # periodic check for drift
    lane_wait_s: float = 0.005  # how long a micro-batch waits for a member that is late


@dataclass
class _OutStep:
    """A step on its way out: what goes into the frame, and the future its token resolves."""

    dep: Deployment
    item: dict  # seq, step, rid, sampling[, partial: a replay frame whose token is not wanted]
    feed: list[int]
    fut: asyncio.Future
    sent_at: float = 0.0


@dataclass
class StepRecord:
    """What the metrics and profiler learn from one token."""

    rid: str
    tokens_in: int
    wall_s: float
    timings: list  # [[worker_id, compute_s, positions, bytes/elem, batch], ...]: one per stage, shared by a batch
    coordinator_s: float
    first_in_batch: bool = True  # the batch's other sequences carry the same timings: count stage times once


PlanFn = Callable[["Coordinator", list[WorkerHandle]], tuple[list[StageAssignment], str, dict]]


def memory_proportional_plan(coord: "Coordinator", workers: list[WorkerHandle]):
    stages = proportional_split(coord.n_units, [(w.id, w.memory_bytes) for w in sorted(workers, key=lambda w: w.joined)])
    return stages, "layers split in proportion to declared memory", {}


class Coordinator:
    def __init__(self, package, settings: CoordinatorSettings | None = None, plan_fn: PlanFn | None = None,
                 on_step: Callable[[StepRecord], None] | None = None):
        self.package = package
        self.manifest = package.manifest
        self.settings = settings or CoordinatorSettings()
        self.plan_fn = plan_fn or memory_proportional_plan
        self.on_step = on_step or (lambda record: None)
        self.state = State.DOWN
        self.workers: dict[str, WorkerHandle] = {}
        self.active: Deployment | None = None
        self.preparing: Deployment | None = None
        self.up = asyncio.Event()
        self.events: deque[dict] = deque(maxlen=500)
        self.state_since = time.monotonic()
        self.state_time: dict[str, float] = {s.value: 0.0 for s in State}
        self._pending: dict[str, tuple[int, int, asyncio.Future]] = {}
        self._ids = itertools.count(1)
        self._plan_ids = itertools.count(1)
        self._worker_ids = itertools.count(1)
        self._replan_lock = asyncio.Lock()
        self._replan_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.requests_in_flight = 0
        self.spare: list[StageAssignment] | None = None
        self.ever_up = False
        self.running_prediction: dict | None = None  # the live plan priced with today's profiles
        self.profile = ClusterProfile(self.manifest)
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=256)  # (positions fed, wall seconds)
        self._calibration_lock = asyncio.Lock()
        self._variant_lock = asyncio.Lock()
        self._calibrations: dict[str, asyncio.Task] = {}
        self.last_switch = time.monotonic()
        self.live: dict[str, tuple[int, int]] = {}  # seq -> (plan id, tokens in its KV)
        self._gate = asyncio.Event()  # cleared while a new plan is committed (no new steps)
        self._gate.set()
        self._migrated: dict[str, int] = {}  # seq -> plan that received its KV
        self._moves: dict[int, asyncio.Future] = {}
        self.migrate_kv = True
        self.lanes = Lanes(arm=self._arm_lane)
        self.reserved: dict[str, int] = {}  # request -> KV positions it may grow to (prompt + max_tokens)
        self.outages: deque[float] = deque(maxlen=32)  # seconds from leaving Up to the next Up
        self._down_since: float | None = None

    @property
    def n_units(self) -> int:
        return len(self.manifest.units)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._replanner())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in list(self.workers.values()):
            try:
                await w.send(Message(T.BYE))
                await w.channel.close()
            except ChannelClosed:
                pass

    def _set_state(self, state: State) -> None:
        now = time.monotonic()
        self.state_time[self.state.value] += now - self.state_since
        self.state_since = now
        if state is not self.state:
            self.event("state", state=state.value)
            if self.state is State.UP:
                self._down_since = now
            elif state is State.UP and self._down_since is not None:
                self.outages.append(now - self._down_since)
                self._down_since = None
        self.state = state

    def recovery_s(self) -> float:
        """Median time from losing the running plan to the next one up (recent outages)."""
        return statistics.median(self.outages) if self.outages else DEFAULT_RECOVERY_S

    def state_durations(self) -> dict[str, float]:
        out = dict(self.state_time)
        out[self.state.value] += time.monotonic() - self.state_since
        return out

    def event(self, kind: str, **fields) -> None:
        self.events.append({"t": time.time(), "kind": kind, **fields})
        log.info("%s %s", kind, fields)

    # -- membership ---------------------------------------------------------------------------
    async def attach(self, channel: Channel) -> None:
        """Serve one worker's control channel until it closes (called by the API endpoint)."""
        try:
            raw = await asyncio.wait_for(channel.recv(), timeout=10)
            hello = decode(raw)
            if hello.type is not T.HELLO:
                raise ProtocolError(f"expected hello, got {hello.type.value}")
        except (ProtocolError, asyncio.TimeoutError) as exc:
            reason = str(exc) or "no hello within 10 s"
            await self._refuse(channel, reason)
            return
        except ChannelClosed:
            return
        if self.settings.join_token and hello.get("token") != self.settings.join_token:
            await self._refuse(channel, "wrong or missing join token" if hello.get("token") else "missing join token")
            return
        wanted = hello.get("precision")
        if wanted and any(wanted not in u.variants for u in self.manifest.units):
            try:
                await self._add_variant(wanted)
            except (ValueError, OSError) as exc:
                await self._refuse(channel, f"cannot provide the {wanted} variant: {exc}")
                return
        worker = WorkerHandle(f"w{next(self._worker_ids)}-{hello.get('name', 'worker')}"[:40], str(hello.get("name", "worker")), channel, hello.fields)
        self.workers[worker.id] = worker
        await worker.send(Message(T.WELCOME, {"worker_id": worker.id}))
        self.event("join", worker=worker.id, memory=worker.memory_bytes, emulation=hello.get("emulation"), device_kind=hello.get("kind"))
        self.profile.joined(worker.name, time.monotonic())
        if self.settings.calibrate and self.profile.recall(worker.id, worker.identity):
            m = self.profile.of(worker.id)
            self.event("calibrated", worker=worker.id, speed=round(m.speed, 3), overhead_ms=round(m.overhead_s * 1e3, 3),
                       uplink_mb_s=round((m.bandwidth_bytes_per_s or 0) / 1e6, 3), reused=True)
        elif self.settings.calibrate:
            self._calibrations[worker.id] = self._spawn(self._calibrate(worker))
        self._replan_wanted.set()
        try:
            await self._read_worker(worker)
        finally:
            await self._lose(worker, "disconnected")

    async def _add_variant(self, precision: str) -> None:
        from ..model.importer import add_variant
        from ..model.weights import PRECISIONS

        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        async with self._variant_lock:
            if all(precision in u.variants for u in self.manifest.units):
                return
            self.event("variant", precision=precision, status="building")
            await asyncio.get_running_loop().run_in_executor(None, add_variant, self.package.root, precision)
            self.package.reload()
            self.manifest = self.package.manifest
            self.profile.manifest = self.manifest
            self.event("variant", precision=precision, status="ready")

    async def _refuse(self, channel: Channel, reason: str) -> None:
        self.event("refused", peer=channel.peer, reason=reason)
        try:
            await channel.send(error_frame(reason))
            await channel.close(reason)
        except ChannelClosed:
            pass

    async def _read_worker(self, w: WorkerHandle) -> None:
        while w.alive:
            try:
                raw = await w.channel.recv()
            except ChannelClosed:
                return
            try:
                msg = decode(raw)
            except ProtocolError as exc:
                await self._refuse(w.channel, f"bad frame: {exc}")
                return
            w.last_seen = time.monotonic()
            self._dispatch(w, msg)

    def _dispatch(self, w: WorkerHandle, msg: Message) -> None:
        if msg.type is T.TOKEN:
            timings = msg.get("timings", [])
            for i, (item, token) in enumerate(zip(msg["batch"], msg["tokens"])):
                self._resolve(item["seq"], item["step"], msg["plan"], {"token": token, "timings": timings, "first": i == 0})
        elif msg.type is T.PONG:
            if msg.get("t") is not None:
                w.rtt_s = time.monotonic() - msg["t"]
                self.profile.heartbeat(w.id, w.rtt_s)
            w.stats = {k: msg.get(k) for k in ("kv_bytes", "queue", "busy_s", "computed")}
        elif msg.type is T.LOADED:
            if "kv_received" in msg.fields:
                fut = self._moves.pop(msg["kv_received"], None)
            else:
                fut = w.loads.pop(msg["plan"], None)
            if fut and not fut.done():
                fut.set_result(msg.fields)
        elif msg.type is T.PROBED:
            fut = w.probes.pop(msg["probe"], None)
            if fut and not fut.done():
                fut.set_result(msg)
        elif msg.type is T.FORWARD and msg.get("relay_to"):
            target = self.workers.get(msg["relay_to"])
            fields = {k: v for k, v in msg.fields.items() if k != "relay_to"}
            if target:
                self._spawn(self._relay(target, Message(T.FORWARD, fields, msg.tensors)))
        elif msg.type is T.ERROR:
            seq = msg.get("seq")
            if seq in self._pending:
                _, _, fut = self._pending.pop(seq)
                text = msg.get("message", "worker error")
                exc = PipelineBroken(text) if "unreachable" in text else RequestFailed(f"worker {w.id}: {text}")
                if not fut.done():
                    fut.set_exception(exc)

    async def _relay(self, target: WorkerHandle, msg: Message) -> None:
        try:
            await target.send(msg)
        except ChannelClosed:
            self._fail_pending(lambda plan: True, PipelineBroken(f"relay to {target.id} failed"))

    def _resolve(self, seq: str, step: int, plan: int, reply: dict) -> None:
        entry = self._pending.get(seq)
        if entry and entry[0] == step and entry[1] == plan and not entry[2].done():
            del self._pending[seq]
            entry[2].set_result(reply)

    async def _lose(self, w: WorkerHandle, why: str) -> None:
        if not w.alive and w.id not in self.workers:
            return
        w.alive = False
        self.workers.pop(w.id, None)
        self.profile.forget(w.id, w.identity)
        self.profile.left(w.name, time.monotonic())
        task = self._calibrations.pop(w.id, None)
        if task:
            task.cancel()
        # A loss aborts KV moves in flight too: those sequences are rebuilt by replay instead.
        for fut in list(w.loads.values()) + list(w.probes.values()) + list(self._moves.values()):
            if not fut.done():
                fut.set_exception(PipelineBroken(f"worker {w.id} {why}"))
        self.event("leave", worker=w.id, why=why)
        uses = lambda dep: dep is not None and w.id in dep.workers  # noqa: E731
        if uses(self.active):
            self.up.clear()
            self._set_state(State.DOWN)
            broken = self.active.plan_id
            self.active = None
            self._fail_pending(lambda plan: plan == broken, PipelineBroken(f"worker {w.id} {why}"))
        self._replan_wanted.set()
        try:
            await w.channel.close()
        except ChannelClosed:
            pass

    def _fail_pending(self, which: Callable[[int], bool], exc: Exception) -> None:
        for seq, (step, plan, fut) in list(self._pending.items()):
            if which(plan) and not fut.done():
                del self._pending[seq]
                fut.set_exception(exc)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_seen > self.settings.dead_after_s:
                    self._spawn(self._lose(w, f"missed heartbeats for {now - w.last_seen:.1f} s"))
                    continue
                try:
                    await w.send(Message(T.PING, {"t": now}))
                except ChannelClosed:
                    self._spawn(self._lose(w, "disconnected"))

    # -- planning and deployment ----------------------------------------------------------------
    async def _replanner(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._replan_wanted.wait(), timeout=self.settings.replan_every_s)
            except asyncio.TimeoutError:
                pass  # the periodic check: measured speeds may have drifted
            await asyncio.sleep(0.05)  # let a burst of joins/leaves settle
            self._replan_wanted.clear()
            pending = [t for t in self._calibrations.values() if not t.done()]
            if pending and self.active is not None:  # when down, recover with who is ready now
                await asyncio.gather(*pending, return_exceptions=True)
            try:
                await self.replan()
            except Exception as exc:  # a failed plan must not stop future re-planning
                self.event("plan_failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                await asyncio.sleep(0.5)
                self._replan_wanted.set()

    async def replan(self, force: bool = False) -> Deployment | None:
        async with self._replan_lock:
            calibrating = {wid for wid, t in self._calibrations.items() if not t.done()}
            workers = [w for w in self.workers.values() if w.alive and w.id not in calibrating]
            if len(workers) < self.settings.min_workers and not self.ever_up:
                return None  # min_workers gates only the first plan; later, serve with who is left
            if not workers:
                return None
            alive = {w.id for w in workers}
            if self.active is None and self.ever_up and self.spare and {s.worker_id for s in self.spare} <= alive:
                # Down: the spare plan's files (and sessions, where budgets allowed) are already in
                # place, so it is up fastest; the policy may move to a better plan once serving.
                stages, reason, predicted = self.spare, "spare plan (recovery)", {}
                self._replan_wanted.set()
            else:
                stages, reason, predicted = self.plan_fn(self, workers)
            if not stages:
                self.event("plan_failed", error=reason)
                return None
            current = self.active
            if current and not force:
                if [(s.worker_id, s.start, s.end) for s in current.stages] == [(s.worker_id, s.start, s.end) for s in stages]:
                    return current
                decision = predicted.get("switch")
                if decision is not None and not decision["switch"]:
                    return current  # not worth its switch cost yet (hysteresis)
            try:
                return await self.deploy(stages, reason, {k: v for k, v in predicted.items() if k != "switch"})
            except Exception:
                if stages is self.spare:
                    self.spare = None  # the next attempt asks the planner
                raise

    async def _load(self, w: WorkerHandle, plan_id: int, start: int, end: int, next_hop: dict, keep: list[int]) -> dict:
        fut = w.loads[plan_id] = asyncio.get_running_loop().create_future()
        await w.send(Message(T.LOAD, {
            "plan": plan_id, "start": start, "end": end, "keep": keep,
            "graph": self.package.stage_graph(start, end, self._precision(w)),
            "files": list(self.manifest.stage_files(start, end, self._precision(w))),
            "next": next_hop, "max_context": self.manifest.max_context,
            "kv_bytes_per_token": sum(u.kv_bytes_per_token for u in self.manifest.units[start:end]),
        }))
        return await asyncio.wait_for(fut, timeout=self.settings.load_timeout_s)

    async def _probe(self, w: WorkerHandle, fields: dict) -> Message:
        probe = next(self._ids)
        fut = w.probes[probe] = asyncio.get_running_loop().create_future()
        await w.send(Message(T.PROBE, {"probe": probe, **fields}))
        return await asyncio.wait_for(fut, timeout=self.settings.load_timeout_s)

    async def _calibrate(self, w: WorkerHandle) -> None:
        """Time a 1-layer and a 4-layer range and the uplink (000 §5: speed + per-call overhead)."""
        layers = [u.index for u in self.manifest.units if u.kind == "layer"]
        ranges = [(layers[0], layers[0] + 1), (layers[0], layers[min(3, len(layers) - 1)] + 1)]
        try:
            async with self._calibration_lock:  # one at a time: calibrations must not share the CPU
                samples = []
                for start, end in ranges:
                    plan_id = -next(self._ids)
                    result = await self._load(w, plan_id, start, end, {"kind": "coordinator"}, keep=[])
                    if not result.get("ok"):
                        raise RuntimeError(result.get("error"))
                    timing = await self._probe(w, {"plan": plan_id, "reps": 10, "context": 32})
                    cost = self.profile.unit_cost(start, end)
                    samples += [(cost, t) for t in timing.get("times", [])[2:]]
                    await w.send(Message(T.ACTIVATE, {"keep": [p for p in ([self.active.plan_id] if self.active else []) if p > 0]}))
                # Two sizes back to back: the difference cancels the round trip and fixed costs
                # (a heartbeat RTT measured meanwhile queues behind the payload on a slow link).
                timings = {}
                for size in (1 << 12, 1 << 18):
                    t0 = time.monotonic()
                    await self._probe(w, {"kind": "link", "bytes": size})
                    timings[size] = time.monotonic() - t0
                small, large = sorted(timings)
                self.profile.uploaded(w.id, large - small, max(timings[large] - timings[small], 1e-6), round_trip=timings[small])
            try:
                self.profile.calibrated(w.id, samples)
            except ValueError:  # noisy timings that no line fits: speed from the ratio, no overhead
                self.profile.calibrated_by_ratio(w.id, samples)
            m = self.profile.of(w.id)
            self.event("calibrated", worker=w.id, speed=round(m.speed, 3), overhead_ms=round(m.overhead_s * 1e3, 3),
                       uplink_mb_s=round((m.bandwidth_bytes_per_s or 0) / 1e6, 3))
        except (PipelineBroken, asyncio.TimeoutError, ChannelClosed, RuntimeError, ValueError) as exc:
            self.event("calibration_failed", worker=w.id, error=str(exc) or type(exc).__name__)
        finally:
            self._replan_wanted.set()

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None) -> Deployment:
        """Prepare ``stages`` beside the active plan, then swap it in."""
        dep = Deployment(next(self._plan_ids), tuple(stages), reason, predicted or {})
        self.preparing = dep
        if self.active is None:
            self._set_state(State.PREPARING)
        self.event("prepare", plan=dep.plan_id, stages=[[s.worker_id, s.start, s.end] for s in stages], reason=reason)
        t0 = time.monotonic()
        keep = [dep.plan_id] + ([self.active.plan_id] if self.active else [])
        loads = []
        for i, s in enumerate(stages):
            w = self.workers.get(s.worker_id)
            if w is None:
                raise PipelineBroken(f"worker {s.worker_id} left before deployment")
            loads.append(self._load(w, dep.plan_id, s.start, s.end, self._next_hop(stages, i), keep))
        try:
            results = await asyncio.gather(*loads)
        finally:
            if self.preparing is dep:
                self.preparing = None
        failed = [f"{s.worker_id}: {r.get('error')}" for s, r in zip(stages, results) if not r.get("ok")]
        if failed:
            if self.active is None:
                self._set_state(State.DOWN)
            raise RuntimeError("plan %d failed to load (%s)" % (dep.plan_id, "; ".join(failed)))
        if self.active is None:
            self._set_state(State.COMMITTING)
        old = self.active
        moved: dict = {}
        if old is not None:
            self._gate.clear()  # sequences pause between two steps while the plan changes
            try:
                await self._quiesce()
                moved = await self._migrate(old, dep) if self.migrate_kv else {}
                lost = [s.worker_id for s in stages if s.worker_id not in self.workers]
                if lost:  # a worker of the new plan died while we switched: do not commit it
                    for seq in [q for q, p in self._migrated.items() if p == dep.plan_id]:
                        self._migrated.pop(seq, None)
                    raise PipelineBroken(f"worker {lost[0]} left while plan {dep.plan_id} was being committed")
                self.active = dep
            finally:
                self._gate.set()
        self.active = dep
        for s in stages:  # tell every involved worker which plans to keep
            w = self.workers.get(s.worker_id)
            if w:
                await w.send(Message(T.ACTIVATE, {"keep": [dep.plan_id]}))
        if old:
            for wid in set(old.workers) - set(dep.workers):
                w = self.workers.get(wid)
                if w:
                    await w.send(Message(T.ACTIVATE, {"keep": []}))
        self._set_state(State.UP)
        self.up.set()
        self.ever_up = True
        self.last_switch = time.monotonic()
        fetched = sum(r.get("fetched_bytes", 0) for r in results)
        self.event("up", plan=dep.plan_id, prepare_s=round(time.monotonic() - t0, 3), fetched_bytes=fetched,
                   predicted=dep.predicted, replaced=old.plan_id if old else None, **moved)
        self._spawn(self._prefetch_spare(dep))
        return dep

    async def _quiesce(self, timeout: float = 30.0) -> None:
        """Wait until no step is in the pipeline (its KV is complete and stable)."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.002)

    async def _migrate(self, old: Deployment, new: Deployment) -> dict:
        """Move live sequences' KV from the old stages to the new ones, worker to worker.

        Each sequence moves when that is predicted cheaper than re-running its prefill on the
        new plan (003 table 4.1); otherwise, or if a move fails, it is recomputed by prefill.
        """
        seqs = {seq: length for seq, (plan, length) in self.live.items() if plan == old.plan_id and length > 0}
        if not seqs:
            return {}
        workers = {**{w: self.workers.get(w) for w in old.workers}, **{w: self.workers.get(w) for w in new.workers}}
        if any(w is None or w.relay for w in workers.values()):
            return {"kv_recomputed": len(seqs)}
        kv_per_token = {u.index: u.kv_bytes_per_token for u in self.manifest.units}
        loop = asyncio.get_running_loop()
        futures: dict[str, list[asyncio.Future]] = {}
        moved_bytes = 0
        recompute = []
        for seq, length in sorted(seqs.items()):
            if not self._move_is_cheaper(old, new, length):
                recompute.append(seq)
                continue
            for b in new.stages:
                for a in old.stages:
                    lo, hi = max(a.start, b.start), min(a.end, b.end)
                    if lo >= hi or not any(kv_per_token[u] for u in range(lo, hi)):
                        continue
                    move = next(self._ids)
                    fut = self._moves[move] = loop.create_future()
                    futures.setdefault(seq, []).append(fut)
                    moved_bytes += length * sum(kv_per_token[u] for u in range(lo, hi))
                    await workers[a.worker_id].send(Message(T.KV_EXPORT, {
                        "seq": seq, "plan": old.plan_id, "start": lo, "end": hi, "to_plan": new.plan_id,
                        "url": workers[b.worker_id].hello.get("data_url"), "move": move}))
        ok = 0
        # All moves run at once; whatever has not arrived within the bound is rebuilt by replay.
        everything = [f for futs in futures.values() for f in futs]
        await asyncio.wait(everything, timeout=MOVE_TIMEOUT_S) if everything else None
        for seq, futs in futures.items():
            if all(f.done() and not f.cancelled() and f.exception() is None and f.result().get("ok") for f in futs):
                self._migrated[seq] = new.plan_id
                ok += 1
            else:
                recompute.append(seq)
        for f in everything:
            if not f.done():
                f.cancel()
        return {"kv_moved": ok, "kv_moved_bytes": moved_bytes, "kv_recomputed": len(recompute)}

    def _move_is_cheaper(self, old: Deployment, new: Deployment, length: int) -> bool:
        kv_bytes = length * sum(u.kv_bytes_per_token for u in self.manifest.units)
        bandwidth = min(self.profile.link_of(w)[1] for w in old.workers)
        move_s = kv_bytes / bandwidth + max(self.profile.link_of(w)[0] for w in old.workers)
        stage_s = [self.profile.unit_cost(s.start, s.end) / self.profile.of(s.worker_id).speed for s in new.stages]
        # An exact rebuild replays each token as a decode step; the stages do so as a pipeline.
        recompute_s = sum(stage_s) + (length - 1) * max(stage_s)
        return move_s < recompute_s

    async def _prefetch_spare(self, dep: Deployment) -> None:
        """Fetch the files of the spare plan ahead of a failure (000's shadow assignment)."""
        spare = getattr(self.plan_fn, "spare", None)
        if spare is None:
            return
        try:
            stages = spare(self, dep)
        except Exception as exc:  # a spare is an optimisation: never let it disturb serving
            self.event("spare_failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if not stages:
            return
        self.spare = stages
        plan_id = -next(self._ids)
        for s in stages:
            w = self.workers.get(s.worker_id)
            if w is None:
                continue
            fut = w.loads[plan_id] = asyncio.get_running_loop().create_future()
            # warm: build the session too when the worker's budget allows (else it holds the files)
            await w.send(Message(T.LOAD, {"plan": plan_id, "start": s.start, "end": s.end, "warm": True, "keep": [],
                                          "graph": self.package.stage_graph(s.start, s.end, self._precision(w)),
                                          "files": list(self.manifest.stage_files(s.start, s.end, self._precision(w))),
                                          "next": {"kind": "coordinator"}}))
        self.event("spare", stages=[[s.worker_id, s.start, s.end] for s in stages])

    @property
    def kv_capacity(self) -> int | None:
        """KV positions (summed over sequences) the active plan's declared budgets hold at the
        tightest stage (None: no budget declared, the hosts' RAM bounds it)."""
        dep = self.active
        if dep is None:
            return None
        caps = []
        for s in dep.stages:
            w = self.workers.get(s.worker_id)
            if w is None or not (w.hello.get("emulation") or {}).get("memory_budget"):
                continue
            units = self.manifest.units[s.start:s.end]
            weights = sum(self.manifest.variant(u.index, self._precision(w)).weight_bytes for u in units)
            per_position = sum(u.kv_bytes_per_token for u in units)
            if per_position:
                caps.append(max(0, w.memory_bytes - weights - RUNTIME_OVERHEAD_BYTES) // per_position)
        return min(caps) if caps else None

    def kv_plan_positions(self) -> int:
        """KV positions a plan must hold: one request at full context, or what the running
        requests may grow to (a stage's pool is sequences x the longest), whichever is more."""
        full = self.profile.context_tokens
        if not self.reserved:
            return full
        return max(full, len(self.reserved) * max(self.reserved.values()))

    def _precision(self, w: WorkerHandle) -> str | None:
        return w.hello.get("precision") or self.settings.precision

    def _next_hop(self, stages: list[StageAssignment], i: int) -> dict:
        if i == len(stages) - 1:
            return {"kind": "coordinator"}
        nxt = self.workers[stages[i + 1].worker_id]
        relay = nxt.relay or self.workers[stages[i].worker_id].relay
        return {"kind": "worker", "id": nxt.id, "url": nxt.hello.get("data_url"), "relay": relay}

    # -- requests -------------------------------------------------------------------------------
    def new_sequence(self, prompt_ids: list[int], params: GenerationParams, decode_fn) -> SequenceState:
        limit = self.manifest.max_context
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the context of {limit} tokens")
        return SequenceState(list(prompt_ids), params, decode_fn, self.manifest.eos_ids)

    async def stream(self, state: SequenceState, rid: str | None = None) -> AsyncIterator[TextDelta]:
        """Run one sequence to its end, yielding text as it is produced."""
        rid = rid or f"r{next(self._ids)}"
        epoch = 0
        seq = f"{rid}.{epoch}"
        fed_plan: int | None = None  # plan whose workers hold this sequence's KV
        self.requests_in_flight += 1
        self.reserved[rid] = len(state.prompt_ids) + state.params.max_tokens
        try:
            paused_at = None
            broken = 0
            while not state.finished:
                step = len(state.generated)
                dep = await self._wait_up()
                if fed_plan != dep.plan_id and self._migrated.pop(seq, None) == dep.plan_id:
                    fed_plan = dep.plan_id  # its KV moved with its layers: carry on
                if fed_plan != dep.plan_id:
                    if fed_plan is not None:  # the plan changed under us: rebuild KV by prefill
                        await self._drop(seq, fed_plan)
                        self.live.pop(seq, None)
                        epoch += 1
                        seq = f"{rid}.{epoch}"
                    feed = state.all_ids
                else:
                    feed = state.generated[-1:]
                replay_from = len(state.prompt_ids) if len(feed) > len(state.prompt_ids) else None
                try:
                    token, record = await self._step(dep, seq, step, feed, state.params, rid, replay_from)
                except PipelineBroken as exc:
                    if paused_at is None:
                        paused_at = time.monotonic()
                        self.event("pause", request=rid, step=step, why=str(exc))
                    fed_plan = -1
                    broken += 1
                    # Always yield before retrying: a send to a closed channel fails without
                    # awaiting, and the task that takes the dead worker out must get to run.
                    await asyncio.sleep(min(0.01 * broken, 0.25))
                    continue
                broken = 0
                if paused_at is not None:
                    self.event("recovered", request=rid, step=step, seconds=round(time.monotonic() - paused_at, 3), plan=dep.plan_id)
                    paused_at = None
                fed_plan = dep.plan_id
                self.live[seq] = (dep.plan_id, len(state.all_ids))
                delta = state.push(token)
                self._learn(dep, record)
                self.on_step(record)
                yield delta
        finally:
            self.requests_in_flight -= 1
            self.reserved.pop(rid, None)
            self._go(self.lanes.leave(rid))
            self.live.pop(seq, None)
            self._migrated.pop(seq, None)
            # Cancelled callers cannot await, so clean up in a task of its own.
            self._spawn(self._finish(seq, fed_plan if fed_plan not in (None, -1) else None))

    def _spawn(self, coro) -> asyncio.Task:
        """A background task with a strong reference (the loop keeps only weak ones)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _finish(self, seq: str, plan: int | None) -> None:
        """Free a sequence's KV once no step of it is still in the pipeline."""
        entry = self._pending.get(seq)
        if entry is not None:  # a step in flight would re-create the KV after an early DROP
            try:
                await asyncio.wait_for(asyncio.shield(entry[2]), timeout=self.settings.step_timeout_s)
            except (Exception, asyncio.CancelledError):
                pass
            if self._pending.get(seq) is entry:
                self._pending.pop(seq, None)
            plan = entry[1]
        if plan is not None:
            await self._drop(seq, plan)

    def _learn(self, dep: Deployment, record: StepRecord) -> None:
        """Decode steps (one position) refine each worker's measured speed."""
        ranges = {s.worker_id: (s.start, s.end) for s in dep.stages}
        for entry in record.timings if record.first_in_batch else ():
            worker, compute, positions = entry[0], entry[1], entry[2]
            batch = entry[4] if len(entry) > 4 else 1
            if positions == 1 and worker in ranges:
                self.profile.step(worker, *ranges[worker], compute, batch)
        self.recent_steps.append((record.tokens_in, record.wall_s))

    async def _wait_up(self) -> Deployment:
        while True:
            if not self._gate.is_set():
                await self._gate.wait()
            if self.active is not None and self.up.is_set() and self._gate.is_set():
                return self.active
            if not self.workers and self.state is State.DOWN and self._no_workers_since() > self.settings.step_timeout_s:
                raise RequestFailed("no workers are connected")
            try:
                await asyncio.wait_for(self.up.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    def _no_workers_since(self) -> float:
        return time.monotonic() - self.state_since

    async def _step(self, dep: Deployment, seq: str, step: int, feed: list[int], params: GenerationParams, rid: str,
                    replay_from: int | None = None):
        """One step of one sequence: a decode step goes out with its lane, a prefill alone."""
        t0 = time.perf_counter()
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = (step, dep.plan_id, fut)
        sampling = {"do_sample": not params.greedy, "temperature": params.temperature or 1.0, "top_k": params.top_k,
                    "top_p": params.top_p, "uniform": uniform_draw(params.seed, step) if not params.greedy else 0.0}
        item = {"seq": seq, "step": step, "rid": rid, "sampling": sampling}
        # A replay rebuilds KV exactly as first computed: the prompt as one prefill, then each later
        # token as its own decode step (one prefill over everything takes other kernel paths and
        # can flip a near-tie). Sent as separate frames, the stages work on them as a pipeline;
        # only the last frame's token comes back.
        chunks = [feed[:replay_from]] + [[t] for t in feed[replay_from:]] if replay_from else [feed]
        out = _OutStep(dep, item, chunks[-1], fut)
        if len(feed) == 1:
            self._go(self.lanes.submit(LaneItem(rid, dep.plan_id, out), len(dep.stages)))
        else:
            self._go(self.lanes.leave(rid))  # a prefill travels alone; the sequence re-joins a lane after it
            for chunk in chunks[:-1]:
                await self._send_forward([_OutStep(dep, {**item, "partial": True}, chunk, fut)])
            await self._send_forward([out])
        try:
            # shield: a cancelled caller must leave the future for _finish to wait on
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout=self.settings.step_timeout_s)
        except asyncio.TimeoutError:
            self._pending.pop(seq, None)
            raise PipelineBroken(f"no token for {seq} step {step} within {self.settings.step_timeout_s} s") from None
        finally:
            self._go(self.lanes.returned(rid))
        wall = time.perf_counter() - t0
        record = StepRecord(rid, len(feed), wall, reply.get("timings", []), coordinator_s=out.sent_at - t0 if out.sent_at else 0.0,
                            first_in_batch=reply.get("first", True))
        return int(reply["token"]), record

    def _go(self, batches: list[list[LaneItem]]) -> None:
        for batch in batches:
            self._spawn(self._send_forward([item.payload for item in batch]))

    def _arm_lane(self, index: int, departure: int) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.settings.lane_wait_s, lambda: self._go(self.lanes.expire(index, departure)))

    async def _send_forward(self, steps: list["_OutStep"]) -> None:
        """Send steps of one plan to its first stage as one frame (one batch at every stage)."""
        steps = [s for s in steps if not s.fut.done()]  # failed while waiting for its lane
        if not steps:
            return
        dep = steps[0].dep
        first = self.workers.get(dep.stages[0].worker_id)
        fields = {"plan": dep.plan_id, "batch": [s.item for s in steps]}
        msg = Message(T.FORWARD, fields, {"x": np.array([s.feed for s in steps], np.int64)})
        now = time.perf_counter()
        for s in steps:
            s.sent_at = now
        try:
            if first is None:
                raise ChannelClosed(f"worker {dep.stages[0].worker_id} is gone")
            await first.send(msg)
        except ChannelClosed:
            if first is not None:
                self._spawn(self._lose(first, "disconnected"))
            for s in steps:
                if self._pending.get(s.item["seq"], (None, None, None))[2] is s.fut:
                    del self._pending[s.item["seq"]]
                if not s.fut.done():
                    s.fut.set_exception(PipelineBroken(f"worker {dep.stages[0].worker_id} is gone"))

    async def _drop(self, seq: str, plan: int) -> None:
        dep = self.active if self.active and self.active.plan_id == plan else None
        targets = dep.workers if dep else tuple(self.workers)
        for wid in targets:
            w = self.workers.get(wid)
            if w:
                try:
                    await w.send(Message(T.DROP, {"seq": seq}))
                except ChannelClosed:
                    pass

    # -- views ----------------------------------------------------------------------------------
    def status(self) -> dict:
        dep = self.active
        return {
            "state": self.state.value,
            "model": self.manifest.name,
            "n_units": self.n_units,
            "units": [{"index": u.index, "name": u.name, "kind": u.kind} for u in self.manifest.units],
            "plan": None if dep is None else {
                "id": dep.plan_id, "reason": dep.reason, "predicted": dep.predicted,
                "stages": [{"worker": s.worker_id, "start": s.start, "end": s.end} for s in dep.stages],
            },
            "workers": [{
                "id": w.id, "name": w.name, "kind": w.hello.get("kind", "native"), "memory_bytes": w.memory_bytes,
                "data_url": w.hello.get("data_url"), "pid": w.hello.get("pid"),
                "rtt_ms": None if w.rtt_s is None else round(w.rtt_s * 1e3, 2), "emulation": w.hello.get("emulation"),
                "stats": w.stats, "units": next(([s.start, s.end] for s in dep.stages if s.worker_id == w.id), None) if dep else None,
            } for w in self.workers.values()],
            "requests_in_flight": self.requests_in_flight,
            "state_seconds": {k: round(v, 3) for k, v in self.state_durations().items()},
        }
