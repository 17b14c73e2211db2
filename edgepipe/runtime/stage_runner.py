"""Run one contiguous range of units as a single ONNX Runtime session.

The runner owns the KV cache of its layers for every sequence: one pool per layer,
``[rows, kv_heads, C, head_dim]``, a row per sequence, in the graph's KV dtype (float32; float16
for the kernel form's KvAttention). The attention op reads and writes it in place (past and
present bound to the same memory), so a decode step touches only the new token's positions. Decode steps of several sequences run as one batch over their rows.

Inputs and outputs by stage position:

    first stage   x = token ids [1, S] int64          otherwise x = hidden [1, S, H] float32
    last stage    returns next token ids [1] int64    otherwise returns hidden [1, S, H]

Needs only ``onnxruntime`` and ``numpy`` (workers import this module).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..native import register_gguf_kernel
from .devices import CPU, ExecutionDevice, add_to_session

KV_BLOCK = 256
WINDOW_SLACK = 64  # a sliding-window layer drops old positions in steps of this many (window_start)


ORT_LOG_ERROR = 3  # ONNX Runtime's severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal


class ContextOverflow(ValueError):
    """A sequence would exceed the stage's context limit."""


HEAD_EXTRA_OUTPUTS = ("token_logprob", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs")
MAX_TOP = 20
OLD_HEAD = "this model package's head graph predates logprobs and logit controls: re-import the model (edgepipe import)"
# The verify form's names (graphs.verify_form; written twice so that workers need not import onnx)
DECODE_ROWS_KEY = "edgepipe.decode_rows"
HEAD_POSITIONS = "head_positions"
SAMPLER_OUTPUTS = ("sampler_probs", "sampler_ids")  # graphs.sampler_form


@dataclass(frozen=True)
class RowControls:
    """What one sequence adds to its logits this step, as it travels: sparse ``(id, value)``
    pairs (logit_bias and penalties folded into one value per id) and an optional allowed-token
    bitmask (``ceil(V/8)`` bytes, bit ``i % 8`` of byte ``i // 8`` = token ``i``, i.e. numpy's
    ``packbits(bitorder="little")`` and llguidance's int32 bitmask viewed as bytes)."""

    ids: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    mask: bytes | None = None

    @property
    def empty(self) -> bool:
        return not self.ids and self.mask is None


def logit_adjust(rows: list[RowControls | None], vocab: int) -> np.ndarray | None:
    """The head's dense ``logit_adjust [B, V]`` from each row's sparse controls (None: none at all).

    Disallowed tokens get -inf; a mask that allows nothing, an id outside the vocabulary or a
    non-finite value raises ``ValueError`` (one line)."""
    if all(r is None or r.empty for r in rows):
        return None
    dense = np.zeros((len(rows), vocab), np.float32)
    for i, r in enumerate(rows):
        if r is None:
            continue
        if r.ids:
            ids, values = np.asarray(r.ids, np.int64), np.asarray(r.values, np.float32)
            if ids.shape != values.shape or ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"logit adjustment ids must be in [0, {vocab}) with one value each")
            if not np.isfinite(values).all():
                raise ValueError("logit adjustment values must be finite")
            np.add.at(dense[i], ids, values)
        if r.mask is not None:
            if len(r.mask) != (vocab + 7) // 8:
                raise ValueError(f"token mask has {len(r.mask)} bytes, need {(vocab + 7) // 8} for {vocab} tokens")
            allowed = np.unpackbits(np.frombuffer(r.mask, np.uint8), bitorder="little", count=vocab).astype(bool)
            if not allowed.any():
                raise ValueError("token mask allows no token")
            dense[i, ~allowed] = -np.inf
    return dense


def position_controls(sampling: dict) -> list[RowControls | None]:
    """A verify entry's controls per position: ``masks`` (a mask per position, speculative
    decoding with a response format) with the entry's other controls; else its one row."""
    masks = sampling.get("masks")
    if masks is None:
        return [row_controls(sampling)]
    if not (isinstance(masks, list) and masks and all(isinstance(m, (bytes, bytearray)) for m in masks)) or "mask" in sampling:
        raise ValueError("masks must be a non-empty list of bytes (one mask per position), without mask")
    return [row_controls({**sampling, "masks": None, "mask": m}) for m in masks]


