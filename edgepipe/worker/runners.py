"""The built stage sessions of a worker (ONNX Runtime), and the compute commands run on them.

Each method carries out one of the core's commands and returns the event that reports it back
(``core.Computed``, ``core.Imported``, ...). Compute runs in one thread so the event loop stays
free for heartbeats and I/O; fast decode steps may run on the loop (the core decides)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..emulate.roofline import RooflinePolicy
from ..emulate.slowdown import SlowdownPolicy
from ..net.messages import ErrorCode, Kv
from ..net.protocol import encode
from ..runtime.prefix_store import PrefixMiss, PrefixStore
from ..runtime.speculative import head_tokens
from ..runtime.stage_runner import ContextOverflow, SamplingBatch, StageRunner, spin_by_default
from . import core


def failure(exc: BaseException) -> tuple[ErrorCode, str]:
    """The error code and one line for an exception raised by a stage run."""
    if isinstance(exc, (ContextOverflow, KeyError, ValueError, RuntimeError)):
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        code = {ContextOverflow: ErrorCode.CONTEXT, KeyError: ErrorCode.NO_STAGE, PrefixMiss: ErrorCode.PREFIX_MISS}.get(type(exc),
                                                                                                                    ErrorCode.BAD_INPUT)
        return code, text
    return ErrorCode.INTERNAL, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def session_of(graph: str, runner: StageRunner) -> core.Session:
    shape = next(i for i in runner.session.get_inputs() if i.name == runner.input_name).shape
    hidden = 0 if runner.takes_token_ids else (int(shape[-1]) if isinstance(shape[-1], int) else 0)
    return core.Session(graph, runner.takes_token_ids, runner.emits_tokens, hidden, tuple(runner.layers), runner.vocab,
                        np.dtype(runner.kv_dtype).itemsize)


class Runners:
    def __init__(self, threads: int | None, spin: bool | None, device):
        self.threads, self.spin, self.device = threads, spin, device
        self.by_graph: dict[str, StageRunner] = {}
        self.prefix: dict[int, PrefixStore] = {}  # plan -> its stage's cached prompt blocks (cluster.prefix decides)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="compute")

    async def build(self, load, path) -> core.Session:
        """``build_sync`` of ``load``'s graph, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(None, self.build_sync, load.graph, path, load.max_context)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def build_sync(self, graph: str, path, max_context: int | None) -> core.Session:
        """The session of ``graph``, built unless this worker holds it already. Two loads of one
        graph may be in flight together (a plan's stage and the warm spare's on the same range):
        the build that finishes second keeps the runner the first installed, which may have taken
        KV meanwhile (a moved sequence, a checkpoint) that the core counts as held."""
        runner = self.by_graph.get(graph)
        if runner is None:
            built = StageRunner(path, threads=self.threads, max_context=max_context,
                                spin=spin_by_default(self.threads) if self.spin is None else self.spin, device=self.device)
            runner = self.by_graph.setdefault(graph, built)  # runs in a thread: another build may have finished first
        return session_of(graph, runner)

    def keep(self, cmd: core.KeepSessions) -> None:
        for graph in [g for g in self.by_graph if g not in cmd.graphs]:
            del self.by_graph[graph]  # its memory goes back
        if cmd.plans is not None:
            self.prefix = {p: store for p, store in self.prefix.items() if p in cmd.plans}

    def forget_sequences(self) -> None:
        for runner in self.by_graph.values():
            for seq in runner.sequences():
                runner.drop(seq)
        self.prefix.clear()

    @property
    def prefix_bytes(self) -> int:
        return sum(store.nbytes for store in self.prefix.values())

    def drop(self, cmd: core.DropSequence) -> None:
        for graph in cmd.graphs:
            if graph in self.by_graph:
                self.by_graph[graph].drop(cmd.seq)

    def kv_bytes(self, graphs) -> int:
        return sum(self.by_graph[g].kv_bytes for g in set(graphs) if g in self.by_graph)

    async def run(self, cmd: core.RunStage, joins: int, single_thread: bool) -> core.Computed | core.Failed:
        """Run a FORWARD's batch; with one ORT thread (it is the calling one) also time its CPU."""
        runner = self.by_graph[cmd.graph]
        batch, entries = cmd.forward.batch, cmd.forward.entries()
        sampling = SamplingBatch.from_wire(batch, runner.vocab) if runner.emits_tokens else None

        store = self.prefix.setdefault(cmd.forward.plan, PrefixStore()) if cmd.prefixes else None

        verify = any(item.verify for item in entries)
        x = cmd.x.astype(np.float32) if cmd.x.dtype == np.float16 else cmd.x  # fp16 on the wire, fp32 in the graph

        def timed():
            for item in entries:  # speculative decoding: drafts the last verify rejected are forgotten
                if item.rewind and item.pos is not None:
                    runner.rewind(item.seq, item.pos)
                if runner.takes_positions and item.pos is not None:
                    runner.place(item.seq, item.pos)  # a stage of no layers: its positions start where the frame says
            for seq, entry in cmd.prefixes:  # install cached prompt blocks first: the frame starts after them
                store.before(runner, seq, entry)
            c0 = time.thread_time()
            out = runner.run_batch(cmd.seqs, x, sampling, verify)
            if verify and runner.emits_tokens:  # sampled drafts with their distribution: the sampling rule decides here
                out = head_tokens(runner, batch[0], out)
            cpu = time.thread_time() - c0 if single_thread else None
            for seq, entry in cmd.prefixes:
                store.after(runner, seq, entry)
            return out, cpu

        t0 = time.perf_counter()
        try:
            out, cpu = timed() if cmd.inline else await asyncio.get_running_loop().run_in_executor(self.pool, timed)
        except Exception as exc:  # noqa: BLE001 - onnxruntime errors must not kill the worker
            return core.Failed(cmd.forward, *failure(exc), lengths=self._lengths(runner, cmd.seqs))
        if cmd.out_dtype is not None:
            out = out.astype(cmd.out_dtype)  # the core chose the wire's activation dtype for the next stage
        return core.Computed(cmd.forward, out, time.perf_counter() - t0, cpu, int(cmd.x.shape[1]), joins,
                             self._lengths(runner, cmd.seqs), runner.logprobs_field(batch, verify) if runner.emits_tokens else {})

    @staticmethod
    def _lengths(runner: StageRunner, seqs: list[str]) -> dict:
        return {s: runner.length(s) for s in seqs if s in runner.sequences()}

    async def export(self, cmd: core.ExportKv) -> bytes:
        """The KV frame for the move (copies and encodes hundreds of MB for long sequences: off the loop)."""
        runner, e = self.by_graph[cmd.graph], cmd.export

        def pack() -> bytes:
            since = e.since or 0  # a checkpoint's increment: full-cache layers from there on
            # a checkpoint: the KV as it was ``upto`` positions long (a step may have run since)
            tensors = {k: v for k, v in runner.export_kv(e.seq, since, e.upto).items() if e.start <= int(k.split(".")[1]) < e.end}
            length = runner.length(e.seq) if e.upto is None else e.upto
            return encode(Kv(e.as_seq or e.seq, e.to_plan, length, e.move, since or None, tensors).to_message())

        return await asyncio.get_running_loop().run_in_executor(self.pool, pack)

    async def import_kv(self, cmd: core.ImportKv) -> core.Imported:
        runner, kv = self.by_graph[cmd.graph], cmd.kv
        mine = {name: v for u, named in kv.layers().items() if u in cmd.layers for name, v in named.items()}
        await asyncio.get_running_loop().run_in_executor(  # a copy into the pool, maybe a regrowth: off the loop
            self.pool, runner.import_kv, kv.seq, mine, kv.length, kv.since or 0)  # window layers' KV travels trimmed: length says where it ends
        return core.Imported(kv, cmd.graph, runner.length(kv.seq), int(sum(v.nbytes for v in mine.values())))

    async def time_stage(self, cmd: core.TimeStage, session: core.Session, slowdown: float,
                         roofline: RooflinePolicy | None = None) -> core.StageTimed:
        """Decode steps of a built stage after a ``context``-position prefill, ``cmd.rows``
        sequences stepped together, each step as the device (emulation included) takes it."""
        runner, tag = self.by_graph[cmd.graph], f"probe-{time.monotonic_ns()}"
        seqs = [f"{tag}-{i}" for i in range(max(1, cmd.rows))]
        rng = np.random.default_rng(0)
        make = (lambda b, n: rng.integers(0, 1000, (b, n))) if runner.takes_token_ids else (
            lambda b, n: rng.standard_normal((b, n, session.hidden)).astype(np.float32))
        policy = SlowdownPolicy(slowdown)

        def timed() -> list[float]:
            times = []
            try:
                for seq in seqs:
                    runner.run(seq, make(1, cmd.context), SamplingBatch.greedy(1) if runner.emits_tokens else None)
                sampling = SamplingBatch.greedy(len(seqs)) if runner.emits_tokens else None
                for _ in range(cmd.reps):
                    t0 = time.perf_counter()
                    runner.run_batch(seqs, make(len(seqs), 1), sampling)
                    compute = time.perf_counter() - t0
                    time.sleep(roofline.extra_wait(compute, cmd.weight_bytes, len(seqs)) if roofline is not None
                               else policy.extra_wait(compute))
                    times.append(time.perf_counter() - t0)
            finally:
                for seq in seqs:
                    runner.drop(seq)
            return times

        return core.StageTimed(cmd.probe, await asyncio.get_running_loop().run_in_executor(self.pool, timed))
