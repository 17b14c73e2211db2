"""Import a GGUF file (or a local Hugging Face folder) into a model package.

``import_model`` builds every unit graph, stores each weight as a blob named by its SHA-256,
measures each unit's decode cost on this machine, and writes ``manifest.json`` last. The
package is assembled in a temporary directory and renamed into place, so a failed import
leaves nothing behind.

With the default precision ``native`` a GGUF's own blocks are kept exactly (``weights.NATIVE_TYPES``)
and streamed: each tensor is read a few million weights at a time, converted, and written to its
blob while it is hashed, and each unit's graph is written before the next one is built, so peak
memory does not grow with the model. ``int4``/``int8``/``fp32`` re-quantize (or dequantize) every
linear in memory, one unit at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx

from . import graphs
from .config import ModelConfig, UnsupportedModel
from .families import family
from .gguf_source import CorruptModel, GGUFSource
from .manifest import FORMAT_VERSION, Manifest, Unit, UnitVariant, sha256_bytes
from .weights import (FLOAT_TYPES, NATIVE_TYPES, PRECISIONS, BlockQuantized, Stored, StoredBlocks, StoredGGUF,
                      concat_rows, quantize_symmetric8, to_precision)

Progress = Callable[[str, int, int], None]  # (phase, done, total); phases "hash" and "weights" count bytes of the source
INLINE_LIMIT = 1024  # tensors smaller than this stay inside the graph file
CHUNK_WEIGHTS = 1 << 23  # weights converted at a time when streaming a tensor (bounds peak memory)
DEFAULT_PRECISION = "native"
DEFAULT_MAX_CONTEXT = None  # the model's own context length (its rope tables are built for that many positions)


def package_name(source: Path, precision: str) -> str:
    stem = source.stem if source.is_file() else source.name
    return re.sub(r"[^a-z0-9_]+", "-", f"{stem}-{precision}".lower()).strip("-")


def open_source(path: Path):
    if path.is_dir():
        from .hf_source import HFSource

        return HFSource(path)
    if path.suffix.lower() != ".gguf":
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CorruptModel(f"{path.name}: not a GGUF file (bad magic) and not a model folder")
    return GGUFSource(path)


def import_model(
    source_path: str | Path,
    models_dir: str | Path,
    precision: str = DEFAULT_PRECISION,
    name: str | None = None,
    max_context: int | None = DEFAULT_MAX_CONTEXT,
    progress: Progress | None = None,
    measure_cost: bool = True,
) -> Path:
    """Write the package for ``source_path`` under ``models_dir`` and return its directory.

    ``max_context``: the longest sequence the package holds (None: the model's own context
    length; more than that is cut to it). An existing package of the same name whose manifest
    names the same source hash and holds at least that context is reused.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    source_path = Path(source_path)
    if not source_path.exists():
        raise FileNotFoundError(f"{source_path}: no such model file or folder")
    if precision == "native" and source_path.is_dir():
        precision = "int4"  # a Hugging Face folder holds float weights: no blocks of its own to keep
    if precision == "gguf" and source_path.is_dir():
        raise ValueError(f"{source_path.name}: precision gguf keeps a GGUF file's bytes; a model folder has none (use native or int4)")
    if source_path.is_dir():
        open_source(source_path)  # says what is supported before hashing a whole folder
    elif source_path.suffix.lower() == ".gguf":
        from .gguf_header import check_supported

        check_supported(source_path)  # refuses from the header before hashing the file
        from .gguf_source import read_gguf_header, refuse_unsupported_types

        try:
            refuse_unsupported_types(source_path, read_gguf_header(source_path)[1])  # a type we cannot keep exactly
        except ValueError as exc:
            if isinstance(exc, UnsupportedModel):
                raise
            raise CorruptModel(f"{source_path.name}: not a readable GGUF file, truncated or damaged ({exc})") from None
    models_dir = Path(models_dir)
    target = models_dir / (name or package_name(source_path, precision))
    source_hash = _cached_sha256(source_path, models_dir, progress) if source_path.is_file() else _folder_hash(source_path)
    src = open_source(source_path)
    try:
        return _import(src, target, models_dir, precision, source_path, source_hash, max_context, progress, measure_cost)
    finally:
        close_source(src)