def row_controls(sampling: dict) -> RowControls | None:
    """A wire ``sampling`` entry's controls: ``adjust_ids``/``adjust`` lists, ``mask`` bytes."""
    ids, values, mask = sampling.get("adjust_ids"), sampling.get("adjust"), sampling.get("mask")
    if ids is None and mask is None:
        return None
    if ids is not None and not (isinstance(ids, list) and isinstance(values, list) and len(ids) == len(values)
                                and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
                                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise ValueError("adjust_ids and adjust must be lists of one length (integer ids, numbers)")
    if mask is not None and not isinstance(mask, (bytes, bytearray)):
        raise ValueError("mask must be bytes")
    return RowControls(tuple(ids or ()), tuple(float(v) for v in values or ()), None if mask is None else bytes(mask))


@dataclass(frozen=True)
class HeadOutput:
    """What the head returned besides the tokens, rows in the order of the batch's sequences."""

    token_logprob: np.ndarray  # [B] float32: logprob of the chosen token (raw logits, see graphs.head_unit)
    top_ids: np.ndarray  # [B, N] int64
    top_logprobs: np.ndarray  # [B, N] float32
    prompt_logprobs: np.ndarray | None = None  # [S] of a prefill asked for them: position i's logprob of token i + 1
    prompt_top_ids: np.ndarray | None = None  # [S, N]
    prompt_top_logprobs: np.ndarray | None = None  # [S, N]

    def wire(self, row: int, top: int) -> dict:
        """Row ``row``'s ``logprobs`` entry of a TOKEN frame: chosen logprob, top ``top`` ids and logprobs."""
        out = {"logprob": float(self.token_logprob[row]), "top_ids": [int(t) for t in self.top_ids[row, :top]],
               "top_logprobs": [float(v) for v in self.top_logprobs[row, :top]]}
        if self.prompt_logprobs is not None:
            out["prompt"] = [[float(v) for v in self.prompt_logprobs], [[int(t) for t in r[:top]] for r in self.prompt_top_ids],
                             [[float(v) for v in r[:top]] for r in self.prompt_top_logprobs]]
        return out


@dataclass(frozen=True)
class SamplerOutput:
    """The sampler's distribution of the latest run (``graphs.sampler_form``): per head row (a
    verify run: per position of its one sequence) token ids in the sampler's order and their kept,
    unnormalised probabilities (zero past the kept prefix)."""

    seqs: tuple[str, ...]
    probs: np.ndarray  # [rows, N] float32
    ids: np.ndarray  # [rows, N] int64


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters fed to the head graph; ``uniform`` is the random draw.

    ``adjust`` is the dense ``[B, V]`` logit adjustment (None: none), ``num_top`` how many
    alternatives to return with their logprobs (0..20), ``prompt_targets`` ``[1, S]`` the next
    prompt token of each position of a prefill whose logprobs are wanted (echo; None: not)."""

    do_sample: bool
    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int64, 0 = no limit
    top_p: np.ndarray  # [B] float32
    uniform: np.ndarray  # [B] float32 in [0, 1); a verify entry may carry one per position: [P]
    adjust: np.ndarray | None = None  # [B, V] float32; a verify entry's with a mask per position: [P, V]
    num_top: int = 0
    prompt_targets: np.ndarray | None = None  # [1, S] int64
    repeat_ids: np.ndarray | None = None  # [B, R] int64: each row's repeat-penalised ids (padded with its own first id)
    repeat_penalty: np.ndarray | None = None  # [B] float32 (1.0: a row without it)
    adjust_per_position: bool = False  # ``adjust`` has a row per head position of the one (verify) sequence
    want_sampler: bool = False  # keep the sampler's distribution (``StageRunner.last_sampler``): the sampling rule's p or q
    min_p: np.ndarray | None = None  # [B] float32 (None: 0, off); fed to heads of GRAPH_VERSION 10 on

    @classmethod
    def greedy(cls, batch: int) -> "SamplingBatch":
        return cls(False, np.ones(batch, np.float32), np.zeros(batch, np.int64), np.ones(batch, np.float32), np.zeros(batch, np.float32))

    @classmethod
    def from_wire(cls, items: list[dict], vocab: int | None) -> "SamplingBatch":
        """The batch for a forward frame's entries (``item["sampling"]`` as the coordinator sent it)."""
        s = [item["sampling"] for item in items]
        per_position = any(v.get("masks") is not None for v in s)
        if per_position and (len(items) != 1 or not items[0].get("verify")):
            raise ValueError("masks (a mask per position) come with a verify entry, one sequence at a time")
        controls = [c for v in s for c in position_controls(v)]
        targets = [v.get("targets") for v in s]
        if any(t is not None for t in targets) and len(items) != 1:
            raise ValueError("prompt targets come with a prefill, one sequence at a time")
        num_top = max(int(v.get("top") or 0) for v in s)
        if not 0 <= num_top <= MAX_TOP:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP}], got {num_top}")
        adjust = None
        if any(c is not None for c in controls):
            if not vocab:
                raise ValueError(OLD_HEAD)
            adjust = logit_adjust(controls, vocab)
        repeat_ids, repeat_penalty = repeat_rows(s, vocab)
        min_p = [v.get("min_p") or 0.0 for v in s]
        if any(not isinstance(m, (int, float)) or isinstance(m, bool) or not 0 <= m <= 1 for m in min_p):
            raise ValueError("sampling.min_p must be a number in [0, 1]")
        return cls(any(bool(v["do_sample"]) for v in s),
                   np.array([v["temperature"] for v in s], np.float32),
                   np.array([v["top_k"] if v["do_sample"] else 1 for v in s], np.int64),
                   np.array([v["top_p"] for v in s], np.float32),
                   np.array([u for v in s for u in (v["uniform"] if isinstance(v["uniform"], list) else [v["uniform"]])], np.float32),
                   adjust, num_top, None if targets[0] is None else np.array([targets[0]], np.int64), repeat_ids, repeat_penalty,
                   per_position, any("drafts" in v for v in s),
                   np.array(min_p, np.float32) if any(min_p) else None)

    @property
    def wants_head_extras(self) -> bool:
        return self.adjust is not None or self.num_top > 0 or self.prompt_targets is not None or self.repeat_ids is not None

    def feeds(self) -> dict[str, np.ndarray]:
        return {"do_sample": np.array(self.do_sample), "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "uniform": self.uniform,
                "min_p": np.zeros(len(self.temperature), np.float32) if self.min_p is None else self.min_p}


