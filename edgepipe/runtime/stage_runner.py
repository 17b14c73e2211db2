"""Run one contiguous range of units as a single ONNX Runtime session.

The runner owns the KV cache of its layers, one per sequence. Each cache is a buffer of
capacity C tokens per layer, ``[1, kv_heads, C, head_dim]``; GroupQueryAttention reads and
writes it in place (past and present bound to the same memory), so a decode step touches
only the new token's rows. Capacity grows in blocks, copying the live prefix once per block.

Inputs and outputs by stage position:

    first stage   x = token ids [1, S] int64          otherwise x = hidden [1, S, H] float32
    last stage    returns next token ids [1] int64    otherwise returns hidden [1, S, H]

Needs only ``onnxruntime`` and ``numpy`` (workers import this module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

KV_BLOCK = 256


class ContextOverflow(ValueError):
    """A sequence would exceed the stage's context limit."""


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters fed to the head graph; ``uniform`` is the random draw."""

    do_sample: bool
    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int64, 0 = no limit
    top_p: np.ndarray  # [B] float32
    uniform: np.ndarray  # [B] float32 in [0, 1)

    @classmethod
    def greedy(cls, batch: int) -> "SamplingBatch":
        return cls(False, np.ones(batch, np.float32), np.zeros(batch, np.int64), np.ones(batch, np.float32), np.zeros(batch, np.float32))

    def feeds(self) -> dict[str, np.ndarray]:
        return {"do_sample": np.array(self.do_sample), "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "uniform": self.uniform}


class _SequenceCache:
    """KV buffers of one sequence for every layer of the stage."""

    def __init__(self, layers: list[int], kv_heads: int, head_dim: int):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.length = 0
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}
        self.values: dict[str, ort.OrtValue] = {}

    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // KV_BLOCK) * KV_BLOCK
        for u in self.layers:
            for kind in ("key", "value"):
                name = f"{kind}.{u}"
                grown = np.zeros((1, self.kv_heads, capacity, self.head_dim), np.float32)
                if self.length:
                    grown[:, :, : self.length] = self.arrays[name][:, :, : self.length]
                self.arrays[name] = grown
                self.values[name] = ort.OrtValue.ortvalue_from_numpy(grown)  # shares memory
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def export(self) -> dict[str, np.ndarray]:
        """The live prefix of each layer's K and V (for moving a sequence to another worker)."""
        return {name: a[:, :, : self.length].copy() for name, a in self.arrays.items()}


class StageRunner:
    """One ONNX Runtime session over units ``[start, end)``, plus per-sequence KV caches."""

    def __init__(self, graph_path: str | Path, threads: int | None = None, max_context: int | None = None):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0" if threads == 1 else "1")
        self.session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.layers = sorted(int(m.group(1)) for n in inputs if (m := re.fullmatch(r"past_key\.(\d+)", n)))
        self.takes_token_ids = "input_ids" in inputs
        self.input_name = "input_ids" if self.takes_token_ids else next(n for n in inputs if n.startswith("hidden."))
        self.emits_tokens = "next_token" in outputs
        self.output_name = "next_token" if self.emits_tokens else next(n for n in outputs if n.startswith("hidden."))
        if self.layers:
            shape = inputs[f"past_key.{self.layers[0]}"].shape
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.max_context = max_context
        self._caches: dict[str, _SequenceCache] = {}

    # -- sequences --------------------------------------------------------------------------
    def length(self, seq: str) -> int:
        cache = self._caches.get(seq)
        return cache.length if cache else 0

    def drop(self, seq: str) -> None:
        self._caches.pop(seq, None)

    def sequences(self) -> list[str]:
        return list(self._caches)

    @property
    def kv_bytes(self) -> int:
        return sum(c.nbytes for c in self._caches.values())

    def export_kv(self, seq: str) -> dict[str, np.ndarray]:
        return self._caches[seq].export() if seq in self._caches else {}

    def import_kv(self, seq: str, tensors: dict[str, np.ndarray]) -> None:
        """Install a sequence's KV moved from another runner (same layers)."""
        cache = self._cache(seq)
        length = next(iter(tensors.values())).shape[2] if tensors else 0
        cache.length = 0
        cache.reserve(length + 1)
        for name, arr in tensors.items():
            cache.arrays[name][:, :, :length] = arr
        cache.length = length

    def _cache(self, seq: str) -> _SequenceCache:
        cache = self._caches.get(seq)
        if cache is None:
            cache = self._caches[seq] = _SequenceCache(self.layers, getattr(self, "kv_heads", 0), getattr(self, "head_dim", 0))
        return cache

    # -- compute ----------------------------------------------------------------------------
    def run(self, seq: str, x: np.ndarray, sampling: SamplingBatch | None = None) -> np.ndarray:
        """Feed ``S`` new positions of one sequence; returns hidden ``[1, S, H]`` or token ``[1]``."""
        new = int(x.shape[1])
        cache = self._cache(seq)
        total = cache.length + new
        if self.max_context and total > self.max_context:
            raise ContextOverflow(f"sequence {seq} would reach {total} tokens, over the context of {self.max_context}")
        binding = self.session.io_binding()
        binding.bind_cpu_input(self.input_name, np.ascontiguousarray(x))
        binding.bind_output(self.output_name, "cpu")
        if self.layers:
            cache.reserve(total)
            binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
            binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
            for u in self.layers:
                for kind in ("key", "value"):
                    value = cache.values[f"{kind}.{u}"]
                    binding.bind_ortvalue_input(f"past_{kind}.{u}", value)
                    binding.bind_ortvalue_output(f"present_{kind}.{u}", value)
        if self.emits_tokens:
            for name, arr in (sampling or SamplingBatch.greedy(1)).feeds().items():
                binding.bind_cpu_input(name, arr)
        self.session.run_with_iobinding(binding)
        out = binding.get_outputs()[0].numpy()
        cache.length = total
        return out
