"""Deterministic simulation of the control plane: the real ``Coordinator`` against fake workers.

Everything runs on one asyncio loop whose clock is virtual (``VirtualLoop``: when nothing is
ready, time jumps to the next timer), so a 60 s fault schedule takes milliseconds and a seed
replays exactly. Simulated workers run the shipped worker shell and core (``worker.shell.Worker``)
on fake ports (``sim_worker``) and speak the real wire protocol over in-memory channels whose
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


from ...net.channel import ChannelClosed
from ...net.protocol import Message, MessageType as T, ProtocolError, encode
from ...runtime.sequence import GenerationParams
from ..shells.coordinator import Coordinator, CoordinatorSettings
from ..state.placement import proportional_split
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from ..shells.steps import RequestFailed
from ..shells.admission import Admission
from ..state.state import Phase

MASK = (1 << 61) - 1
VOCAB = 1000
N_UNITS = 8
UNIT_BYTES = 100_000_000
UNIT_KV_ROOM = 1000 * 256  # a unit's KV room as a real worker keeps it: kv_bytes_per_token x min(KV_RESERVE_TOKENS, max_context)
SETTINGS = dict(heartbeat_s=1.0, dead_after_s=2.0, lose_after_s=6.0, step_timeout_s=8.0, load_timeout_s=6.0,
                capacity_wait_s=10.0, max_wait_s=30.0, replan_every_s=5.0, calibrate=True, prefix_block=2, prefix_cache_positions=24,
                kv_checkpoint_tokens=3)
REQUEST_BOUND_S = SETTINGS["max_wait_s"] + SETTINGS["step_timeout_s"] + 12.0  # admitted -> tokens or a clear error
UP_BOUND_S = 30.0  # last fault healed -> Up, when the live workers can hold the model
FAULTS = ("kill", "stall", "slow", "partition_coord", "partition_peer", "reconnect", "join_late", "restart", "malformed", "bad_request",
          "drop_work", "forget_prefixes")
# Faults after which a worker may rightly be quarantined (it took work and computed nothing).
QUARANTINE_FAULTS = ("stall", "partition_coord", "drop_work", "lose_feed", "lose_copy")
# The direct token path's faults (targeted schedules, ``tests/test_sim.py``, ``tests/test_direct.py``): a
# last stage's feed of the next step is lost (its own queue on a one-stage plan, the first stage's on a
# plan of several: the token reached the coordinator only), or the coordinator's copy of a token it fed
# (the token reached the next step only)
DIRECT_FAULTS = ("lose_feed", "lose_copy")
# A feed the last stage cannot send (the first stage's port refuses it: ``ChannelClosed``), which
# the stage knows of, unlike a lost one: its copy goes to the coordinator unfed (targeted schedules)
REFUSE_FEED = "refuse_feed"


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
    kv_window: int = 0
    experts: int = 0  # dense (as ``manifest.Unit``: a MoE layer's E experts and k routed)
    experts_used: int = 0


@dataclass
class _Variant:
    weight_bytes: int
    files: tuple = ()
    expert_bytes: int = 0


class FakeManifest:
    name, precision, max_context, eos_ids, vocab_size = "sim-model", "fp32", 256, (), VOCAB
    config = {"vocab_size": VOCAB}  # what Requests.new_sequence checks logit_bias against

    def __init__(self):
        self.units = [_Unit(i, f"u{i}", "layer") for i in range(N_UNITS)]

    def variant(self, index, precision=None) -> _Variant:
        return _Variant(UNIT_BYTES, (f"file{index}",))

    def kv_bytes_per_token(self, index, precision=None) -> int:  # as manifest.Manifest's
        return self.units[index].kv_bytes_per_token

    def stage_files(self, start, end, precision=None):
        return [f"file{u}" for u in range(start, end)]


class TwoFormManifest(FakeManifest):
    """The fake model as a file's own model in two forms, as a GGUF package holds it: `gguf`
    (for workers with the kernel library: an fp16 KV cache, half the bytes) and `native` (the
    others: a tab, a worker without the library). A worker of either form computes the same tokens."""

    precision = "native"

    def __init__(self):
        self.units = [_Unit(i, f"u{i}", "layer", variants=("gguf", "native")) for i in range(N_UNITS)]

    def kv_bytes_per_token(self, index, precision=None) -> int:
        per_token = self.units[index].kv_bytes_per_token
        return per_token // 2 if (precision or self.precision) == "gguf" else per_token


class FakePackage:
    def __init__(self, two_forms: bool = False):
        self.manifest = TwoFormManifest() if two_forms else FakeManifest()

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


from .sim_worker import FakeWorker  # noqa: E402 - it uses the fake model and the network above

__all__ = ["Admission", "Coordinator", "CoordinatorSettings", "FakePackage", "FakeWorker", "GenerationParams", "Net", "Phase",
           "ProtocolError", "RequestFailed", "VirtualLoop", "bad_frame", "can_hold", "reference"]
