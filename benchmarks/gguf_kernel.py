"""The GGUF kernel library against MatMulNBits: weight bytes streamed per second at decode (M = 1),
and multiply-accumulates per second at prefill (`--rows M`: M activation rows per matrix).

    python benchmarks/gguf_kernel.py [--types Q4_K Q6_K Q5_0 Q8_0] [--threads 1 2] [--reps 30] [--rows 1 42]

For each GGUF type, one graph of `--matrices` distinct 1.5B-FFN-shaped matrices (8960x1536 and
1536x8960 alternating, random codes with finite scales; ~90 MB for Q4_K, well past the L3 cache),
each fed its own [1, M, K] rows (M = 1: a decode step, streaming every weight once; M > 1: a prefill
of M tokens, where the arithmetic rather than the memory sets the time):

- `edgepipe.gguf` GgufMatMul on the blocks as stored (the library from `edgepipe.native`);
- MatMulNBits as the importer builds the same matrix today (`decode_native` + the graph code's
  `linear`, block-minimum chain included).

Both at 1 and 2 intra-op threads, interleaved, median of `--reps` runs; beside them numpy's read
bandwidth on the same threads (``edgepipe.bench.machine.memory_bandwidth_gb_s``). Writes
`benchmarks/results/gguf_kernel.json` and `.md` with the machine and load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from edgepipe.bench.machine import Conditions, memory_bandwidth_gb_s
from edgepipe.bench.results import write_results
from edgepipe.bench.synthetic import random_gguf_rows
from edgepipe.model.graphs import _Graph
from edgepipe.model.weights import NATIVE_TYPES, decode_native
from edgepipe.native import DOMAIN, MATMUL_OP, gguf_kernel_library, native_library

SHAPES = [(8960, 1536), (1536, 8960)]  # [N, K]: Qwen2.5-1.5B's ffn_up and ffn_down
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def matrices(kind: str, count: int, rng) -> list[np.ndarray]:
    return [random_gguf_rows(kind, n, k, rng) for n, k in (SHAPES[i % 2] for i in range(count))]


def _inputs_outputs(raws: list[np.ndarray]) -> tuple[list, list]:
    inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, "rows", SHAPES[i % 2][1]]) for i in range(len(raws))]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(raws))]
    return inputs, outputs


def kernel_model(kind: str, raws: list[np.ndarray]):
    g = _Graph("k.")
    for i, raw in enumerate(raws):
        g.op(MATMUL_OP, [f"x{i}", g.const(raw, f"w{i}")], domain=DOMAIN, out=[f"y{i}"], qtype=QTYPES[kind])
    inputs, outputs = _inputs_outputs(raws)
    model = g.model(inputs, outputs, "gguf_kernel")
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model


def matmulnbits_model(kind: str, raws: list[np.ndarray]):
    g = _Graph("m.")
    for i, raw in enumerate(raws):
        n, k = SHAPES[i % 2]
        g.linear(f"x{i}", decode_native(raw, kind, k), f"w{i}", out=f"y{i}")
    inputs, outputs = _inputs_outputs(raws)
    return g.model(inputs, outputs, "matmulnbits")


def session(model, threads: int, library: str | None):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def time_runs(sess, feeds: dict, reps: int) -> list[float]:
    for _ in range(3):
        sess.run(None, feeds)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q5_0", "Q8_0"], choices=list(QTYPES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--matrices", type=int, default=12)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", nargs="+", type=int, default=[1], help="activation rows per product (1: decode; more: prefill)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="gguf_kernel", help="results file stem")
    args = ap.parse_args()
    library = gguf_kernel_library()
    if library is None:
        sys.exit(f"no GGUF kernel library: {native_library().reason}")
    run = Conditions.start()
    bandwidth = {t: memory_bandwidth_gb_s(t) for t in args.threads}
    rng = np.random.default_rng(0)
    rows = []
    for kind in args.types:
        raws = matrices(kind, args.matrices, rng)
        kernel, nbits = kernel_model(kind, raws), matmulnbits_model(kind, raws)
        kernel_bytes = sum(r.nbytes for r in raws)
        nbits_bytes = sum(len(t.raw_data) for t in nbits.graph.initializer)
        macs = sum(SHAPES[i % 2][0] * SHAPES[i % 2][1] for i in range(len(raws)))  # per activation row
        for m_rows, threads in ((m, t) for m in args.rows for t in args.threads):
            feeds = {f"x{i}": rng.standard_normal((1, m_rows, SHAPES[i % 2][1])).astype(np.float32) for i in range(len(raws))}
            ours, theirs = session(kernel, threads, str(library)), session(nbits, threads, None)
            ours_t, theirs_t = [], []
            for _ in range(3):  # interleaved thirds
                ours_t += time_runs(ours, feeds, max(1, args.reps // 3))
                theirs_t += time_runs(theirs, feeds, max(1, args.reps // 3))
            a, b = statistics.median(ours_t), statistics.median(theirs_t)
            row = {"type": kind, "rows": m_rows, "threads": threads, "matrices": len(raws),
                   "kernel_ms": round(a * 1e3, 3), "kernel_mb": round(kernel_bytes / 1e6, 1), "kernel_gb_s": round(kernel_bytes / a / 1e9, 2),
                   "kernel_gmac_s": round(macs * m_rows / a / 1e9, 1),
                   "matmulnbits_ms": round(b * 1e3, 3), "matmulnbits_mb": round(nbits_bytes / 1e6, 1),
                   "matmulnbits_gb_s": round(nbits_bytes / b / 1e9, 2), "matmulnbits_gmac_s": round(macs * m_rows / b / 1e9, 1),
                   "speedup": round(b / a, 2), "numpy_read_gb_s": bandwidth[threads]}
            rows.append(row)
            print(f"{kind:<5} M={m_rows:<3} {threads}t  kernel {a * 1e3:7.2f} ms {kernel_bytes / a / 1e9:5.1f} GB/s "
                  f"{row['kernel_gmac_s']:6.1f} GMAC/s | MatMulNBits {b * 1e3:7.2f} ms {nbits_bytes / b / 1e9:5.1f} GB/s "
                  f"{row['matmulnbits_gmac_s']:6.1f} GMAC/s | x{b / a:.2f} (numpy {bandwidth[threads]} GB/s)", flush=True)
    report = {**run.finish().as_dict(), "onnxruntime": ort.__version__, "library": str(library), "reps": args.reps, "rows": rows}
    lines = ["# GGUF kernel vs MatMulNBits: one decode step's weights (M = 1), a prefill's (M > 1)", "",
             f"- {run.line()}",
             f"- onnxruntime {ort.__version__}; median of {args.reps}, interleaved",
             f"- {args.matrices} distinct matrices per graph, 8960x1536 and 1536x8960 alternating (random codes); "
             "`python benchmarks/gguf_kernel.py`", "",
             "| type | rows M | threads | GgufMatMul ms | MB | GB/s | GMAC/s | MatMulNBits ms | MB | GB/s | GMAC/s | speed-up | numpy read GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['type']} | {r['rows']} | {r['threads']} | {r['kernel_ms']} | {r['kernel_mb']} | {r['kernel_gb_s']} | {r['kernel_gmac_s']} | "
              f"{r['matmulnbits_ms']} | {r['matmulnbits_mb']} | {r['matmulnbits_gb_s']} | {r['matmulnbits_gmac_s']} | {r['speedup']}x | "
              f"{r['numpy_read_gb_s']} |" for r in rows]
    write_results(args.name, report, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