def close_source(src) -> None:
    """Close the file a source reads tensors from (a GGUF's; a folder's are closed as read)."""
    close = getattr(src, "close", None)
    if close is not None:
        close()


def _import(src, target: Path, models_dir: Path, precision: str, source_path: Path, source_hash: str, max_context: int | None,
            progress: Progress | None, measure_cost: bool) -> Path:
    cfg: ModelConfig = src.config
    context = cfg.context_length if max_context is None else min(max_context, cfg.context_length)
    if (target / "manifest.json").is_file():
        existing = Manifest.from_json((target / "manifest.json").read_text())
        if (existing.source.get("sha256") == source_hash and existing.source.get("graphs", 1) == graphs.GRAPH_VERSION
                and existing.max_context >= context):
            return target  # (a package built with older unit graphs, or for a shorter context, is rebuilt)
    report = progress or (lambda *_: None)
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models_dir))
    try:
        manifest = _write_package(src, cfg, tmp, target.name, precision, source_path, source_hash, context, report, measure_cost)
        (tmp / "manifest.json").write_text(manifest.to_json())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def add_variant(package_dir: str | Path, precision: str, progress: Progress | None = None, units: Iterable[int] | None = None) -> Path:
    """Add another weight variant (e.g. fp32 MatMuls for browser workers) to a package: to every
    unit, or to ``units`` only (a browser's stage: the rest is built when a stage needs it, so a
    tab on a big model does not copy the whole model at fp32). Units that hold it already are skipped.

    Blobs are written beside the existing ones (content addressing dedupes shared files) and
    the manifest is replaced atomically, so readers see either the old or the new one.
    """
    package_dir = Path(package_dir)
    manifest = Manifest.from_json((package_dir / "manifest.json").read_text())
    wanted = range(len(manifest.units)) if units is None else sorted(set(units))
    missing = frozenset(u for u in wanted if precision not in manifest.units[u].variants)
    if not missing:
        return package_dir
    source_path = Path(manifest.source["path"])
    src = open_source(source_path)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{package_dir.name}-{precision}-", dir=package_dir.parent))
    try:
        extra = _write_package(src, src.config, tmp, manifest.name, precision, source_path, manifest.source["sha256"], manifest.max_context,
                               progress or (lambda *_: None), measure_cost=False, only=missing)
        for blob in (tmp / "blobs").iterdir():
            if not (package_dir / "blobs" / blob.name).exists():
                os.replace(blob, package_dir / "blobs" / blob.name)
        merged_units = tuple(dataclasses.replace(u, variants={**u.variants, precision: e.variants[precision]}) if u.index in missing else u
                             for u, e in zip(manifest.units, extra.units))
        shared = tuple(sorted(set(manifest.shared_files.get(precision, ())) | set(extra.shared_files.get(precision, ()))))
        merged = dataclasses.replace(manifest, units=merged_units, shared_files={**manifest.shared_files, precision: shared})
        staged = package_dir / "manifest.json.tmp"
        staged.write_text(merged.to_json())
        os.replace(staged, package_dir / "manifest.json")
    finally:
        close_source(src)
        shutil.rmtree(tmp, ignore_errors=True)
    return package_dir


def estimated_weight_bytes(cfg: ModelConfig, precision: str) -> tuple[int, ...] | None:
    """Per unit, the weight bytes of ``precision``'s variant before it is built (what the planner
    sizes a browser's stage with, and what a build is counted as against the disk budget): exact
    for ``fp32`` up to the few tensors small enough to stay inside a graph (``INLINE_LIMIT``);
    None for a precision whose size this cannot tell (its blocks depend on the file)."""
    if precision != "fp32":
        return None
    H, D, V, inter = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.n_heads * D, cfg.n_kv_heads * D

    def stored(*numels: int) -> int:
        return sum(4 * n for n in numels if 4 * n >= INLINE_LIMIT)

    layer = stored(H * (q + 2 * kv), q * H, 2 * H * inter, inter * H, H, H, *((q + 2 * kv,) if cfg.attention_bias else ()),
                   *((D, D) if cfg.qk_norm else ()), *((H, H) if cfg.post_norms else ()))
    table = stored(V * H)
    return (table, *([layer] * cfg.n_layers), stored(H) + table)


