"""The simulation's worker: the shipped worker core (``worker.core``) with a fake model and
in-memory channels in place of ONNX Runtime and sockets.

It carries out the core's commands as the real shell does, except that a stage computes the
fake model of ``cluster.sim`` (``sim_model.FakeStages``: per-unit integer state standing in for
KV) and frames travel through the simulated network. Faults are injected here: a stalled worker, one that drops
activation frames for a while, malformed frames, a killed process."""

from __future__ import annotations

import asyncio
import logging
import random

import numpy as np

from ..net.channel import ChannelClosed
from .. import PROTOCOL_VERSION
from ..net.messages import Bye, Drop, ErrorCode, Forward, Hello, Kv, KvExport, Load, Ping, Probed, Welcome, parse
from ..net.protocol import Message, ProtocolError, decode, encode
from ..worker import core
from .profiling import RUNTIME_OVERHEAD_BYTES
from .sim_model import FakeStages

log = logging.getLogger("edgepipe.sim")
IN_ORDER = (Forward, Kv, Drop, KvExport)


class FakeWorker:
    """Speaks the worker protocol over a ``SimChannel`` through the real worker core."""

    def __init__(self, world, name: str, memory: int, slowdown: float = 1.0, kernel: bool = True, budget: int | None = None):
        self.world, self.name, self.memory, self.slowdown = world, name, memory, slowdown
        self.kernel = kernel  # its hello says the GGUF kernel library loaded (it is sent the `gguf` form where the package has one)
        self.url = f"sim://{name}"
        self.dead = False
        self.stalled_until = 0.0
        self.dropping_until = 0.0  # answers pings but drops activation frames until then
        self.refusing_kv_until = 0.0  # fails every KV frame it is sent until then (a KV move or checkpoint that fails)
        # the fake model's slowness is in its compute; the core adds no emulated wait of its own
        # the budget it enforces: what it declares, unless it overstates its memory (``budget``)
        self.state = core.WorkerState(name, budget_bytes=memory if budget is None else budget, data_url=self.url)
        self.model = FakeStages(name)  # its stages' fake KV and cached prompt blocks (``sim_model``)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.control = None
        self.tasks: list[asyncio.Task] = []
        self.malformed = 0  # malformed frames still to send
        from .sim import Pipe

        self.data = Pipe(lambda frame: self.queue.put_nowait(parse(frame)))  # frames from other workers' data ports, typed as the real port does

    @property
    def computed(self) -> int:
        return self.state.computed

    def start(self) -> None:
        self.world.net.ports[self.url] = self
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._life()), loop.create_task(self._compute())]

    def kill(self) -> None:
        self.dead = True
        for t in self.tasks:
            t.cancel()
        if self.control is not None:
            self.control.closed = True
            self.control._told = True
            self.control._deliver(None)

    async def _stall(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < self.stalled_until:
            await asyncio.sleep(self.stalled_until - loop.time())

    def hello(self) -> Hello:
        """Its declaration, typed as the shipped worker's (``worker.shell``): a native worker whose
        emulated memory budget is all of its memory."""
        return Hello(name=self.name, token=None, protocol=PROTOCOL_VERSION, kind="native", memory_bytes=self.memory, threads=1,
                     data_url=self.url, held=(), emulation={"memory_budget": self.memory}, native_kernel="gguf" if self.kernel else None)

    async def _life(self) -> None:
        """Join, serve until the channel closes, then reconnect with jittered backoff (forever)."""
        from .sim import sim_pair

        rng = random.Random(f"{self.world.seed}-{self.name}")
        backoff = 0.2
        while not self.dead:
            mine, theirs = sim_pair(self.world.net, self.name)
            self.control = mine
            self.world.spawn(self.world.coordinator.attach(theirs))
            try:
                await mine.send(encode(self.hello().to_message()))
                reply = parse(decode(await mine.recv()))
                if isinstance(reply, Welcome):
                    backoff = 0.2
                    await self.feed(core.Joined(reply.worker_id))
                    await self._serve(mine)
            except ChannelClosed:
                pass
            await asyncio.sleep(backoff * (1 + rng.random()))
            backoff = min(backoff * 2, 2.0)

    async def _serve(self, ch) -> None:
        from .sim import bad_frame

        while True:
            await self._stall()
            if self.malformed:
                self.malformed -= 1
                await ch.send(bad_frame(self.malformed))
            msg = decode(await ch.recv())
            await self._stall()
            try:
                typed = parse(msg)
            except ProtocolError as exc:  # the coordinator sent what the worker core cannot read: a bug
                log.error("%s: bad frame from the coordinator: %s", self.name, exc)
                continue
            if isinstance(typed, Bye):
                return
            if isinstance(typed, IN_ORDER):
                self.queue.put_nowait(typed)
            elif isinstance(typed, Ping):
                await self.feed(core.Pinged(typed.t, 0, self.queue.qsize(), 0.0))
            elif isinstance(typed, Load):
                self.world.spawn(self._quietly(typed))
            elif not isinstance(typed, Message):
                await self.feed(typed)

    async def _compute(self) -> None:
        while True:
            msg = await self.queue.get()
            await self._stall()
            if isinstance(msg, Forward) and asyncio.get_running_loop().time() < self.dropping_until:
                continue
            try:
                await self.feed(msg)
            except (ChannelClosed, ProtocolError):
                pass

    async def _quietly(self, event) -> None:
        try:
            await self.feed(event)
        except ChannelClosed:
            pass

    # -- carrying out the core's commands -----------------------------------------------------------
    async def feed(self, event) -> None:
        self.state, commands = core.handle(self.state, event)
        for cmd in commands:
            await self._execute(cmd)

    async def _execute(self, cmd) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(cmd, core.SendControl):
            await self._send(cmd.msg)
        elif isinstance(cmd, core.SendPeer):
            target = self.world.net.ports.get(cmd.url)
            cut = self.world.net.peer_cut_until.get(self.name, 0.0) > loop.time()
            if target is None or target.dead or cut:
                if cmd.about is not None:
                    await self.feed(core.Failed(cmd.about, ErrorCode.UNREACHABLE, f"next hop unreachable: {cmd.url}"))
                return
            target.data.put(loop.time() + 0.001, cmd.msg)
        elif isinstance(cmd, core.RunStage):
            await self.feed(await self._run(cmd))
        elif isinstance(cmd, core.Wait):
            await asyncio.sleep(cmd.seconds)
        elif isinstance(cmd, core.DropSequence):
            self.model.drop(cmd.seq, cmd.graphs)
        elif isinstance(cmd, core.KeepSessions):
            self.model.keep_only(cmd.graphs, cmd.plans)
        elif isinstance(cmd, core.Forget):
            while not self.queue.empty():
                self.queue.get_nowait()
            self.model.forget()
        elif isinstance(cmd, core.FetchFiles):
            await asyncio.sleep(0.2 * self.slowdown)
            await self._stall()
            units = cmd.load.end - cmd.load.start
            await self.feed(core.Fetched(cmd.load, 0, units * _unit_bytes() + RUNTIME_OVERHEAD_BYTES))
        elif isinstance(cmd, core.BuildSession):
            load = cmd.load
            self.model.kv.setdefault(load.graph, {})
            from .sim import N_UNITS, VOCAB

            # The fake model passes integers between stages: every stage takes "token ids".
            session = core.Session(load.graph, True, load.end == N_UNITS, 0, tuple(range(load.start, load.end)), VOCAB)
            await self.feed(core.Built(load, session, cmd.weight_bytes, cmd.fetched_bytes, 0.2 * self.slowdown, False))
        elif isinstance(cmd, core.ExportKv):
            await self._export(cmd)
        elif isinstance(cmd, core.ImportKv):
            if loop.time() < self.refusing_kv_until:
                await self.feed(core.Failed(cmd.kv, ErrorCode.INTERNAL, f"{self.name} refuses KV (a fault)"))
            else:
                await self.feed(self.model.import_kv(cmd))
        elif isinstance(cmd, core.TimeStage):
            await self.feed(core.StageTimed(cmd.probe, [0.01 * self.slowdown * cmd.rows] * cmd.reps))  # compute-bound, like its steps
        elif isinstance(cmd, core.SendLinkPayload):
            await self._send(Probed(cmd.probe, True).to_message({"payload": np.zeros(cmd.nbytes, np.uint8)}))
        elif isinstance(cmd, core.MeasurePeer):
            await self.feed(core.PeerMeasured(cmd.probe, 0.001, 1e8))

    async def _send(self, msg: Message) -> None:
        if self.control is not None:
            await self.control.send(encode(msg))

    async def _run(self, cmd: core.RunStage):
        """A stage's step: its compute time on the virtual clock, then the fake model's result."""
        stage = next(s for s in self.state.stages.values() if s.graph == cmd.graph)
        await asyncio.sleep(0.002 * np.shape(cmd.x)[1] * (stage.end - stage.start) * len(cmd.forward.batch) * self.slowdown)
        await self._stall()
        return self.model.run(cmd, stage.start, stage.end, 0.002 * self.slowdown, self.state.joins)

    async def _export(self, cmd: core.ExportKv) -> None:
        e = cmd.export
        target = self.world.net.ports.get(e.url)
        start = next((s.start for s in self.state.stages.values() if s.graph == cmd.graph), 0)
        frame = self.model.export_frame(cmd, start) if target is not None and not target.dead else "cannot export"
        if isinstance(frame, str):
            await self.feed(core.ExportFailed(e, frame))
        else:
            target.data.put(asyncio.get_running_loop().time() + 0.001, frame)

def _unit_bytes() -> int:
    from .sim import UNIT_BYTES

    return UNIT_BYTES
