"""Deterministic simulation of the control plane: the real ``Coordinator`` against fake workers.

Everything runs on one asyncio loop whose clock is virtual (``VirtualLoop``: when nothing is
ready, time jumps to the next timer), so a 60 s fault schedule takes milliseconds and a seed
replays exactly. Fake workers speak the real wire protocol over in-memory channels whose
frames take a simulated latency and are held while a partition lasts. They compute a fake
model that behaves like a real one where it matters: each unit keeps per-sequence state (its
"KV"), a token depends on every earlier position through every unit, and splitting the units
over stages does not change the result, so ``reference`` gives the exact tokens and a lost or
half-moved KV shows up as a wrong token.

``Schedule.random(seed)`` draws workers, requests and faults; ``run(schedule)`` plays it and
returns a ``Report`` whose ``violations`` lists every broken invariant.
"""

from __future__ import annotations

import asyncio
import random
import selectors
import struct
from dataclasses import dataclass

import numpy as np

from ..net.channel import ChannelClosed
from ..net.messages import ErrorCode
from ..net.protocol import Message, MessageType as T, ProtocolError, decode, encode
from ..runtime.sequence import GenerationParams
from .coordinator import Coordinator, CoordinatorSettings
from .placement import proportional_split
from .profiling import RUNTIME_OVERHEAD_BYTES
from .steps import RequestFailed
from .scheduling import Admission
from .state import Phase

MASK = (1 << 61) - 1
VOCAB = 1000
N_UNITS = 8
UNIT_BYTES = 100_000_000
UNIT_KV_ROOM = 1000 * 256  # a unit's KV room as a real worker keeps it: kv_bytes_per_token x min(KV_RESERVE_TOKENS, max_context)
SETTINGS = dict(heartbeat_s=1.0, dead_after_s=2.0, lose_after_s=6.0, step_timeout_s=8.0, load_timeout_s=6.0,
                capacity_wait_s=10.0, max_wait_s=30.0, replan_every_s=5.0, calibrate=False, prefix_block=2, prefix_cache_positions=24)
REQUEST_BOUND_S = SETTINGS["max_wait_s"] + SETTINGS["step_timeout_s"] + 12.0  # admitted -> tokens or a clear error
UP_BOUND_S = 30.0  # last fault healed -> Up, when the live workers can hold the model
FAULTS = ("kill", "stall", "slow", "partition_coord", "partition_peer", "reconnect", "join_late", "restart", "malformed", "bad_request",
          "drop_work", "forget_prefixes")
# Faults after which a worker may rightly be quarantined (it took work and computed nothing).
QUARANTINE_FAULTS = ("stall", "partition_coord", "drop_work")


# -- virtual time -----------------------------------------------------------------------------------
class _Selector(selectors.SelectSelector):
    def __init__(self, loop: "VirtualLoop"):
        super().__init__()
        self.vloop = loop

    def select(self, timeout=None):
        # Only the loop's own wake-up pipe registered (no thread in the simulation writes to it):
        # nothing can be ready, so no system call.
        ready = super().select(0) if len(self.get_map()) > 1 else []
        if not ready and timeout:
            self.vloop.now += timeout
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now = 0.0
        super().__init__(_Selector(self))

    def time(self) -> float:
        return self.now


# -- the fake model ------------------------------------------------------------------------------------
def _unit(h: int, x: int, u: int) -> tuple[int, int]:
    h = ((h * 1_000_003) ^ (x + 7919 * (u + 1))) & MASK
    return h, ((h >> 7) * 2_654_435_761 + x) & MASK


def reference(prompt: list[int], n: int) -> list[int]:
    """The tokens a correct pipeline produces (greedy): every unit, every position, in order."""
    h = [0] * N_UNITS
    out, ids = [], list(prompt)
    for pos in range(len(prompt) + n - 1):
        x = ids[pos]
        for u in range(N_UNITS):
            h[u], x = _unit(h[u], x, u)
        if pos >= len(prompt) - 1:
            out.append(x % VOCAB)
            ids.append(x % VOCAB)
    return out