def _cached_sha256(path: Path, models_dir: Path, progress: Progress | None = None) -> str:
    """The file's sha256, remembered by (path, size, mtime) so a re-import does not re-read it
    (reading it is reported as the "hash" phase, in bytes)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = models_dir.parent / "cache" / "source-hashes.json"  # beside the packages: that folder holds packages only
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _sha256_reported(path, progress or (lambda *_: None))
        cache.parent.mkdir(parents=True, exist_ok=True)
        staged = cache.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(known))
        os.replace(staged, cache)
    return known[key]


def _sha256_reported(path: Path, report: Progress, chunk: int = 1 << 22) -> str:
    h, total, done = hashlib.sha256(), path.stat().st_size, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            done += len(block)
            report("hash", done, total)
    return h.hexdigest()


def _folder_hash(folder: Path) -> str:
    parts = [f"{p.relative_to(folder)}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(folder.rglob("*")) if p.is_file()]
    return sha256_bytes("\n".join(parts).encode())


class _BlobWriter:
    """Moves initializers out of a graph into content-addressed files."""

    def __init__(self, blobs: Path):
        self.blobs = blobs
        blobs.mkdir(parents=True, exist_ok=True)

    def put(self, data: bytes) -> str:
        sha = sha256_bytes(data)
        path = self.blobs / sha
        if not path.exists():
            path.write_bytes(data)
        return sha

    def stream(self) -> "_BlobStream":
        return _BlobStream(self.blobs)

    def externalize(self, model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
        """Returns ``initializer name -> (sha, bytes)`` for every externalized tensor (including
        those the graph already references as streamed blobs)."""
        out: dict[str, tuple[str, int]] = {}
        for t in model.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in t.external_data}
                out[t.name] = (ext["location"], int(ext["length"]))
                continue
            if len(t.raw_data) < INLINE_LIMIT:
                continue
            data = t.raw_data
            sha = self.put(data)
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", sha), ("offset", "0"), ("length", str(len(data)))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v
            out[t.name] = (sha, len(data))
        return out


class _BlobStream:
    """A blob written piece by piece and hashed as it is written; ``close`` names it by its hash."""

    def __init__(self, blobs: Path):
        self.blobs = blobs
        self.tmp = blobs / f".part-{os.getpid()}-{id(self)}"
        self.file = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        self.hash.update(data)
        self.file.write(data)
        self.nbytes += len(data)

    def close(self) -> Stored:
        self.file.close()
        sha = self.hash.hexdigest()
        if (self.blobs / sha).exists():
            self.tmp.unlink()
        else:
            os.replace(self.tmp, self.blobs / sha)
        return Stored(sha, self.nbytes)


def _layout(kind: str) -> tuple:
    return ("float",) if kind in FLOAT_TYPES else (NATIVE_TYPES[kind].bits, NATIVE_TYPES[kind].block_size)


@dataclasses.dataclass
class _ReadMeter:
    """Bytes of the source converted so far, reported as the "weights" phase."""

    report: Progress
    total: int
    done: int = 0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        self.report("weights", min(self.done, self.total), self.total)


def _native_linear(src, names: list[str], writer: _BlobWriter, meter: _ReadMeter):
    """Tensors ``names`` stacked by rows (fused QKV, gate+up), their own blocks streamed to blobs.

    Consecutive tensors with the same MatMulNBits layout share one weight; a change of layout
    (Q4_K q/k beside a Q6_K v) starts a new group, and the graph concatenates the groups' outputs."""
    groups: list[tuple[tuple, list]] = []
    for name in names:
        t = src.tensor(name)
        if groups and groups[-1][0] == _layout(t.kind):
            groups[-1][1].append(t)
        else:
            groups.append((_layout(t.kind), [t]))
    out = []
    for layout, tensors in groups:
        if layout == ("float",):
            out.append(np.concatenate([src.dense(t.name).reshape(t.rows, -1) for t in tensors]))
        else:
            out.append(_stream_blocks(src, tensors, writer))
        for t in tensors:
            meter.add(t.nbytes)
    return out[0] if len(out) == 1 else out


