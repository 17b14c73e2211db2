"""A stage's store of cached prefix blocks (I/O side of ``cluster.prefix``): KV copied out of a
sequence after its prefill, and copied into a new sequence that starts with the same tokens.

Each block holds ``block`` positions of every layer of the stage (``[1, kv_heads, block,
head_dim]`` per ``key.<u>`` / ``value.<u>``), in host memory. The coordinator decides what is
kept and evicted (a PREFIX entry in a FORWARD item, see ``cluster.prefix.PrefillDecision``); the
store only does it, in frame order. A block it was told to reuse but lacks is a
:class:`PrefixMiss` (the coordinator drops the plan's cache and the request replays).

Needs only numpy (workers import this module).
"""

from __future__ import annotations

import numpy as np

from .stage_runner import StageRunner


class PrefixMiss(ValueError):
    """A frame asked to reuse a block this stage does not hold."""


class PrefixStore:
    def __init__(self) -> None:
        self.epoch = 0
        self.blocks: dict[str, dict[str, np.ndarray]] = {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for b in self.blocks.values() for a in b.values())

    def before(self, runner: StageRunner, seq: str, entry: dict) -> None:
        """Apply a frame's decision before it computes: a newer epoch clears the store, then
        the reused blocks become ``seq``'s first positions, then the evicted blocks go."""
        epoch, reuse = int(entry.get("epoch", 0)), list(entry.get("reuse") or ())
        if epoch > self.epoch:
            self.blocks.clear()
            self.epoch = epoch
        if epoch < self.epoch:  # a decision the coordinator has since dropped
            if reuse:
                raise PrefixMiss(f"{seq}: prefix epoch {epoch} is gone (this stage is at {self.epoch})")
            return
        if reuse and runner.layers:  # a stage without decoder layers keeps no KV
            self._install(runner, seq, reuse, int(entry["block"]))
        for name in entry.get("evict") or ():
            self.blocks.pop(name, None)

    def _install(self, runner: StageRunner, seq: str, reuse: list[str], block: int) -> None:
        missing = [name for name in reuse if name not in self.blocks]
        if missing:
            raise PrefixMiss(f"{seq}: this stage lacks prefix block {missing[0][:12]} ({len(missing)} of {len(reuse)})")
        if runner.length(seq):
            raise ValueError(f"{seq} already holds {runner.length(seq)} positions: a prefix is installed into a new sequence only")
        parts = [self.blocks[name] for name in reuse]
        tensors = {key: np.concatenate([p[key] for p in parts], axis=2) for key in parts[0]}
        runner.import_kv(seq, tensors, len(reuse) * block)

    def after(self, runner: StageRunner, seq: str, entry: dict) -> None:
        """Keep the blocks the frame names (positions its prefill computed) once it has run."""
        save = entry.get("save") or ()
        if not save or not runner.layers or int(entry.get("epoch", 0)) != self.epoch:
            return
        block = int(entry["block"])
        kv = runner.export_kv(seq)
        for index, name in save:
            lo = int(index) * block
            if lo + block > runner.length(seq):
                raise ValueError(f"{seq}: block {index} ends past the {runner.length(seq)} positions computed")
            self.blocks[str(name)] = {key: np.ascontiguousarray(a[:, :, lo:lo + block]) for key, a in kv.items()}