@dataclass
class _Unit:
    index: int
    name: str
    kind: str
    kv_bytes_per_token: int = 1000
    out_bytes_per_token: int = 100
    cost_s: float = 0.01
    variants: tuple = ("fp32",)


@dataclass
class _Variant:
    weight_bytes: int


class FakeManifest:
    name, precision, max_context, eos_ids, vocab_size = "sim-model", "fp32", 256, (), VOCAB
    config = {"vocab_size": VOCAB}  # what Requests.new_sequence checks logit_bias against

    def __init__(self):
        self.units = [_Unit(i, f"u{i}", "layer") for i in range(N_UNITS)]

    def variant(self, index, precision=None) -> _Variant:
        return _Variant(UNIT_BYTES)

    def stage_files(self, start, end, precision=None):
        return [f"file{u}" for u in range(start, end)]


class FakePackage:
    def __init__(self):
        self.manifest = FakeManifest()

    def stage_graph(self, start, end, precision=None, batch_invariant=False, gpu=False) -> str:
        return f"graph-{start}-{end}" + ("-invariant" if batch_invariant else "") + ("-gpu" if gpu else "")


# -- the simulated network -----------------------------------------------------------------------------
class Net:
    """Latency, partitions and the data ports of the fake workers."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.held_until: dict[str, float] = {}  # worker name -> control frames held until (partition)
        self.peer_cut_until: dict[str, float] = {}  # worker name -> its data sends fail until
        self.ports: dict[str, "FakeWorker"] = {}  # data url -> worker


class Pipe:
    """In-order delivery after a delay (timers due at one instant may fire in any order)."""

    def __init__(self, deliver):
        self.deliver, self.items, self.last = deliver, [], 0.0

    def put(self, at: float, item) -> None:
        loop = asyncio.get_running_loop()
        self.last = max(at, self.last)
        self.items.append(item)
        loop.call_at(self.last, self._pump)

    def _pump(self) -> None:
        self.deliver(self.items.pop(0))


class SimChannel:
    def __init__(self, net: Net, worker: str, peer: str):
        self.net, self.worker, self.peer = net, worker, peer
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.other: SimChannel | None = None
        self.closed = False
        self._told = False  # the other end was told we closed
        self._pipe = Pipe(lambda frame: self.other.inbox.put_nowait(frame))

    def _deliver(self, frame) -> None:
        at = max(asyncio.get_running_loop().time() + 0.001, self.net.held_until.get(self.worker, 0.0))
        self._pipe.put(at, frame)

    async def send(self, frame: bytes) -> None:
        if self.closed:
            raise ChannelClosed(f"channel to {self.peer} is closed")
        self._deliver(frame)

    async def recv(self) -> bytes:
        frame = await self.inbox.get()
        if frame is None:
            self.closed = True
            raise ChannelClosed(f"{self.peer} closed the channel")
        return frame

    async def close(self, reason: str = "") -> None:
        self.closed = True
        if not self._told:  # a close ends the connection for both ends, as a WebSocket close does
            self._told = True
            self._deliver(None)


def sim_pair(net: Net, worker: str) -> tuple[SimChannel, SimChannel]:
    a, b = SimChannel(net, worker, "coordinator"), SimChannel(net, worker, worker)
    a.other, b.other = b, a
    return a, b  # (worker's end, coordinator's end)


# -- a fake worker ------------------------------------------------------------------------------------------
class FakeWorker:
    """Speaks the worker protocol over a ``SimChannel``; computes the fake model per unit."""

    def __init__(self, world, name: str, memory: int, slowdown: float = 1.0):
        self.world, self.name, self.memory, self.slowdown = world, name, memory, slowdown
        self.url = f"sim://{name}"
        self.dead = False
        self.stalled_until = 0.0
        self.dropping_until = 0.0  # answers pings but drops activation frames until then
        self.computed = 0
        self.slots: dict[int, tuple[int, int, dict]] = {}  # plan -> (start, end, next hop)
        self.runners: dict[tuple[int, int], dict[str, list[int]]] = {}  # range -> seq -> per-unit state + [positions held]
        self.prefixes: dict[int, tuple[int, dict[str, list[int]]]] = {}  # plan -> (epoch, block name -> state after the block)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.control: SimChannel | None = None
        self.tasks: list[asyncio.Task] = []
        self.malformed = 0  # malformed frames still to send
        self.data = Pipe(lambda item: self.queue.put_nowait(item))  # frames from other workers' data ports

    def start(self) -> None:
        self.world.net.ports[self.url] = self
        self.tasks = [asyncio.get_running_loop().create_task(self._life()), asyncio.get_running_loop().create_task(self._compute())]

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

    async def _life(self) -> None:
        """Join, serve until the channel closes, then reconnect with jittered backoff (forever)."""
        rng = random.Random(f"{self.world.seed}-{self.name}")
        backoff = 0.2
        while not self.dead:
            mine, theirs = sim_pair(self.world.net, self.name)
            self.control = mine
            self.world.spawn(self.world.coordinator.attach(theirs))
            self.slots.clear()
            self.runners.clear()
            self.prefixes.clear()
            try:
                await mine.send(encode(Message(T.HELLO, {"name": self.name, "kind": "native", "memory_bytes": self.memory, "threads": 1,
                                                         "data_url": self.url, "emulation": {"memory_budget": self.memory}})))
                reply = decode(await mine.recv())
                if reply.type is T.WELCOME:
                    backoff = 0.2
                    await self._serve(mine)
            except ChannelClosed:
                pass
            await asyncio.sleep(backoff * (1 + rng.random()))
            backoff = min(backoff * 2, 2.0)

    async def _serve(self, ch: SimChannel) -> None:
        while True:
            await self._stall()
            if self.malformed:
                self.malformed -= 1
                await ch.send(bad_frame(self.malformed))
            msg = decode(await ch.recv())
            await self._stall()
            if msg.type is T.PING:
                await ch.send(encode(Message(T.PONG, {"t": msg["t"], "kv_bytes": 0, "queue": self.queue.qsize(), "busy_s": 0.0, "computed": self.computed})))
            elif msg.type is T.LOAD:
                self.world.spawn(self._load(ch, msg))
            elif msg.type is T.ACTIVATE:
                keep = set(msg["keep"])
                self.slots = {p: s for p, s in self.slots.items() if p in keep}
                used = {(s[0], s[1]) for s in self.slots.values()}
                self.runners = {r: kv for r, kv in self.runners.items() if r in used}
                self.prefixes = {p: s for p, s in self.prefixes.items() if p in keep}
            elif msg.type is T.PROBE:
                await ch.send(encode(Message(T.PROBED, {"probe": msg["probe"], "ok": True, "times": [0.01 * self.slowdown] * 10})))
            elif msg.type in (T.FORWARD, T.DROP, T.KV_EXPORT):
                self.queue.put_nowait((ch, msg))
            elif msg.type is T.BYE:
                return

    async def _load(self, ch: SimChannel, msg: Message) -> None:
        await asyncio.sleep(0.2 * self.slowdown)
        await self._stall()
        start, end = msg["start"], msg["end"]
        need = (end - start) * (UNIT_BYTES + UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES
        ok = msg.get("warm") or need <= self.memory
        if ok and not msg.get("warm"):
            self.slots[msg["plan"]] = (start, end, msg["next"])
            self.runners.setdefault((start, end), {})
        reply = {"plan": msg["plan"], "ok": bool(ok), "fetched_bytes": 0}
        if not ok:
            reply["error"] = f"units [{start}, {end}) need {need} bytes, {self.name} holds {self.memory}"
        try:
            await ch.send(encode(Message(T.LOADED, reply)))
        except ChannelClosed:
            pass

    async def _compute(self) -> None:
        while True:
            ch, msg = await self.queue.get()
            await self._stall()
            try:
                if msg.type is T.FORWARD and asyncio.get_running_loop().time() < self.dropping_until:
                    pass
                elif msg.type is T.FORWARD:
                    await self._forward(ch, msg)
                elif msg.type is T.DROP:
                    for kv in self.runners.values():
                        kv.pop(msg["seq"], None)
                elif msg.type is T.KV_EXPORT:
                    await self._export(ch, msg)
                elif msg.type is T.KV:
                    self._import(ch, msg)
            except ChannelClosed:
                pass

    async def _forward(self, ch: SimChannel, msg: Message) -> None:
        slot = self.slots.get(msg["plan"])
        batch = msg["batch"]
        if slot is None:
            return await self._error(ch, batch, ErrorCode.NO_STAGE, f"{self.name} holds no stage for plan {msg['plan']}")
        start, end, nxt = slot
        x = np.array(msg.tensors["x"], dtype=np.int64)
        await asyncio.sleep(0.002 * x.shape[1] * (end - start) * len(batch) * self.slowdown)
        await self._stall()
        kv = self.runners.setdefault((start, end), {})
        saves = {}
        for item in batch:  # cached prompt blocks first, as the real stage (runtime.prefix_store)
            entry = item.get("prefix")
            if entry:
                missing = self._prefix_before(msg["plan"], kv, item["seq"], entry)
                if missing:
                    return await self._error(ch, batch, ErrorCode.PREFIX_MISS, missing)
                saves[item["seq"]] = entry
        for item in batch:  # as the real stage: a frame must start where the sequence's cache ends
            held = kv.get(item["seq"], [0] * (end - start + 1))[-1]
            if item.get("pos") is not None and item["pos"] != held:
                return await self._error(ch, batch, ErrorCode.CORRUPT_INPUT,
                                         f"{item['seq']} holds {held} positions, the frame starts at {item['pos']}")
        y = np.zeros_like(x)
        for row, item in enumerate(batch):
            h = kv.setdefault(item["seq"], [0] * (end - start + 1))
            entry = saves.get(item["seq"])
            epoch, held = self.prefixes.get(msg["plan"], (0, {}))
            keep = {i: name for i, name in entry["save"]} if entry and entry["epoch"] == epoch else {}
            for col in range(x.shape[1]):
                v = int(x[row, col])
                for k, u in enumerate(range(start, end)):
                    h[k], v = _unit(h[k], v, u)
                y[row, col] = v
                h[-1] += 1
                if keep and h[-1] % entry["block"] == 0 and h[-1] // entry["block"] - 1 in keep:
                    held[keep[h[-1] // entry["block"] - 1]] = list(h)
        self.computed += len(batch)
        timings = list(msg.get("timings", [])) + [[self.name, 0.002 * self.slowdown, int(x.shape[1]), 4, len(batch)]]
        if nxt["kind"] == "coordinator":
            if not all(item.get("partial") for item in batch):
                await ch.send(encode(Message(T.TOKEN, {"plan": msg["plan"], "batch": batch, "timings": timings,
                                                       "tokens": [int(y[r, -1]) % VOCAB for r in range(len(batch))]})))
            return
        target = self.world.net.ports.get(nxt["url"])
        cut = self.world.net.peer_cut_until.get(self.name, 0.0) > asyncio.get_running_loop().time()
        if target is None or target.dead or cut:
            return await self._error(ch, batch, ErrorCode.UNREACHABLE, f"next hop unreachable: {nxt['url']}")
        frame = Message(T.FORWARD, {"plan": msg["plan"], "batch": batch, "timings": timings}, {"x": y})
        target.data.put(asyncio.get_running_loop().time() + 0.001, (target.control, frame))

    def _prefix_before(self, plan: int, kv: dict, seq: str, entry: dict) -> str | None:
        """A decision's epoch, install and evict, as ``runtime.prefix_store``; a miss says why."""
        epoch, held = self.prefixes.get(plan, (0, {}))
        if entry["epoch"] > epoch:
            epoch, held = entry["epoch"], {}
            self.prefixes[plan] = (epoch, held)
        if entry["epoch"] < epoch:
            return f"{seq}: prefix epoch {entry['epoch']} is gone" if entry["reuse"] else None
        if entry["reuse"]:
            if any(name not in held for name in entry["reuse"]):
                return f"{seq}: {self.name} lacks a prefix block"
            kv[seq] = list(held[entry["reuse"][-1]])
        for name in entry["evict"]:
            held.pop(name, None)
        return None

    async def _error(self, ch, batch, code: ErrorCode, text: str) -> None:
        for item in batch:
            await ch.send(encode(Message(T.ERROR, {"message": text, "code": code.value, "seq": item.get("seq"), "step": item.get("step")})))

    async def _export(self, ch: SimChannel, msg: Message) -> None:
        slot = self.slots.get(msg["plan"])
        target = self.world.net.ports.get(msg["url"])
        if slot is None or target is None or target.dead or msg["seq"] not in self.runners.get(slot[:2], {}):
            await ch.send(encode(Message(T.LOADED, {"kv_received": msg["move"], "ok": False, "error": "cannot export"})))
            return
        state = self.runners[slot[:2]][msg["seq"]]
        units = {u: state[u - slot[0]] for u in range(msg["start"], msg["end"])}
        frame = Message(T.KV, {"seq": msg["seq"], "plan": msg["to_plan"], "move": msg["move"], "units": units, "length": state[-1]})
        target.data.put(asyncio.get_running_loop().time() + 0.001, (target.control, frame))

    def _import(self, ch, msg: Message) -> None:
        slot = self.slots.get(msg["plan"])
        if slot is None:
            reply = {"kv_received": msg["move"], "ok": False, "error": "no such plan"}
        else:
            h = self.runners[slot[:2]].setdefault(msg["seq"], [0] * (slot[1] - slot[0] + 1))
            for u, value in msg["units"].items():
                h[int(u) - slot[0]] = value
            h[-1] = msg["length"]
            reply = {"kv_received": msg["move"], "plan": msg["plan"], "ok": True}
        self.world.spawn(_quiet_send(self.control, encode(Message(T.LOADED, reply))))