def _gguf_linear(src, names: list[str], writer: _BlobWriter, meter: _ReadMeter):
    """Tensors ``names`` stacked by rows, as the file stores them (precision ``gguf``): consecutive
    tensors of one block type share one blob of raw rows; float tensors (or a type the kernel
    library does not run) stay float; the graph concatenates the groups' outputs."""
    from ..native import kernel_handles

    groups: list[tuple[str, list]] = []
    for name in names:
        t = src.tensor(name)
        kind = t.kind if kernel_handles(t.kind) else "native" if t.kind in NATIVE_TYPES else "float"  # a type the library does not run keeps its blocks as MatMulNBits ones
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(t)
        else:
            groups.append((kind, [t]))
    out = []
    for kind, tensors in groups:
        if kind == "float":
            out.append(np.concatenate([src.dense(t.name).reshape(t.rows, -1) for t in tensors]))
        elif kind == "native":
            out.append(_native_linear(src, [t.name for t in tensors], writer, _ReadMeter(lambda *a: None, 0)))
        else:
            blob, rows = writer.stream(), 0
            for t in tensors:
                step = max(1, CHUNK_WEIGHTS // t.shape[-1])
                for start in range(0, t.rows, step):
                    blob.write(src.raw_rows(t.name, start, min(start + step, t.rows)))
                rows += t.rows
            out.append(StoredGGUF(kind, (rows, tensors[0].shape[-1]), blob.close()))
        for t in tensors:
            meter.add(t.nbytes)
    return out[0] if len(out) == 1 else out


def _stream_blocks(src, tensors: list, writer: _BlobWriter) -> StoredBlocks:
    bits, block = _layout(tensors[0].kind)
    k = tensors[0].shape[-1]
    packed, scales = writer.stream(), writer.stream()
    zeros = None  # started on the first block that needs explicit zero points (rare)
    offsets: list[np.ndarray] = []
    with_offsets = any(NATIVE_TYPES[t.kind].has_offset for t in tensors)
    rows_done = 0

    def default_zeros(rows: int) -> bytes:
        full = np.full((rows, k // block), 2 ** (bits - 1), np.float32)
        return BlockQuantized(bits, block, np.zeros((rows, k), np.uint8), full, full).packed_zero_points().tobytes()

    for t in tensors:
        step = max(1, CHUNK_WEIGHTS // k)
        for start in range(0, t.rows, step):
            bq = src.rows(t.name, start, min(start + step, t.rows))
            rows = bq.q.shape[0]
            packed.write(bq.packed())
            scales.write(bq.scales)
            if bq.zero_points is not None and zeros is None:
                zeros = writer.stream()
                if rows_done:
                    zeros.write(default_zeros(rows_done))
            if zeros is not None:
                zeros.write(bq.packed_zero_points() if bq.zero_points is not None else default_zeros(rows))
            if with_offsets:
                offsets.append(bq.offsets if bq.offsets is not None else np.zeros_like(bq.scales))
            rows_done += rows
    return StoredBlocks(bits, block, (rows_done, k), packed.close(), scales.close(), zeros.close() if zeros else None,
                        np.concatenate(offsets) if with_offsets else None)


def _unit_weights(src, cfg: ModelConfig, layer: int, precision: str, writer: _BlobWriter | None = None,
                  meter: _ReadMeter | None = None) -> dict:
    p = f"blk.{layer}."

    def linear_of(source, *names):
        """Layer tensors ``names`` of ``source`` stacked by rows, in the package's precision."""
        full = [p + n + ".weight" for n in names]
        if precision == "native":
            return _native_linear(source, full, writer, meter)
        if precision == "gguf":
            return _gguf_linear(source, full, writer, meter)
        return concat_rows([to_precision(source.linear(n), precision) for n in full])

    fused = lin = lambda *names: linear_of(src, *names)  # noqa: E731
    w = {
        "attn_norm": src.vector(p + "attn_norm.weight"),
        "qkv": lin("attn_qkv") if src.has(p + "attn_qkv.weight") else fused("attn_q", "attn_k", "attn_v"),
        "attn_output": lin("attn_output"),
        "ffn_norm": src.vector(p + family(cfg.architecture).ffn_norm + ".weight"),
    }
    from .moe import expert_weights, is_moe_layer

    if is_moe_layer(src.has, layer):  # router and experts (model/moe.py); the gguf form keeps the 3-D blocks whole
        blocks = (lambda name: _gguf_linear(src, [p + name + ".weight"], writer, meter)) if precision == "gguf" else None
        w.update(expert_weights(src, layer, linear_of, blocks))
    else:
        w["gate_up"] = fused("ffn_gate", "ffn_up") if src.has(p + "ffn_gate.weight") else lin("ffn_up")  # Phi-3: fused
        w["ffn_down"] = lin("ffn_down")
    if cfg.attention_bias:
        w["qkv_bias"] = np.concatenate([src.vector(p + f"attn_{x}.bias") for x in "qkv"])
    if cfg.biases:  # GPT-2: LayerNorms and every linear carry a bias
        for key, name in (("attn_norm_bias", "attn_norm"), ("qkv_bias", "attn_qkv"), ("attn_output_bias", "attn_output"),
                          ("ffn_norm_bias", "ffn_norm"), ("gate_up_bias", "ffn_up"), ("ffn_down_bias", "ffn_down")):
            w[key] = src.vector(p + name + ".bias")
    if not cfg.biases and src.has(p + "attn_output.bias"):  # gpt-oss
        w["attn_output_bias"] = src.vector(p + "attn_output.bias")
    if cfg.attention_sinks:
        w["attn_sinks"] = src.vector(p + "attn_sinks.weight")
    if cfg.qk_norm:
        w["q_norm"] = src.vector(p + "attn_q_norm.weight")
        w["k_norm"] = src.vector(p + "attn_k_norm.weight")
    if cfg.post_norms:  # Gemma 2/3
        w["post_attention_norm"] = src.vector(p + "post_attention_norm.weight")
        w["post_ffw_norm"] = src.vector(p + "post_ffw_norm.weight")
    return w


def _embedding_table(src, precision: str, writer: _BlobWriter | None = None, meter: _ReadMeter | None = None):
    if precision == "gguf":
        from ..native import kernel_handles

        if kernel_handles(src.tensor("token_embd.weight").kind):  # GgufGather rows (and a tied head's GgufMatMul)
            return _gguf_linear(src, ["token_embd.weight"], writer, meter)
        precision = "native"
    if precision == "native":
        table = _native_linear(src, ["token_embd.weight"], writer, meter) if src.tensor("token_embd.weight").kind not in FLOAT_TYPES else None
        if isinstance(table, StoredBlocks) and table.zero_points is None:
            return table
        return src.dense("token_embd.weight")  # float in the file (or a rare block needing zero points): exact as float32
    if precision == "fp32":
        return src.dense("token_embd.weight")
    raw = src.linear("token_embd.weight")
    if isinstance(raw, BlockQuantized) and raw.bits == 8 and raw.zero_points is None:
        return raw
    return quantize_symmetric8(raw.dequantize() if isinstance(raw, BlockQuantized) else raw)


def _write_package(src, cfg: ModelConfig, root: Path, name: str, precision: str, source_path: Path, source_hash: str,
                   max_context: int, report: Progress, measure_cost: bool, only: frozenset[int] | None = None) -> Manifest:
    """Every unit's graph and weights under ``root`` and the manifest that names them; ``only``: build
    just these units (the others are listed without a variant: ``add_variant`` merges what was built)."""
    writer = _BlobWriter(root / "blobs")
    n_units = cfg.n_units
    wanted = frozenset(range(n_units)) if only is None else only
    from .families import rope_factor_tensor, rope_tables

    factors = rope_factor_tensor(cfg, max_context, src.has)
    ropes = rope_tables(cfg, max_context, src.dense(factors).reshape(-1) if factors else None)
    cos, sin = ropes["global"]

    meter = _ReadMeter(report, sum(src.tensor(n).nbytes for n in src.tensor_names()) if precision in ("native", "gguf") and only is None else 0)
    shared: set[str] = set()
    unit_files: dict[int, dict[str, tuple[str, int]]] = {}
    graph_shas: dict[int, str] = {}
    kinds = ["embedding", *["layer"] * cfg.n_layers, "head"]
    half_kv_units: set[int] = set()  # layers attending over an fp16 KV cache (graphs.kernel_form)

    def store(index: int, model: onnx.ModelProto) -> None:
        """Write one unit now (its weights, then its graph) so the next unit starts from nothing."""
        files = writer.externalize(model)
        shared.update(sha for name, (sha, _) in files.items() if name.startswith(("cos_cache", "sin_cache")))
        unit_files[index] = {n: f for n, f in files.items() if not n.startswith(("cos_cache", "sin_cache"))}
        graph_shas[index] = writer.put(model.SerializeToString())
        report("build", len(graph_shas), len(wanted))

    head = n_units - 1
    table = _embedding_table(src, precision, writer, meter) if 0 in wanted or (head in wanted and cfg.tie_embeddings) else None
    if 0 in wanted:
        # learned positions (GPT-2): float32 rows up to the package's context, whatever the file's type
        positions = src.dense("position_embd.weight")[:max_context] if cfg.learned_positions else None
        store(0, graphs.embedding_unit(cfg, table, positions))
    for layer in range(cfg.n_layers):
        unit = layer + 1
        if unit not in wanted:
            continue
        w = _unit_weights(src, cfg, layer, precision, writer, meter)
        store(unit, graphs.layer_unit(cfg, unit, w, cos, sin, ropes.get("local"), fp16_kv=precision == "gguf"))
        if precision == "gguf":
            half_kv_units.add(unit)
        del w
    if head in wanted:
        if cfg.tie_embeddings:
            lm_head = table
        elif precision == "native":
            lm_head = _native_linear(src, ["output.weight"], writer, meter)
        elif precision == "gguf":
            lm_head = _gguf_linear(src, ["output.weight"], writer, meter)
        else:
            lm_head = src.linear("output.weight")
            lm_head = to_precision(lm_head, "fp32") if precision == "fp32" else to_precision(lm_head, "int8")
        final_bias = src.vector("output_norm.bias") if cfg.norm == "layer" else None
        store(head, graphs.head_unit(cfg, cfg.n_layers + 1, src.vector("output_norm.weight"), lm_head, final_bias))
        del lm_head
    del table

    tokenizer_sha = writer.put(src.tokenizer_json().encode())
    tok = src.tokenizer_info()

    costs = [0.0] * n_units
    if measure_cost:
        from .moe import routed_file_bytes

        costs = _measure_unit_costs(root / "blobs", [graph_shas[i] for i in range(n_units)], cfg, report, kinds=kinds,
                                    weight_bytes=[sum(dict(unit_files[i].values()).values()) for i in range(n_units)],
                                    read_bytes=[routed_file_bytes(unit_files[i], cfg.n_experts, cfg.n_experts_used) for i in range(n_units)])

    from ..runtime.stage_runner import window_positions

    H = cfg.hidden_size
    units = []
    for i, kind in enumerate(kinds):
        variants = {}
        if i in graph_shas:
            files = unit_files[i]
            variants[precision] = UnitVariant(precision=precision, graph=graph_shas[i], files=tuple(sorted({s for s, _ in files.values()})),
                                              weight_bytes=sum(dict(files.values()).values()),
                                              kv_bytes_per_token=cfg.kv_bytes_per_token_per_layer // 2 if i in half_kv_units else None)
        units.append(Unit(
            index=i, kind=kind, name={"embedding": "embed", "layer": f"layer{i - 1}", "head": "head"}[kind],
            cost_s=costs[i], kv_bytes_per_token=cfg.kv_bytes_per_token_per_layer if kind == "layer" else 0,
            out_bytes_per_token=8 if kind == "head" else H * 4, variants=variants,
            kv_window=window_positions(cfg.window(i - 1)) if kind == "layer" and cfg.window(i - 1) else 0,
        ))
    from .moe import with_experts

    units = with_experts(units, unit_files, precision, cfg)  # a MoE layer holds every expert; a step reads k (model/moe.py)
    return Manifest(
        format=FORMAT_VERSION, name=name, precision=precision, config=cfg.to_dict(), units=tuple(units),
        source={"path": str(source_path), "sha256": source_hash, "kind": "folder" if source_path.is_dir() else "gguf",
                "graphs": graphs.GRAPH_VERSION},
        shared_files={precision: tuple(sorted(shared))}, tokenizer=tokenizer_sha, chat_template=tok.chat_template,
        eos_ids=tuple(tok.eos_ids), bos_id=tok.bos_id, add_bos=tok.add_bos, max_context=max_context,
    )


MEASURE_LIMIT = 256 << 20  # units with more weight bytes than this are estimated, not loaded (bounded import memory)
ESTIMATED_S_PER_BYTE = 1e-10  # 10 GB/s: the estimate's rate where no unit could be measured (only ratios matter: calibration scales them)
SAME_SHAPE_SAMPLES = 2  # layers with the same kind and weight bytes are measured this many times, the rest reuse the median


def plan_measurements(kinds: list[str], weight_bytes: list[int], limit: int = MEASURE_LIMIT,
                      samples: int = SAME_SHAPE_SAMPLES) -> list[int | None]:
    """Per unit: the index of the unit whose measurement it reuses (itself if measured), or None
    when it is estimated from the measured layers' seconds per weight byte (too big to load)."""
    plan: list[int | None] = []
    seen: dict[tuple[str, int], list[int]] = {}
    for i, (kind, size) in enumerate(zip(kinds, weight_bytes)):
        if size > limit:
            plan.append(None)
            continue
        group = seen.setdefault((kind, size), [])
        if len(group) < samples:
            group.append(i)
            plan.append(i)
        else:
            plan.append(group[0])
    return plan


def _measure_unit_costs(blobs: Path, graph_shas: list[str], cfg: ModelConfig, report: Progress, context: int = 128, reps: int = 12,
                        kinds: list[str] | None = None, weight_bytes: list[int] | None = None,
                        read_bytes: list[int] | None = None) -> list[float]:
    """Median seconds of one decode step per unit, after ``context`` tokens of prefill.

    Decode is memory-bound, so a unit too big to load within the import's memory bound (an 8B
    model's head, every layer of a Qwen3-30B-A3B) is estimated as the bytes a step reads of it
    (``read_bytes``: a MoE layer's shared weights and routed experts; default ``weight_bytes``)
    times the measured layers' seconds per byte read, or the measured head's where no layer was
    measured, or ``ESTIMATED_S_PER_BYTE`` where nothing was; layers of identical size reuse their
    group's median instead of loading every one."""
    from ..runtime.stage_runner import SamplingBatch, StageRunner

    kinds = kinds or ["layer"] * len(graph_shas)
    weight_bytes = weight_bytes or [0] * len(graph_shas)
    plan = plan_measurements(kinds, weight_bytes)
    measured: dict[int, float] = {}
    rng = np.random.default_rng(0)
    for i, sha in enumerate(graph_shas):
        if plan[i] != i:
            continue
        runner = StageRunner(blobs / sha, threads=1)
        if runner.takes_token_ids:
            prefill = rng.integers(0, cfg.vocab_size, (1, context))
            step = lambda: rng.integers(0, cfg.vocab_size, (1, 1))  # noqa: E731
        else:
            prefill = rng.standard_normal((1, context, cfg.hidden_size)).astype(np.float32)
            step = lambda: rng.standard_normal((1, 1, cfg.hidden_size)).astype(np.float32)  # noqa: E731
        sampling = SamplingBatch.greedy(1) if runner.emits_tokens else None
        runner.run("probe", prefill, sampling)
        times = []
        for _ in range(reps):
            x = step()
            t0 = time.perf_counter()
            runner.run("probe", x, sampling)
            times.append(time.perf_counter() - t0)
        del runner
        measured[i] = float(np.median(times[2:]))
        report("measure", len(measured), sum(1 for u, p in enumerate(plan) if p == u))
    read_bytes = read_bytes or weight_bytes

    def rates(kind: str) -> list[float]:
        return sorted(measured[i] / read_bytes[i] for i in measured if kinds[i] == kind and read_bytes[i])

    # (with no layer measured the rate was 0: every layer of a model whose layers all pass the
    # bound, a Qwen3-30B-A3B's or a Mixtral's, cost nothing, and no calibration could fit a speed)
    layer_rates = rates("layer") or rates("head")
    per_byte = layer_rates[len(layer_rates) // 2] if layer_rates else ESTIMATED_S_PER_BYTE
    costs = []
    for i, p in enumerate(plan):
        if p is None:  # an embedding gathers one row per token; a head streams all of its bytes
            costs.append(per_byte * read_bytes[i] / (cfg.vocab_size if kinds[i] == "embedding" else 1))
        elif i in measured:
            costs.append(measured[i])
        else:  # same kind and size as unit p: the median of that group's measurements
            same = sorted(measured[j] for j, q in enumerate(plan) if q == p and j in measured)
            costs.append(same[len(same) // 2])
    return costs
