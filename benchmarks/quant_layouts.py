"""Which ONNX Runtime layout for GGUF's block types: one decode-step linear, timed per layout.

    python benchmarks/quant_layouts.py [--threads 1] [--reps 300]

For each GGUF type and a 0.5B-sized and a 1.5B-sized FFN matrix, builds a one-linear graph with
edgepipe's own graph code and times ``x[1, 1, K] @ W.T`` (median of ``--reps`` runs):

- exact layouts (what the importer writes): Q4_0/Q4_1/Q4_K as 4-bit MatMulNBits with the default
  zero point (plus ``BlockSum(x) @ offsets.T`` for Q4_1/Q4_K); Q4_1/Q4_K with explicit integer
  zero points 0 (the fallback); Q5_0/Q5_K/Q8_0 as 8-bit blocks of 32; Q6_K as 8-bit blocks of 16;
- the alternatives: the same weights re-quantized to int4 (not exact), and float32 MatMul (exact,
  4-8x the bytes).

Writes `benchmarks/results/quant_layouts.json` and `.md`, with the load average beside them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.bench.synthetic import random_gguf_rows
from edgepipe.model.graphs import _Graph
from edgepipe.model.weights import NATIVE_TYPES, BlockQuantized, decode_native, quantize_blocks

SHAPES = {"0.5B ffn_up 4864x896": (4864, 896), "1.5B ffn_up 8960x1536": (8960, 1536)}  # k-quants need K % 256 == 0


def time_linear(w, k: int, threads: int, reps: int) -> tuple[float, int]:
    g = _Graph("b.")
    g.linear("x", w, "w", out="y")
    model = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], "bench")
    nbytes = sum(len(t.raw_data) for t in model.graph.initializer)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        path.write_bytes(model.SerializeToString())
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 1, k)).astype(np.float32)
    for _ in range(20):
        sess.run(None, {"x": x})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes


def layouts(kind: str, raw: np.ndarray, k: int) -> dict:
    exact = decode_native(raw, kind, k)
    out = {"exact (importer)": exact}
    if exact.offsets is not None:
        zero = np.float32(NATIVE_TYPES[kind].shift)  # u - shift = q: the stored values are q itself
        z = 2 ** (exact.bits - 1) - zero  # the default zero point's shift, taken back out of the offsets
        out["exact, explicit zero point 0"] = BlockQuantized(exact.bits, exact.block_size, exact.q, exact.scales,
                                                             np.full(exact.scales.shape, zero, np.float32), exact.offsets - z * exact.scales)
    dense = exact.dequantize()
    out["re-quantized int4 (inexact)"] = quantize_blocks(dense, 4)
    out["float32 MatMul (exact)"] = dense
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    run = Conditions.start()
    rng = np.random.default_rng(0)
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        for kind in ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"):
            if k % NATIVE_TYPES[kind].block_elems:
                continue
            raw = random_gguf_rows(kind, n, k, rng)
            for label, w in layouts(kind, raw, k).items():
                sec, nbytes = time_linear(w, k, args.threads, args.reps)
                rows.append({"shape": shape_name, "type": kind, "layout": label, "us": round(sec * 1e6, 1),
                             "mb": round(nbytes / 1e6, 2), "gguf_mb": round(raw.nbytes / 1e6, 2), "gb_s": round(nbytes / sec / 1e9, 1)})
                print(f"{shape_name:<24} {kind:<5} {label:<32} {sec * 1e6:8.1f} us  {nbytes / 1e6:6.2f} MB (file {raw.nbytes / 1e6:.2f})", flush=True)
    report = {**run.finish().as_dict(), "threads": args.threads, "reps": args.reps, "onnxruntime": ort.__version__, "rows": rows}
    lines = ["# One decode-step linear per GGUF type and layout", "",
             f"- {run.line()} (shared machine)",
             f"- {args.threads} thread(s), median of {args.reps}; onnxruntime {ort.__version__}",
             "- produced by `python benchmarks/quant_layouts.py`", "",
             "| matrix | GGUF type | layout | µs | MB read | MB in the GGUF | GB/s |", "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['shape']} | {r['type']} | {r['layout']} | {r['us']} | {r['mb']} | {r['gguf_mb']} | {r['gb_s']} |" for r in rows]
    write_results("quant_layouts", report, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