async def _quiet_send(ch, frame) -> None:
    try:
        if ch is not None:
            await ch.send(frame)
    except ChannelClosed:
        pass


def bad_frame(kind: int) -> bytes:
    """A frame a broken or hostile worker might send (each must be refused or ignored, never crash)."""
    if kind % 4 == 0:
        return b"\x01\x02"
    if kind % 4 == 1:
        return struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1"
    if kind % 4 == 2:
        return encode(Message(T.TOKEN, {"plan": 1, "batch": [{"seq": "x.0", "step": 0}], "tokens": [1 << 40], "timings": []}))
    return encode(Message(T.PONG, {"t": float("nan"), "kv_bytes": -1}))


def can_hold(memories: list[int]) -> bool:
    """Whether the memory-proportional split of these workers fits each of them."""
    if not memories:
        return False
    stages = proportional_split(N_UNITS, [(str(i), float(m)) for i, m in enumerate(memories)])
    return all((s.end - s.start) * (UNIT_BYTES + UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES <= memories[int(s.worker_id)] for s in stages)


__all__ = ["Admission", "Coordinator", "CoordinatorSettings", "FakePackage", "FakeWorker", "GenerationParams", "Net", "Phase",
           "ProtocolError", "RequestFailed", "VirtualLoop", "bad_frame", "can_hold", "reference"]
