"""The simulation's worker: the shipped worker shell (``worker.shell.Worker``: its receive loop,
queue, ``_execute``, peers and reconnect with backoff) on fake ports (``worker.ports``).

Only the ports are fakes, as TigerBeetle's simulator swaps only its message bus: the control
channel and the peer links are ``sim``'s in-memory channels (latency, partitions), the data port
runs the real frame checks (``dataport.data_loop``) on them, the compute is the fake model of
``sim_model`` (its time on the virtual clock), and downloads take a fixed virtual time. Faults are
injected here: a stalled worker, one that drops activation frames for a while, one that refuses
KV, malformed frames, a killed process, and on the direct token path (a last stage feeding the next
step itself: into its own queue on a one-stage plan, to the plan's first stage over a peer link on
a plan of several) the loss of that feed or of the token's copy to the coordinator."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import numpy as np

from ...net.channel import ChannelClosed
from ...net.messages import ErrorCode, Forward, parse
from ...net.protocol import MessageType as T, decode
from ...runtime.devices import CPU
from ...worker import Worker, WorkerSettings, core
from ...worker.dataport import data_loop
from ...worker.ports import Host, WorkerPorts
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from .sim_model import FakeStages


class FakeWorker:
    """One simulated worker process and the faults it can be given (``simrun._fault``)."""

    def __init__(self, world, name: str, memory: int, slowdown: float = 1.0, kernel: bool = True, budget: int | None = None):
        self.world, self.name, self.memory, self.slowdown = world, name, memory, slowdown
        self.url, self.dead, self.malformed, self.tasks = f"sim://{name}", False, 0, []
        self.stalled_until = self.dropping_until = self.refusing_kv_until = 0.0
        self.losing_feed_until = self.losing_copy_until = 0.0  # the direct path's faults: the stage's own next step / the coordinator's copy
        self.refusing_feed_until = 0.0  # the direct path: sends of its feed to the first stage fail (``refuse_feed``)
        self.fed = self.feeds_lost = self.copies_lost = 0  # entries the stage fed itself; feeds and copies the faults lost
        self.fed_first = 0  # of those fed, the ones sent to the plan's first stage (a plan of several stages)
        self.model = FakeCompute(self)  # its stages' fake KV and cached prompt blocks
        self.admit = self.receive = self.feeds = None  # the shell's, given to the data port
        rng = random.Random(f"{world.seed if world else 0}-{self.name}")
        # the fake model's slowness is in its compute (``slowdown`` here): the core adds no emulated wait
        ports = WorkerPorts(Host(CPU, "gguf" if kernel else None), self._connect, self, _DataPort(self), self, self.model,
                            clock=lambda: asyncio.get_running_loop().time(), draw=rng.random, lag_tick_s=None, loopback=self._loopback)
        self.shell = Worker(WorkerSettings("sim://coordinator", name, memory_bytes=memory, threads=1), ports)
        if budget is not None:  # it enforces less than it declares (it overstates its memory)
            self.shell.state = replace(self.shell.state, budget_bytes=budget)

    @property
    def control(self):
        return self.shell.control

    def hello(self):
        return self.shell.hello()

    def start(self) -> None:
        self.tasks = [asyncio.get_running_loop().create_task(self.shell.run())]

    def kill(self) -> None:
        """The process dies: its connections break at once (no bye) and its tasks stop."""
        self.dead = True
        if self.shell.control is not None:
            self.shell.control.cut()
        for task in [*self.tasks, *self.shell._background]:
            task.cancel()

    async def _stall(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < self.stalled_until:
            await asyncio.sleep(self.stalled_until - loop.time())

    def _loopback(self, forward: Forward) -> None:
        """The stage's own next step (the direct token path), unless a fault loses it: its token
        then reached the coordinator but not the stage's next step."""
        if asyncio.get_running_loop().time() < self.losing_feed_until:
            self.feeds_lost += 1
            return
        self.fed += len(forward.batch)
        self.shell.queue.put_nowait(forward)

    def _losing_copy(self, frame: bytes) -> bool:
        """A TOKEN frame of steps the stage fed itself, lost on its way to the coordinator (the
        stage went on with it): only while the fault lasts."""
        if asyncio.get_running_loop().time() >= self.losing_copy_until:
            return False
        msg = decode(frame)
        if msg.type is T.TOKEN and any(e.fed for e in parse(msg).entries()):
            self.copies_lost += 1
            return True
        return False

    def _dropping(self, frame) -> bool:
        return asyncio.get_running_loop().time() < self.dropping_until and decode(frame).type is T.FORWARD

    # -- control port -------------------------------------------------------------------------------
    async def _connect(self) -> "FakeControl":
        from .sim import sim_pair

        mine, theirs = sim_pair(self.world.net, self.name)
        self.world.spawn(self.world.coordinator.attach(theirs))
        return FakeControl(self, mine)

    # -- peers (the shell as ``ports.peers``) -------------------------------------------------------------
    async def open(self, url: str, plan: int, secret, fingerprint) -> "PeerLink":
        from .sim import SimChannel

        target = self.world.net.ports.get(url)
        self._check_link(target, url)
        check = lambda expected: expected == secret  # noqa: E731 - the handshake's check (core.admit_data, core.admit_feed)
        if target.admit(plan, check) is None:
            raise ChannelClosed(f"{url}: 401 (no valid credentials for plan {plan})")
        feed = bool(target.feeds(plan, check))
        mine, theirs = SimChannel(self.world.net, f"{self.name}>{url}", url), SimChannel(self.world.net, f"{url}<{self.name}", self.name)
        mine.other, theirs.other = theirs, mine
        self.world.spawn(data_loop(theirs, plan, target._received, feed))
        return PeerLink(self, target, mine, feed)

    async def _received(self, typed) -> None:
        if not (isinstance(typed, Forward) and asyncio.get_running_loop().time() < self.dropping_until):
            await self.receive(typed)

    def _check_link(self, target, url: str) -> None:
        if self.dead or target is None or target.dead or self.world.net.peer_cut_until.get(self.name, 0.0) > asyncio.get_running_loop().time():
            raise ChannelClosed(f"next hop unreachable: {url}")

    async def measure(self, url, secret, fingerprint, most_bytes, shape=None) -> tuple[float, float]:
        return 0.001, 1e8

    # -- blob fetcher ------------------------------------------------------------------------------------
    async def fetch(self, load) -> tuple[int, int, tuple]:
        from .sim import UNIT_BYTES

        await asyncio.sleep(0.2 * self.slowdown)
        await self._stall()
        return 0, (load.end - load.start) * UNIT_BYTES + RUNTIME_OVERHEAD_BYTES, ()

    def path(self, sha: str) -> str:
        return sha

    def held(self) -> list[str]:
        return []


