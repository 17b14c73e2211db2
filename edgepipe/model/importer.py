"""Import a GGUF file (or a local Hugging Face folder) into a model package.

``import_model`` builds every unit graph, stores each weight as a blob named by its SHA-256,
measures each unit's decode cost on this machine, and writes ``manifest.json`` last. The
package is assembled in a temporary directory and renamed into place, so a failed import
leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from . import graphs
from .config import ModelConfig, UnsupportedModel
from .gguf_source import CorruptModel, GGUFSource
from .manifest import FORMAT_VERSION, Manifest, Unit, UnitVariant, sha256_bytes, sha256_file
from .weights import PRECISIONS, BlockQuantized, concat_rows, quantize_symmetric8, to_precision

Progress = Callable[[str, int, int], None]  # (phase, done, total)
INLINE_LIMIT = 1024  # tensors smaller than this stay inside the graph file
DEFAULT_MAX_CONTEXT = 8192


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
    precision: str = "int4",
    name: str | None = None,
    max_context: int = DEFAULT_MAX_CONTEXT,
    progress: Progress | None = None,
    measure_cost: bool = True,
) -> Path:
    """Write the package for ``source_path`` under ``models_dir`` and return its directory.

    An existing package of the same name whose manifest names the same source hash is reused.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    source_path = Path(source_path)
    if not source_path.exists():
        raise FileNotFoundError(f"{source_path}: no such model file or folder")
    if source_path.is_dir():
        open_source(source_path)  # says what is supported before hashing a whole folder
    elif source_path.suffix.lower() == ".gguf":
        from .gguf_header import check_supported

        check_supported(source_path)  # refuses from the header before hashing the file
    models_dir = Path(models_dir)
    target = models_dir / (name or package_name(source_path, precision))
    source_hash = sha256_file(source_path) if source_path.is_file() else _folder_hash(source_path)
    if (target / "manifest.json").is_file():
        existing = Manifest.from_json((target / "manifest.json").read_text())
        if existing.source.get("sha256") == source_hash:
            return target
    report = progress or (lambda *_: None)
    src = open_source(source_path)
    cfg: ModelConfig = src.config
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=models_dir))
    try:
        manifest = _write_package(src, cfg, tmp, target.name, precision, source_path, source_hash, min(max_context, cfg.context_length), report, measure_cost)
        (tmp / "manifest.json").write_text(manifest.to_json())
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def add_variant(package_dir: str | Path, precision: str, progress: Progress | None = None) -> Path:
    """Add another weight variant (e.g. fp32 MatMuls for browser workers) to a package.

    Blobs are written beside the existing ones (content addressing dedupes shared files) and
    the manifest is replaced atomically, so readers see either the old or the new one.
    """
    package_dir = Path(package_dir)
    manifest = Manifest.from_json((package_dir / "manifest.json").read_text())
    if all(precision in u.variants for u in manifest.units):
        return package_dir
    source_path = Path(manifest.source["path"])
    src = open_source(source_path)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{package_dir.name}-{precision}-", dir=package_dir.parent))
    try:
        extra = _write_package(src, src.config, tmp, manifest.name, precision, source_path, manifest.source["sha256"], manifest.max_context,
                               progress or (lambda *_: None), measure_cost=False)
        for blob in (tmp / "blobs").iterdir():
            if not (package_dir / "blobs" / blob.name).exists():
                os.replace(blob, package_dir / "blobs" / blob.name)
        units = tuple(dataclasses.replace(u, variants={**u.variants, precision: e.variants[precision]}) for u, e in zip(manifest.units, extra.units))
        merged = dataclasses.replace(manifest, units=units, shared_files={**manifest.shared_files, **extra.shared_files})
        staged = package_dir / "manifest.json.tmp"
        staged.write_text(merged.to_json())
        os.replace(staged, package_dir / "manifest.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return package_dir


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

    def externalize(self, model: onnx.ModelProto) -> dict[str, tuple[str, int]]:
        """Returns ``initializer name -> (sha, bytes)`` for every externalized tensor."""
        out: dict[str, tuple[str, int]] = {}
        for t in model.graph.initializer:
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


def _unit_weights(src, cfg: ModelConfig, layer: int, precision: str) -> dict:
    p = f"blk.{layer}."
    lin = lambda n: to_precision(src.linear(p + n + ".weight"), precision)  # noqa: E731
    w = {
        "attn_norm": src.vector(p + "attn_norm.weight"),
        "qkv": lin("attn_qkv") if src.has(p + "attn_qkv.weight") else concat_rows([lin("attn_q"), lin("attn_k"), lin("attn_v")]),
        "attn_output": lin("attn_output"),
        "ffn_norm": src.vector(p + "ffn_norm.weight"),
        "gate_up": concat_rows([lin("ffn_gate"), lin("ffn_up")]) if src.has(p + "ffn_gate.weight") else lin("ffn_up"),  # Phi-3: fused
        "ffn_down": lin("ffn_down"),
    }
    if cfg.attention_bias:
        w["qkv_bias"] = np.concatenate([src.vector(p + f"attn_{x}.bias") for x in "qkv"])
    if cfg.qk_norm:
        w["q_norm"] = src.vector(p + "attn_q_norm.weight")
        w["k_norm"] = src.vector(p + "attn_k_norm.weight")
    if cfg.post_norms:  # Gemma 2/3
        w["post_attention_norm"] = src.vector(p + "post_attention_norm.weight")
        w["post_ffw_norm"] = src.vector(p + "post_ffw_norm.weight")
    return w


def _embedding_table(src, precision: str):
    if precision == "fp32":
        return src.dense("token_embd.weight")
    raw = src.linear("token_embd.weight")
    if isinstance(raw, BlockQuantized) and raw.bits == 8 and raw.zero_points is None:
        return raw
    return quantize_symmetric8(raw.dequantize() if isinstance(raw, BlockQuantized) else raw)


def _write_package(src, cfg: ModelConfig, root: Path, name: str, precision: str, source_path: Path, source_hash: str,
                   max_context: int, report: Progress, measure_cost: bool) -> Manifest:
    writer = _BlobWriter(root / "blobs")
    n_units = cfg.n_units
    from .families import rope_factor_tensor, rope_tables

    factors = rope_factor_tensor(cfg, max_context, src.has)
    ropes = rope_tables(cfg, max_context, src.dense(factors).reshape(-1) if factors else None)
    cos, sin = ropes["global"]
    built: list[tuple[str, onnx.ModelProto]] = []

    table = _embedding_table(src, precision)
    built.append(("embedding", graphs.embedding_unit(cfg, table)))
    report("build", 1, n_units)
    for layer in range(cfg.n_layers):
        unit = layer + 1
        built.append(("layer", graphs.layer_unit(cfg, unit, _unit_weights(src, cfg, layer, precision), cos, sin, ropes.get("local"))))
        report("build", unit + 1, n_units)
    if cfg.tie_embeddings:
        lm_head = table
    else:
        lm_head = src.linear("output.weight")
        lm_head = to_precision(lm_head, "fp32") if precision == "fp32" else to_precision(lm_head, "int8")
    built.append(("head", graphs.head_unit(cfg, cfg.n_layers + 1, src.vector("output_norm.weight"), lm_head)))
    report("build", n_units, n_units)

    shared: set[str] = set()
    unit_files: list[dict[str, tuple[str, int]]] = []
    graph_shas: list[str] = []
    for kind, model in built:
        files = writer.externalize(model)
        shared.update(sha for name, (sha, _) in files.items() if name.startswith(("cos_cache", "sin_cache")))
        unit_files.append({n: f for n, f in files.items() if not n.startswith(("cos_cache", "sin_cache"))})
        graph_shas.append(writer.put(model.SerializeToString()))

    tokenizer_sha = writer.put(src.tokenizer_json().encode())
    tok = src.tokenizer_info()

    costs = [0.0] * n_units
    if measure_cost:
        costs = _measure_unit_costs(root / "blobs", graph_shas, cfg, report)

    H = cfg.hidden_size
    units = []
    for i, (kind, _) in enumerate(built):
        files = unit_files[i]
        variant = UnitVariant(precision=precision, graph=graph_shas[i], files=tuple(sorted({s for s, _ in files.values()})),
                              weight_bytes=sum(dict(files.values()).values()))
        units.append(Unit(
            index=i, kind=kind, name={"embedding": "embed", "layer": f"layer{i - 1}", "head": "head"}[kind],
            cost_s=costs[i], kv_bytes_per_token=cfg.kv_bytes_per_token_per_layer if kind == "layer" else 0,
            out_bytes_per_token=8 if kind == "head" else H * 4, variants={precision: variant},
        ))
    return Manifest(
        format=FORMAT_VERSION, name=name, precision=precision, config=cfg.to_dict(), units=tuple(units),
        source={"path": str(source_path), "sha256": source_hash, "kind": "folder" if source_path.is_dir() else "gguf"},
        shared_files={precision: tuple(sorted(shared))}, tokenizer=tokenizer_sha, chat_template=tok.chat_template,
        eos_ids=tuple(tok.eos_ids), bos_id=tok.bos_id, add_bos=tok.add_bos, max_context=max_context,
    )


def _measure_unit_costs(blobs: Path, graph_shas: list[str], cfg: ModelConfig, report: Progress, context: int = 128, reps: int = 12) -> list[float]:
    """Median seconds of one decode step per unit, after ``context`` tokens of prefill."""
    from ..runtime.stage_runner import SamplingBatch, StageRunner

    costs = []
    rng = np.random.default_rng(0)
    for i, sha in enumerate(graph_shas):
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
        costs.append(float(np.median(times[2:])))
        report("measure", i + 1, len(graph_shas))
    return costs
