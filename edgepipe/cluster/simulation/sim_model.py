"""The simulation's stage compute: the fake model of ``cluster.sim`` run on one worker's stages.

A stage's KV is per-unit integer state (a running hash of the ids it was fed, one entry per
unit, and the positions held last); a few recent lengths of each sequence are kept, since a
rewind goes back to one and a checkpoint's ``upto`` exports one (the fake state is a running
hash, not per position as a real KV cache). Cached prompt blocks are kept per plan under the
prefix decision's epoch, as ``runtime.prefix_store`` keeps them. Its methods are the worker
shell's compute port (``worker.ports``: those of ``worker.runners.Runners``), without I/O or
clock: the simulated worker (``sim_worker.FakeCompute``) adds the compute time and the faults."""

from __future__ import annotations

import numpy as np

from ...net.messages import ErrorCode, Kv
from ...net.protocol import Message, encode
from ...worker import core

KEPT_LENGTHS = 12  # recent lengths kept per sequence (a rewind or a checkpoint goes back only a few)


_SHIFTS = np.arange(8, dtype=np.int64) * 8  # an integer state below 2**64 as 8 bytes


def activations(y: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """The fake model's states ``[batch, positions]`` (int64) as activations ``[batch, positions, 8]``:
    a byte each, exact in float16 as in float32 (a stage after the first refuses token ids)."""
    return ((y[..., None] >> _SHIFTS) & 0xFF).astype(dtype)


def from_activations(x: np.ndarray) -> np.ndarray:
    """``activations`` undone: ``[batch, positions, 8]`` -> int64 ``[batch, positions]``."""
    return (np.rint(np.asarray(x, np.float64)).astype(np.int64) << _SHIFTS).sum(-1)


class FakeStages:
    """The fake KV and prompt blocks of one simulated worker's stages."""

    def __init__(self, name: str):
        self.name = name
        self.kv: dict[str, dict[str, list[int]]] = {}  # graph -> seq -> per-unit state + [positions held]
        self.lengths: dict[tuple[str, str], dict[int, list[int]]] = {}  # (graph, seq) -> length -> its state then
        self.prefixes: dict[int, tuple[int, dict[str, list[int]]]] = {}  # plan -> (epoch, block name -> state after the block)
        self.ranges: dict[str, tuple[int, int]] = {}  # graph -> its units [start, end)
        self.prefix_bytes = 0  # what a PONG reports (the fake KV weighs nothing)

    # -- what the core's commands change --------------------------------------------------------------
    def session(self, load) -> core.Session:
        """A built stage: the first takes token ids, the others activations (the fake model's integer
        state, carried exactly as small floats: ``activations``), as a real pipeline's."""
        from .sim import N_UNITS, VOCAB

        self.kv.setdefault(load.graph, {})
        self.ranges[load.graph] = (load.start, load.end)
        return core.Session(load.graph, load.start == 0, load.end == N_UNITS, 0, tuple(range(load.start, load.end)), VOCAB)

    def drop(self, cmd: core.DropSequence) -> None:
        for graph in cmd.graphs:
            self.kv.get(graph, {}).pop(cmd.seq, None)
            self.lengths.pop((graph, cmd.seq), None)

    def keep(self, cmd: core.KeepSessions) -> None:
        self.kv = {g: kv for g, kv in self.kv.items() if g in cmd.graphs}
        self.lengths = {k: v for k, v in self.lengths.items() if k[0] in cmd.graphs}
        if cmd.plans is not None:
            self.prefixes = {p: s for p, s in self.prefixes.items() if p in cmd.plans}

    def forget_sequences(self) -> None:
        self.kv = {g: {} for g in self.kv}
        self.lengths.clear()
        self.prefixes.clear()

    def kv_bytes(self, graphs) -> int:
        return 0

    def close(self) -> None:
        pass

    # -- a step -----------------------------------------------------------------------------------------
    def step(self, cmd: core.RunStage, compute_s: float, joins: int):
        """The stage of ``cmd.graph`` fed ``cmd``: ``Computed`` or ``Failed`` (a prefix miss, a rewind it cannot make)."""
        from .sim import N_UNITS, VOCAB, _unit

        start, end = self.ranges[cmd.graph]
        x = from_activations(cmd.x) if np.ndim(cmd.x) == 3 else np.asarray(cmd.x, dtype=np.int64)
        batch = cmd.forward.entries()
        kv = self.kv.setdefault(cmd.graph, {})
        plan = cmd.forward.plan
        saves = dict(cmd.prefixes)
        for seq, entry in cmd.prefixes:  # cached prompt blocks first, as the real stage (runtime.prefix_store)
            missing = self._prefix_before(plan, kv, seq, entry)
            if missing:
                return core.Failed(cmd.forward, ErrorCode.PREFIX_MISS, missing, {s: kv[s][-1] for s in cmd.seqs if s in kv})
        for item in batch:  # rewind (as runner.rewind): only to a length an import left (else the stage refuses)
            h, pos = kv.get(item.seq), item.pos
            if item.rewind and pos is not None and h is not None and pos < h[-1]:
                back = self.lengths.get((cmd.graph, item.seq), {}).get(pos)
                if back is None:
                    return core.Failed(cmd.forward, ErrorCode.BAD_INPUT, f"{item.seq}: cannot rewind to {pos}",
                                       {s: kv[s][-1] for s in cmd.seqs if s in kv})
                kv[item.seq] = list(back)
        y = np.zeros_like(x)
        for row, item in enumerate(batch):
            h = kv.setdefault(item.seq, [0] * (end - start + 1))
            entry = saves.get(item.seq)
            epoch, held = self.prefixes.get(plan, (0, {}))
            keep = {i: name for i, name in entry["save"]} if entry and entry["epoch"] == epoch else {}
            for col in range(x.shape[1]):
                v = int(x[row, col])
                for k, u in enumerate(range(start, end)):
                    h[k], v = _unit(h[k], v, u)
                y[row, col] = v
                h[-1] += 1
                self._keep(cmd.graph, item.seq, h)
                if keep and h[-1] % entry["block"] == 0 and h[-1] // entry["block"] - 1 in keep:
                    held[keep[h[-1] // entry["block"] - 1]] = list(h)
        out = np.array([int(y[r, -1]) % VOCAB for r in range(len(batch))], np.int64) if end == N_UNITS else \
            activations(y, cmd.out_dtype or "float32")
        lengths = {item.seq: kv[item.seq][-1] for item in batch}
        return core.Computed(cmd.forward, out, compute_s, None, int(x.shape[1]), joins, lengths)

    def _prefix_before(self, plan: int, kv: dict, seq: str, entry: dict) -> str | None:
        """A decision's epoch, install and evict, as ``runtime.prefix_store``; a miss says why."""
        epoch, held = self.prefixes.get(plan, (0, {}))
        if entry["epoch"] > epoch:
            epoch, held = entry["epoch"], {}
            self.prefixes[plan] = (epoch, held)
        if entry["epoch"] < epoch:
            return f"{seq}: prefix epoch {entry['epoch']} is gone" if entry.get("reuse") else None
        if entry.get("reuse"):
            if any(name not in held for name in entry["reuse"]):
                return f"{seq}: {self.name} lacks a prefix block"
            kv[seq] = list(held[entry["reuse"][-1]])
        for name in entry.get("evict") or ():
            held.pop(name, None)
        return None

    def export_frame(self, cmd: core.ExportKv) -> bytes:
        """The KV frame an export sends; ValueError when it cannot."""
        frame = self._export(cmd, self.ranges.get(cmd.graph, (0, 0))[0])
        if isinstance(frame, str):
            raise ValueError(frame)
        return encode(frame)

    def _export(self, cmd: core.ExportKv, start: int) -> Message | str:
        e = cmd.export
        held = self.kv.get(cmd.graph, {}).get(e.seq)
        if held is None:
            return "cannot export"
        if e.upto is not None and e.upto != held[-1]:  # a checkpoint of fewer positions than held: as they were then
            held = self.lengths.get((cmd.graph, e.seq), {}).get(e.upto)
            if held is None:
                return f"{e.seq}: no state at {e.upto} positions"
        # The fake KV of unit u (one integer) travels as the real KV does, a tensor per layer. A
        # real KV holds every position, so its receiver may rewind it: the fake one carries its
        # recent lengths too (oldest first, consecutive up to the one it has), for the same rewinds.
        kept = self.lengths.get((cmd.graph, e.seq), {})
        history = [held]
        while len(history) < KEPT_LENGTHS and (before := kept.get(history[0][-1] - 1)) is not None:
            history.insert(0, before)
        units = {f"key.{u}": np.array([h[u - start] for h in history], np.int64) for u in range(e.start, e.end)}
        return Kv(e.as_seq or e.seq, e.to_plan, held[-1], e.move, tensors=units).to_message()

    def import_kv(self, cmd: core.ImportKv) -> core.Imported:
        kv = cmd.kv
        start, end = cmd.layers[0], cmd.layers[-1] + 1
        h = self.kv.setdefault(cmd.graph, {}).setdefault(kv.seq, [0] * (end - start + 1))
        kept = self.lengths.setdefault((cmd.graph, kv.seq), {})
        layers = kv.layers()
        n = min((len(named[f"key.{u}"]) for u, named in layers.items()), default=1)
        for back in range(n - 1, -1, -1):  # its recent lengths, then the one it has (another import may bring other units)
            length = kv.length - back
            at = list(kept.get(length, h))
            for u, named in layers.items():
                at[u - start] = int(named[f"key.{u}"][len(named[f"key.{u}"]) - 1 - back])
            at[-1] = length
            if back:
                kept[length] = at
            else:
                h[:] = at
        self._keep(cmd.graph, kv.seq, h)
        return core.Imported(kv, cmd.graph, h[-1], 0)

    def _keep(self, graph: str, seq: str, h: list[int]) -> None:
        kept = self.lengths.setdefault((graph, seq), {})
        kept[h[-1]] = list(h)
        if len(kept) > KEPT_LENGTHS:
            del kept[min(kept)]