class FakeCompute(FakeStages):
    """The compute port: the fake model (``sim_model``), its time on the virtual clock, and the
    worker's stall and KV-refusal faults."""

    def __init__(self, worker: FakeWorker):
        super().__init__(worker.name)
        self.worker = worker

    async def build(self, load, path) -> core.Session:
        return self.session(load)  # a build takes no virtual time: the download's 0.2 s stands for both

    async def run(self, cmd: core.RunStage, joins: int, single_thread: bool):
        start, end = self.ranges[cmd.graph]
        slowdown = self.worker.slowdown
        await asyncio.sleep(0.002 * np.shape(cmd.x)[1] * (end - start) * len(cmd.forward.batch) * slowdown)
        await self.worker._stall()
        return self.step(cmd, 0.002 * slowdown, joins)

    async def export(self, cmd: core.ExportKv) -> bytes:
        await self.worker._stall()
        return self.export_frame(cmd)

    async def import_kv(self, cmd: core.ImportKv):
        await self.worker._stall()
        if asyncio.get_running_loop().time() < self.worker.refusing_kv_until:
            return core.Failed(cmd.kv, ErrorCode.INTERNAL, f"{self.name} refuses KV (a fault)")
        return super().import_kv(cmd)

    async def time_stage(self, cmd: core.TimeStage, session, slowdown, roofline=None) -> core.StageTimed:
        return core.StageTimed(cmd.probe, [0.01 * self.worker.slowdown * cmd.rows] * cmd.reps)  # compute-bound, like its steps


class _DataPort:
    """Its data port: registered in the simulated network; each peer link is served by the real
    frame checks (``dataport.data_loop``)."""

    def __init__(self, worker: FakeWorker):
        self.worker, self.url, self.fingerprint = worker, worker.url, None

    async def start(self, admit, receive, shape=None, feeds=lambda plan, check: False):
        self.worker.admit, self.worker.receive, self.worker.feeds = admit, receive, feeds
        self.worker.world.net.ports[self.url] = self.worker


class FakeControl:
    """The worker's end of its control channel, where stalls and malformed frames are injected."""

    def __init__(self, worker: FakeWorker, channel):
        self.worker, self.channel, self.peer = worker, channel, "coordinator"

    async def send(self, frame: bytes) -> None:
        if not self.worker._losing_copy(frame):
            await self.channel.send(frame)

    async def recv(self) -> bytes:
        w = self.worker
        while True:
            await w._stall()
            if w.malformed:
                w.malformed -= 1
                from .sim import bad_frame

                await self.channel.send(bad_frame(w.malformed))
            frame = await self.channel.recv()
            await w._stall()
            if not w._dropping(frame):
                return frame

    async def close(self, reason: str = "") -> None:
        await self.channel.close(reason)

    def cut(self) -> None:
        """A dead process: both ends see the connection end, and nothing more leaves."""
        self.channel.closed = self.channel._told = True
        self.channel._deliver(None)


class PeerLink:
    """A connection to another simulated worker's data port: sends fail while either end is dead
    or this worker's peer links are cut (``partition_peer``); on a ``feed`` link (a last stage
    feeding its plan's first stage, the direct token path) the ``lose_feed`` fault loses frames."""

    def __init__(self, worker: FakeWorker, target: FakeWorker, channel, feed: bool = False):
        self.worker, self.target, self.channel, self.peer, self.feed = worker, target, channel, target.url, feed

    async def send(self, frame: bytes) -> None:
        self.worker._check_link(self.target, self.target.url)
        if self.feed:
            if asyncio.get_running_loop().time() < self.worker.refusing_feed_until:
                raise ChannelClosed(f"{self.peer}: the first stage refused the feed")
            if asyncio.get_running_loop().time() < self.worker.losing_feed_until:
                self.worker.feeds_lost += 1  # its token reached the coordinator, the next step not the first stage
                return
            fed = len(parse(decode(frame)).batch)
            self.worker.fed += fed
            self.worker.fed_first += fed
        await self.channel.send(frame)

    async def recv(self) -> bytes:
        return await self.channel.recv()

    async def close(self, reason: str = "") -> None:
        await self.channel.close(reason)