def repeat_rows(entries: list[dict], vocab: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The head's ``repeat_ids [B, R]`` and ``repeat_penalty [B]`` from wire ``sampling`` entries
    (None, None when no row asks). A row's ids are padded with its own first id (a repeated id is
    penalised once: every copy writes the same value), a row without any gets penalty 1."""
    asked = [e.get("repeat_ids") for e in entries]
    if not any(asked):
        return None, None
    if not vocab:
        raise ValueError(OLD_HEAD)
    width = max(len(a) for a in asked if a)
    ids = np.zeros((len(entries), width), np.int64)
    penalty = np.ones(len(entries), np.float32)
    for i, (row, entry) in enumerate(zip(asked, entries)):
        if not row:
            continue
        if not (isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row)):
            raise ValueError(f"repeat_ids must be a list of token ids in [0, {vocab})")
        p = entry.get("repeat_penalty")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
            raise ValueError("repeat_penalty must be a number in (0, 100]")
        ids[i] = row + [row[0]] * (width - len(row))
        penalty[i] = p
    return ids, penalty


def window_start(length: int, window: int) -> int:
    """First position a sliding-window layer keeps once a sequence holds ``length`` positions.

    The next query (at ``length``) sees positions ``length - window + 1 ..``; older ones are
    dropped in steps of ``window_slack(window)`` (a shift of the whole window costs a copy, so
    it happens once per slack tokens, not every token). A pure function of the length: every
    stage, a runner that imports the sequence, and a replay lay the cache out the same way."""
    slack = window_slack(window)
    return max(0, (length - window + 1) // slack * slack)


def window_slack(window: int) -> int:
    return max(1, min(WINDOW_SLACK, window))


def window_positions(window: int) -> int:
    """Positions a window layer's cache holds at most around a decode step (the planner's figure)."""
    return window + window_slack(window) - 1


class _KVPool:
    """KV buffers of every sequence at this stage: per layer ``[rows, kv_heads, C, head_dim]``.

    A sequence owns one row. A batch runs over a contiguous range of rows (a C-contiguous
    slice, bound without copying); rows in that range that are not in the batch receive a
    write at their next free position, which their own next step overwrites, so their
    history is never touched. Rows and capacity grow by reallocation (copying live rows once).

    Sliding-window layers (``window``: all of them share one window) keep only positions
    ``start .. length`` of a sequence (``window_start``) in buffers of their own capacity,
    ``window_positions`` (more only while a prefill chunk needs it); buffer index 0 holds
    position ``start``.

    With ``memory_info`` (a GPU's memory) the buffers are OrtValues in that memory and stay there
    across steps: a batch then runs over all rows (no row view exists of device memory, and the
    bystanders' writes are harmless, as above), and the rare whole-buffer changes (growth, row
    swaps, window shifts, export and import) pass through the host one layer's buffer at a time.
    """

    def __init__(self, layers: list[int], kv_heads: int, head_dim: int, window: int = 0, window_layers: tuple[int, ...] = (),
                 memory_info=None, dtype=np.float32):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype = np.dtype(dtype)  # the graph's: float32 (GroupQueryAttention), float16 (the kernel form's KvAttention)
        self.memory_info = memory_info
        self.window, self.window_names = window, {f"{kind}.{u}" for u in window_layers for kind in ("key", "value")}
        self.rows = 0
        self.capacity = 0
        self.window_capacity = 0
        self.generation = 0  # bumped whenever the buffers are reallocated
        self.arrays: dict[str, np.ndarray | ort.OrtValue] = {}
        self.row_of: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self.start: dict[str, int] = {}  # first position the window layers keep

    def kept(self, seq: str) -> int:
        """Positions a window layer holds for ``seq`` (its buffer's next free index)."""
        return self.length.get(seq, 0) - self.start.get(seq, 0)

    def _realloc(self, rows: int, capacity: int, window_capacity: int | None = None) -> None:
        window_capacity = self.window_capacity if window_capacity is None else window_capacity
        for u in self.layers:
            for kind in ("key", "value"):
                name = f"{kind}.{u}"
                windowed = name in self.window_names
                grown = np.zeros((rows, self.kv_heads, window_capacity if windowed else capacity, self.head_dim), self.dtype)
                if name in self.arrays and self.rows and self.capacity:
                    live = max((self.kept(s) if windowed else self.length[s] for s in self.row_of), default=0)
                    grown[: self.rows, :, :live] = self.host(name)[:, :, :live]
                self.arrays[name] = grown if self.memory_info is None else self._to_device(grown)
        self.rows, self.capacity, self.window_capacity = rows, capacity, window_capacity
        self.generation += 1

    @property
    def on_device(self) -> bool:
        return self.memory_info is not None

    def _to_device(self, array: np.ndarray) -> ort.OrtValue:
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype, memory_info=self.memory_info)
        value.update_inplace(array)
        return value

    def host(self, name: str) -> np.ndarray:
        """Buffer ``name`` as a numpy array: itself in host memory, a copy of a device buffer."""
        a = self.arrays[name]
        return a if isinstance(a, np.ndarray) else a.numpy()

    def store(self, name: str, array: np.ndarray) -> None:
        """Write back what :meth:`host` gave after changing it (a no-op in host memory)."""
        a = self.arrays[name]
        if not isinstance(a, np.ndarray):
            a.update_inplace(np.ascontiguousarray(array))

    def add(self, seq: str) -> int:
        used = set(self.row_of.values())
        row = next((r for r in range(self.rows) if r not in used), None)
        if row is None:
            row = self.rows
            self._realloc(max(1, self.rows * 2) if self.rows else 1, max(self.capacity, KV_BLOCK), self._window_floor())
        self.row_of[seq] = row
        self.length[seq] = 0
        self.start[seq] = 0
        return row

    def _window_floor(self) -> int:
        return max(self.window_capacity, window_positions(self.window)) if self.window_names else 0

    def drop(self, seq: str) -> None:
        self.row_of.pop(seq, None)
        self.length.pop(seq, None)
        self.start.pop(seq, None)
        if not self.row_of:  # nothing live: give the memory back
            self.arrays.clear()
            self.rows = self.capacity = self.window_capacity = 0
            self.generation += 1

    def gather(self, seqs: list[str]) -> None:
        """Swap rows so that ``seqs`` own one contiguous range (starting at their lowest row).

        A micro-batch keeps its members from step to step, so this copies rows once per
        batch that forms, and every later step runs over exactly the batch's rows."""
        rows = sorted(self.row_of[s] for s in seqs)
        lo = rows[0]
        holder = {r: s for s, r in self.row_of.items()}
        outside = [self.row_of[s] for s in seqs if self.row_of[s] >= lo + len(seqs)]
        for target in range(lo, lo + len(seqs)):
            if holder.get(target) in seqs:
                continue
            src = outside.pop()
            for name in self.arrays:
                a = self.host(name)
                a[[target, src]] = a[[src, target]]
                self.store(name, a)
            mover, other = holder[src], holder.get(target)
            self.row_of[mover] = target
            holder[target] = mover
            if other is not None:
                self.row_of[other] = src
                holder[src] = other
            else:
                del holder[src]

    def reserve(self, tokens: int, window_tokens: int = 0) -> None:
        """Room for ``tokens`` positions in every row (plus the harmless write of bystanders),
        and ``window_tokens`` in the window layers' buffers."""
        grow = tokens > self.capacity
        window_capacity = self.window_capacity
        if self.window_names and window_tokens > window_capacity:
            window_capacity, grow = window_tokens, True
        if grow:
            self._realloc(self.rows, max(self.capacity, -(-tokens // KV_BLOCK) * KV_BLOCK), window_capacity)

    def trim(self, seqs: list[str]) -> None:
        """Drop the positions the window layers no longer need (``window_start``), moving the
        rest to the front of their rows; give back a prefill's extra window capacity."""
        if not self.window_names:
            return
        for seq in seqs:
            target = window_start(self.length[seq], self.window)
            drop = target - self.start[seq]
            if drop > 0:
                r, keep = self.row_of[seq], self.length[seq] - target
                for name in self.window_names:
                    a = self.host(name)
                    a[r, :, :keep] = a[r, :, drop : drop + keep].copy()
                    self.store(name, a)
                self.start[seq] = target
        floor = window_positions(self.window)
        if self.window_capacity > floor and max(map(self.kept, self.row_of), default=0) < floor:
            self._realloc(self.rows, self.capacity, floor)

    def view(self, lo: int, hi: int) -> dict[str, ort.OrtValue]:
        if self.on_device:
            if (lo, hi) != (0, self.rows):
                raise ValueError("a device KV pool is bound whole")
            return dict(self.arrays)
        return {name: ort.OrtValue.ortvalue_from_numpy(a[lo:hi]) for name, a in self.arrays.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes if isinstance(a, np.ndarray) else a.tensor_size_in_bytes() for a in self.arrays.values())

    def export(self, seq: str, since: int = 0, upto: int | None = None) -> dict[str, np.ndarray]:
        """Every layer's positions of ``seq`` below ``upto`` (default: its length), a full-cache
        layer's from ``since``: a window layer's are the last ones that length keeps."""
        r, n, start = self.row_of[seq], self.length[seq], self.start[seq]
        n = n if upto is None else min(upto, n)
        lo = window_start(n, self.window) if self.window_names else 0
        if self.window_names and lo < start:
            raise ValueError(f"{seq}: the sliding-window layers no longer hold what {n} positions need")
        return {name: self.host(name)[r : r + 1, :, lo - start : n - start].copy() if name in self.window_names
                else self.host(name)[r : r + 1, :, since:n].copy() for name in self.arrays}

    def write(self, seq: str, name: str, positions: np.ndarray, at: int = 0) -> None:
        """Set ``positions.shape[2]`` positions of ``seq`` in buffer ``name`` from ``at`` on (an import).

        KV of another dtype is converted: fp16 into an fp32 pool exactly, fp32 into an fp16 pool
        rounded to nearest even (what KvAttention itself stores), so a sequence moved from a
        fallback worker to a kernel worker continues from values within fp16 rounding of its own."""
        row = self.row_of[seq]
        a = self.host(name)
        a[row : row + 1, :, at : at + positions.shape[2]] = positions
        self.store(name, a)


def spin_by_default(threads: int | None) -> bool:
    """Whether a lone session's pool threads should spin between ops: with two or more threads on
    a machine whose cores are mostly free (under half of them busy) when the session is made.

    Spinning won 7-8% of 2-thread decode on a quiet 2-core machine (the pool's threads wake per op
    otherwise) and costs nothing while idle (they block after a short spin), but it takes cores
    from other processes while decoding: several workers or stages sharing a machine turn it off
    (``serve``'s local workers never spin; ``edgepipe worker --no-spin``)."""
    cores = os.cpu_count() or 1
    return (threads or cores) >= 2 and busy_cores() < cores / 2


_busy_sample: tuple[float, float] = (-1e9, 0.0)  # (monotonic time, busy cores): one sample serves a few seconds


def busy_cores(sample_s: float = 0.2, reuse_s: float = 5.0) -> float:
    """Cores busy right now, from /proc/stat over ``sample_s`` (the load average elsewhere; it
    would count this process's own decoding of a minute ago). A sample younger than ``reuse_s``
    is reused: sessions made together (a pipeline, tests) do not each wait for one."""
    global _busy_sample
    if time.monotonic() - _busy_sample[0] < reuse_s:
        return _busy_sample[1]

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + (values[4] if len(values) > 4 else 0)  # all, idle + iowait

    try:
        total0, idle0 = ticks()
        time.sleep(sample_s)
        total1, idle1 = ticks()
        spent = total1 - total0
        busy = (os.cpu_count() or 1) * (1 - (idle1 - idle0) / spent) if spent > 0 else 0.0
    except (OSError, ValueError, IndexError):
        try:
            busy = os.getloadavg()[0]
        except OSError:
            busy = 0.0
    _busy_sample = (time.monotonic(), busy)
    return busy


class StageRunner:
    """One ONNX Runtime session over units ``[start, end)``, plus per-sequence KV caches.

    ``device``: where it computes (``devices.resolve``); on a GPU the KV pool lives in the GPU's
    memory, so a decode step moves only the stage's input and output across (and the head's
    token and logprobs); ``host_bytes`` counts what the latest step moved."""

    def __init__(self, graph_path: str | Path, threads: int | None = None, max_context: int | None = None, spin: bool = False,
                 device: ExecutionDevice | None = None, provider_options: dict | None = None):
        self.device = device or CPU
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Errors only: the GPU form's optimizer otherwise prints a warning per initializer it drops
        # ("Removing initializer ... It is not used by any node"), ~250 of them as a GPU worker joins.
        options.log_severity_level = ORT_LOG_ERROR
        # Spinning threads win on an idle machine but halve throughput when another process (or
        # another stage's session in this process) needs the core: callers decide (spin_by_default).
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        # ...and only within a run: once it returns, the pool's threads block at once instead of
        # spinning on while this process's loop, the coordinator or a client need the cores.
        options.add_session_config_entry("session.force_spinning_stop", "1" if spin else "0")
        register_gguf_kernel(options, graph_path)  # graphs of the `gguf` precision run the native kernel library
        providers = add_to_session(options, self.device, provider_options)
        self.session = ort.InferenceSession(str(graph_path), options, providers=providers)
        self.host_bytes = 0
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        self.layers = sorted(int(m.group(1)) for n in inputs if (m := re.fullmatch(r"past_key\.(\d+)", n)))
        self.takes_token_ids = "input_ids" in inputs
        # absolute positions: a sliding-window layer rotates at them, a learned-position embedding (GPT-2) adds their rows
        self.takes_positions = "position_ids" in inputs
        self.input_name = "input_ids" if self.takes_token_ids else next(n for n in inputs if n.startswith("hidden."))
        self.emits_tokens = "next_token" in outputs
        self.output_name = "next_token" if self.emits_tokens else next(n for n in outputs if n.startswith("hidden."))
        # A head built before logprobs/controls (GRAPH_VERSION 1) lacks these: plain requests still run on it.
        self.head_controls = self.emits_tokens and "logit_adjust" in inputs
        self.head_repeat = self.emits_tokens and "repeat_ids" in inputs  # GRAPH_VERSION 8 heads
        self.head_min_p = self.emits_tokens and "min_p" in inputs  # GRAPH_VERSION 10 heads
        self.vocab = int(inputs["logit_adjust"].shape[1]) if self.head_controls else None
        self._extra_outputs = HEAD_EXTRA_OUTPUTS if self.head_controls else ()
        self._no_adjust = np.zeros((1, self.vocab or 0), np.float32)
        self._no_adjust_device = None
        self.last_head: tuple[tuple, HeadOutput] | None = None  # (seqs, the head's logprobs) of the latest run_batch
        # graphs.sampler_form: the sampler's distribution (a draft model's head, a verify-form head)
        self._sampler_outputs = SAMPLER_OUTPUTS if self.emits_tokens and set(SAMPLER_OUTPUTS) <= set(outputs) else ()
        self.last_sampler: SamplerOutput | None = None
        if self.layers:
            shape = inputs[f"past_key.{self.layers[0]}"].shape
            self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.max_context = max_context
        # Sliding-window layers name their cache's length dimension "window_W" (graphs.layer_unit).
        windows = {u: int(m.group(1)) for u in self.layers
                   if (m := re.fullmatch(r"window_(\d+)", str(inputs[f"past_key.{u}"].shape[2])))}
        if len(set(windows.values())) > 1:
            raise ValueError(f"a stage's sliding-window layers must share one window, got {sorted(set(windows.values()))}")
        self.window = max(windows.values(), default=0)
        self._full_lengths = "seqlens_k" in inputs  # a stage of window layers only has no full-cache layer
        # The verify form (graphs.verify_form): decode steps attend on two positions, the head runs at chosen ones.
        self.decode_rows = int(self.session.get_modelmeta().custom_metadata_map.get(DECODE_ROWS_KEY, "1"))
        self.head_positions = self.emits_tokens and HEAD_POSITIONS in inputs
        self.kv_dtype = np.float16 if self.layers and inputs[f"past_key.{self.layers[0]}"].type == "tensor(float16)" else np.float32
        self._pool = _KVPool(self.layers, getattr(self, "kv_heads", 0), getattr(self, "head_dim", 0), self.window, tuple(windows),
                             self.device.memory_info(), self.kv_dtype)
        self._bound, self._bound_key = None, None
        self._outputs_shape_key = None  # what the bound outputs' shapes follow from, at the latest run

    # -- sequences --------------------------------------------------------------------------
    def length(self, seq: str) -> int:
        return self._pool.length.get(seq, 0)

    def drop(self, seq: str) -> None:
        self._pool.drop(seq)

    def rewind(self, seq: str, length: int) -> None:
        """Forget ``seq``'s positions from ``length`` on (a verify pass's rejected drafts): the
        next step writes over them. ``ValueError`` when a sliding-window layer already dropped a
        position the shorter sequence still needs."""
        pool = self._pool
        if seq not in pool.row_of or length >= pool.length[seq]:
            return
        if length < 0:
            raise ValueError(f"cannot rewind {seq} to {length} positions")
        if pool.window_names and pool.start[seq] > window_start(length, self.window):
            raise ValueError(f"{seq}: the sliding-window layers no longer hold what {length} positions need")
        pool.length[seq] = length

    def place(self, seq: str, length: int) -> None:
        """A stage without decoder layers holds no KV, only where each sequence's positions
        start (a learned-position embedding adds their rows): the frame's ``pos`` says it, so a
        sequence this stage never saw (a plan switch, cached prefix blocks, a rewind) starts
        right. A stage with layers keeps its own length (``forward_problem`` checks it)."""
        if self.layers:
            return
        if seq not in self._pool.row_of:
            self._pool.add(seq)
        self._pool.length[seq] = max(0, int(length))

    def sequences(self) -> list[str]:
        return list(self._pool.row_of)

    @property
    def kv_bytes(self) -> int:
        return self._pool.nbytes

    def export_kv(self, seq: str, since: int = 0, upto: int | None = None) -> dict[str, np.ndarray]:
        """``seq``'s KV; ``since``: full-cache layers only from that position on (a window
        layer's last positions travel whole); ``upto``: as it was when ``upto`` positions long
        (``ValueError`` when a window layer no longer holds what that length needs)."""
        return self._pool.export(seq, since, upto) if seq in self._pool.row_of else {}

    def import_kv(self, seq: str, tensors: dict[str, np.ndarray], length: int | None = None, since: int = 0) -> None:
        """Install a sequence's KV moved from another runner (same layers). ``length`` is the
        sequence's length (the sender's ``length(seq)``): sliding-window layers' tensors hold
        only their last positions, so without a full-cache layer it cannot be read off a shape.
        ``since``: the full-cache layers' tensors start at that position (an increment appended to
        what this runner holds: it must hold ``since`` positions, or ``length`` where another part
        of the same increment, other layers, came first)."""
        pool = self._pool
        full = [arr.shape[2] for name, arr in tensors.items() if name not in pool.window_names]
        if length is None:
            if not full and tensors:
                raise ValueError("importing only sliding-window layers needs the sequence's length")
            length = max(full, default=0) + since
        if since and pool.length.get(seq) not in (since, length):
            raise ValueError(f"{seq} holds {pool.length.get(seq, 0)} positions: KV from position {since} cannot be appended")
        if any(n != length - since for n in full):
            raise ValueError(f"KV of {max(full)} positions from {since} for a sequence of {length}")
        start = window_start(length, self.window) if pool.window_names else 0
        kept = {name: arr.shape[2] for name, arr in tensors.items() if name in pool.window_names}
        if any(n < length - start for n in kept.values()):
            raise ValueError(f"a sliding-window layer's KV holds {min(kept.values())} positions, need {length - start}")
        if seq not in pool.row_of:
            pool.add(seq)
        pool.reserve(length + 1, length - start + 1)
        for name, arr in tensors.items():
            if name in pool.window_names:  # the last length - start positions (a sender may keep more)
                pool.write(seq, name, arr[:, :, arr.shape[2] - (length - start):])
            else:
                pool.write(seq, name, arr, since)
        pool.length[seq], pool.start[seq] = length, start
        pool.trim([seq])

    # -- compute ----------------------------------------------------------------------------
    def run(self, seq: str, x: np.ndarray, sampling: SamplingBatch | None = None, verify: bool = False) -> np.ndarray:
        """Feed ``S`` new positions of one sequence; returns hidden ``[1, S, H]`` or token ``[1]``
        (``verify``, on a head in the verify form: the token after each position, ``[S]``)."""
        return self.run_batch([seq], x, sampling, verify)

    def _binding(self, lo: int, hi: int):
        """An IOBinding with rows ``[lo, hi)`` of the KV pool bound in place, reused until the
        pool is reallocated (binding 2 x layers buffers every step costs more than the step's
        small ops)."""
        key = (lo, hi, self._pool.generation)
        if self._bound_key != key:
            binding = self.session.io_binding()
            binding.bind_output(self.output_name, "cpu")  # first, so get_outputs()[0] is always it
            for name in (*self._extra_outputs, *self._sampler_outputs):  # then the head's logprobs and sampler, in this order
                binding.bind_output(name, "cpu")
            for name, value in self._pool.view(lo, hi).items():
                kind, unit = name.split(".")
                binding.bind_ortvalue_input(f"past_{kind}.{unit}", value)
                binding.bind_ortvalue_output(f"present_{kind}.{unit}", value)
            self._bound, self._bound_key, self._outputs_shape_key = binding, key, None
        return self._bound

    def run_batch(self, seqs: list[str], x: np.ndarray, sampling: SamplingBatch | None = None, verify: bool = False) -> np.ndarray:
        """One step for several sequences: ``x`` is ``[B, S, ...]``; ``S > 1`` needs ``B == 1``.

        Returns hidden ``[B, S, H]`` or next tokens ``[B]``, in the order of ``seqs``; a head in
        the verify form with ``verify`` returns the token after every position, ``[S]`` (B = 1).
        """
        pool = self._pool
        new = int(x.shape[1])
        if new > 1 and len(seqs) > 1:
            raise ValueError("multi-token steps (prefill) run one sequence at a time")
        verify = verify and self.emits_tokens
        if verify and not self.head_positions:
            raise ValueError("this stage's graph cannot verify drafted tokens (not the verify form: serve --speculative sends it)")
        if pool.on_device and new > 1 and self.layers and pool.rows > (0 if seqs[0] not in pool.row_of else 1):
            return self._prefill_alone(seqs[0], x, sampling, verify)
        # A decode step in the verify form attends on two positions (see graphs.verify_form): the
        # second, a copy of the first made in the graph, is scratch that the sequence's next step overwrites.
        scratch = 1 if self.decode_rows == 2 and new == 1 else 0
        width = new + scratch  # positions attention writes
        for seq in seqs:
            if seq not in pool.row_of:
                pool.add(seq)
        totals = [pool.length[s] + new for s in seqs]
        if self.max_context and max(totals) + scratch > self.max_context:
            worst = seqs[int(np.argmax(totals))]
            raise ContextOverflow(f"sequence {worst} would reach {max(totals)} tokens, over the context of {self.max_context}")
        rows = [pool.row_of[s] for s in seqs]
        if pool.on_device:  # device memory is bound whole: every other row is a bystander
            lo, hi = 0, pool.rows
        else:
            if max(rows) - min(rows) + 1 != len(rows):
                pool.gather(seqs)
                rows = [pool.row_of[s] for s in seqs]
            lo, hi = min(rows), max(rows) + 1
        n = hi - lo
        in_order = n == len(seqs) and rows == list(range(lo, hi))  # else per-row inputs go to their rows
        if in_order:
            feed = np.ascontiguousarray(x)
        else:  # bystander rows inside [lo, hi) get a dummy input
            feed = np.zeros((n, *x.shape[1:]), x.dtype)
            feed[np.array(rows) - lo] = x
        if self.layers or self.takes_positions:
            by_row = {r: s for s, r in pool.row_of.items()}
            lengths = np.array([pool.length.get(by_row.get(r, ""), 0) for r in range(lo, hi)], np.int64)
            lengths[np.array(rows) - lo] = np.array(totals) - new
        if self.layers:
            kept = lengths - np.array([pool.start.get(by_row.get(r, ""), 0) for r in range(lo, hi)], np.int64)
            pool.reserve(int(lengths.max()) + width, int(kept.max()) + width)
        binding = self._binding(lo, hi)
        self.host_bytes = 0 if pool.on_device else sum(pool.host(k)[lo:hi].nbytes for k in pool.arrays) * 2  # read + written
        self._bind_host(binding, self.input_name, feed)
        # Outputs ORT allocated at the last run are written in place when their shapes repeat
        # (every decode step of the same rows): rebinding each costs ~20 µs. What this returns is
        # copied out of them (fancy indexing), so the next run cannot change it.
        asked = sampling is not None and sampling.prompt_targets is not None
        # head positions: every one (verify), else the last
        positions = (np.arange(new) if verify else np.array([-1])).astype(np.int64)
        per_seq = len(positions) if self.head_positions else 1
        shape_key = (n, new, per_seq, sampling.num_top if sampling is not None else 0)  # what the outputs' shapes follow from
        rebind = asked or shape_key != self._outputs_shape_key
        self._outputs_shape_key = None if asked else shape_key
        if rebind:
            binding.bind_output(self.output_name, "cpu")
        for name in self._sampler_outputs:  # their width follows the batch's top_k and do_sample
            binding.bind_output(name, "cpu")
        if self.layers and self._full_lengths:
            self._bind_host(binding, "seqlens_k", (lengths + width - 1).astype(np.int32))
            self._bind_host(binding, "total_sequence_length", np.array(int(lengths.max()) + width, np.int32))
        if self.window:  # window layers: buffer lengths, and the absolute positions to rotate at
            self._bind_host(binding, "window_seqlens_k", (kept + width - 1).astype(np.int32))
            self._bind_host(binding, "window_total_sequence_length", np.array(int(kept.max()) + width, np.int32))
        if self.takes_positions:
            self._bind_host(binding, "position_ids", lengths[:, None] + np.arange(new, dtype=np.int64)[None, :])
        if self.emits_tokens:
            batch = sampling or SamplingBatch.greedy(len(seqs))
            for name, arr in batch.feeds().items():
                if name == "min_p" and not self.head_min_p:
                    if batch.do_sample and batch.min_p is not None and batch.min_p.any():
                        raise ValueError("this head cannot apply min_p (built before GRAPH_VERSION 10: re-import the model)")
                    continue
                if arr.ndim and not in_order:
                    full = np.zeros(n, arr.dtype) if name != "temperature" and name != "top_p" else np.ones(n, arr.dtype)
                    full[np.array(rows) - lo] = arr
                    arr = full
                if arr.ndim and not (name == "uniform" and per_seq > 1 and arr.size == n * per_seq):  # (a draw per position: as sent)
                    arr = np.repeat(arr, per_seq)  # a row per head position
                self._bind_host(binding, name, arr)
            if self.head_positions:
                self._bind_host(binding, HEAD_POSITIONS, positions)
            self._bind_head_controls(binding, batch, n, np.array(rows) - lo, new, rebind, per_seq)
        self.session.run_with_iobinding(binding)
        # The pybind list, not IOBinding.get_outputs(): that wraps every bound output in a Python
        # OrtValue, the KV buffers too (61 for SmolLM2), ~150 µs a step, 1-2% of a small model's decode.
        outputs = binding._iobinding.get_outputs()
        out = outputs[0].numpy()
        self.host_bytes += out.nbytes
        # The head's rows are sequence-major, ``per_seq`` each: a verify keeps them all (B = 1), a
        # decode step its first (the real position), a prefill its only one.
        keep = slice(None) if verify else -1
        if self._extra_outputs:
            picked = np.array(rows) - lo
            head = dict(zip(self._extra_outputs, (outputs[1 + i].numpy() for i in range(len(self._extra_outputs)))))
            self.host_bytes += sum(v.nbytes for v in head.values())
            first = (lambda a: a.reshape(n, per_seq, *a.shape[1:])[picked[0], keep]) if verify else (
                lambda a: a.reshape(n, per_seq, *a.shape[1:])[picked, keep])
            self.last_head = tuple(seqs), HeadOutput(first(head["token_logprob"]), first(head["top_ids"]), first(head["top_logprobs"]),
                                                     *((head[k][0] for k in HEAD_EXTRA_OUTPUTS[3:]) if asked else ()))
        self.last_sampler = None
        if self._sampler_outputs and sampling is not None and sampling.want_sampler:  # [rows, V] each: copied only when asked
            picked = np.array(rows) - lo
            at = len(self._extra_outputs) + 1
            probs, ids = (outputs[at + i].numpy() for i in range(2))
            self.host_bytes += probs.nbytes + ids.nbytes
            rows_of = (lambda a: a.reshape(n, per_seq, -1)[picked[0]]) if verify else (lambda a: a.reshape(n, per_seq, -1)[picked, -1])
            self.last_sampler = SamplerOutput(tuple(seqs), rows_of(probs), rows_of(ids))
        for seq, total in zip(seqs, totals):
            pool.length[seq] = total
        pool.trim(seqs)  # sliding-window layers drop what no later query sees
        if self.emits_tokens:
            tokens = out.reshape(n, per_seq)
            return tokens[rows[0] - lo] if verify else tokens[np.array(rows) - lo, keep]
        return out[np.array(rows) - lo]

    def _prefill_alone(self, seq: str, x: np.ndarray, sampling: SamplingBatch | None, verify: bool = False) -> np.ndarray:
        """A multi-token step of one sequence in a device pool of several rows: attention takes a
        prefill one row at a time, and device memory has no row views, so the sequence's KV goes
        through a one-row pool of its own (its positions pass through the host, once each way)."""
        main = self._pool
        kv, length = (self.export_kv(seq), main.length[seq]) if seq in main.row_of else ({}, 0)
        self._pool = _KVPool(main.layers, main.kv_heads, main.head_dim, main.window, tuple(int(n.split(".")[1]) for n in main.window_names
                                                                                           if n.startswith("key.")), main.memory_info, main.dtype)
        self._bound_key = None
        try:
            if length:
                self.import_kv(seq, kv, length)
            out = self.run_batch([seq], x, sampling, verify)
            kv, length = self.export_kv(seq), self._pool.length[seq]
        finally:
            self._pool.drop(seq)
            self._pool, self._bound_key = main, None
        self.import_kv(seq, kv, length)
        return out

    def _bind_host(self, binding, name: str, array: np.ndarray) -> None:
        binding.bind_cpu_input(name, array)
        self.host_bytes += array.nbytes

    def logprobs_field(self, batch: list[dict], verify: bool = False) -> dict:
        """A TOKEN frame's ``logprobs`` for the batch just run: an entry per sequence that asked
        (``sampling.logprobs``), None for the others; nothing when none asked. A verify run (one
        sequence) gives its entry as a list, one per position."""
        wanted = [bool(item["sampling"].get("logprobs")) for item in batch]
        if not any(wanted):
            return {}
        seqs, head = self.last_head or ((), None)
        if head is None or seqs != tuple(item["seq"] for item in batch):
            raise RuntimeError("the head's logprobs of this batch are gone")
        if verify:
            top = int(batch[0]["sampling"].get("top") or 0)
            return {"logprobs": [[head.wire(i, top) for i in range(len(head.token_logprob))]]}
        return {"logprobs": [head.wire(i, int(item["sampling"].get("top") or 0)) if w else None
                             for i, (item, w) in enumerate(zip(batch, wanted))]}

    def _bind_head_controls(self, binding, batch: SamplingBatch, n: int, picked: np.ndarray, new: int, rebind_outputs: bool = True,
                            per_seq: int = 1) -> None:
        """The head's logit_adjust / num_top / prompt_targets (bystander rows get no adjustment);
        ``per_seq``: head rows per sequence (the verify form's head positions), each row's
        controls repeated over them."""
        if not self.head_controls:
            if batch.wants_head_extras:
                raise ValueError(OLD_HEAD)
            return
        adjust = self._no_adjust
        if batch.adjust is None and self._pool.on_device:  # the zero adjustment stays in device memory
            if self._no_adjust_device is None:
                self._no_adjust_device = self._pool._to_device(self._no_adjust)
            binding.bind_ortvalue_input("logit_adjust", self._no_adjust_device)
            adjust = None
        elif batch.adjust is not None:
            adjust = batch.adjust
            if n != len(picked) or not np.array_equal(picked, np.arange(n)):  # bystanders, or rows not in batch order
                adjust = np.zeros((n, self.vocab), np.float32)
                adjust[picked] = batch.adjust
        if adjust is not None:
            if batch.adjust_per_position:
                if adjust.shape[0] != n * per_seq:
                    raise ValueError(f"a verify pass of {per_seq} positions needs as many masks, got {adjust.shape[0]}")
            elif per_seq > 1 and adjust.shape[0] > 1:
                adjust = np.repeat(adjust, per_seq, axis=0)
            self._bind_host(binding, "logit_adjust", np.ascontiguousarray(adjust, np.float32))
        self._bind_host(binding, "num_top", np.array([batch.num_top], np.int64))
        targets = np.zeros((1, 0), np.int64)
        if batch.prompt_targets is not None:
            targets = np.ascontiguousarray(batch.prompt_targets, np.int64)
            if targets.shape != (1, new) or targets.min() < 0 or targets.max() >= self.vocab:
                raise ValueError(f"prompt targets must be one id in [0, {self.vocab}) per position of the prefill")
        self._bind_host(binding, "prompt_targets", targets)
        if self.head_repeat:
            ids, penalty = np.zeros((n, 0), np.int64), np.ones(n, np.float32)
            if batch.repeat_ids is not None:
                ids = np.zeros((n, batch.repeat_ids.shape[1]), np.int64)
                penalty[picked] = batch.repeat_penalty
                ids[picked] = batch.repeat_ids
            self._bind_host(binding, "repeat_ids", np.repeat(ids, per_seq, axis=0))
            self._bind_host(binding, "repeat_penalty", np.repeat(penalty, per_seq))
        elif batch.repeat_ids is not None:
            raise ValueError(OLD_HEAD)
        if rebind_outputs:  # fresh buffers where their shapes may change
            for name in self._extra_outputs:
                binding.bind_output(name, "cpu")
