"""Attention of one decode step over a long KV cache, the ways the kernel form could keep it.

    python benchmarks/kv_attention.py [--positions 512 1024] [--threads 1] [--reps 300]

One layer of Qwen2.5-1.5B's shapes (12 query heads, 2 KV heads, head dim 128, rotary inside, a
cache of capacity 1,280 bound in place as the stage runner binds it), one new token after
`--positions` cached ones, median time per call at `--threads` intra-op threads:

- `GQA fp32`: ONNX Runtime's CPU GroupQueryAttention on an fp32 cache (the fallback form's, and the
  kernel form's before KvAttention);
- `GQA fp16 + Cast`: the same op in MLFloat16 (its CPU kernel takes it), the packed qkv cast in,
  the output cast out;
- `GQA int8` : its quantized-KV attributes (`k_quant_type`/`v_quant_type` PER_TENSOR, 8 bits)
  where this ONNX Runtime's CPU kernel has them (past and present not shared: it copies);
- `KvAttention fp16`: the kernel library's op (`edgepipe.native`), at the ISA it picks and at
  `portable` (the plain C path ARM64 runs).

x 28 layers gives the attention's share of a 1.5B token. Writes `benchmarks/results/kv_attention.json`
and `.md` with the machine and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.native import ATTENTION_OP, DOMAIN, gguf_kernel_library

HEADS, KV_HEADS, DIM, CAPACITY, LAYERS = 12, 2, 128, 1280, 28
F, H, I8, I32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT8, TensorProto.INT32
MS = "com.microsoft"


def tables() -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(4096)[:, None] * (10000.0 ** (-np.arange(DIM // 2) / (DIM // 2)))[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def graph(kind: str) -> tuple[bytes, int]:
    """(model, KV element type) for one of the kinds in the module docstring."""
    cos, sin = tables()
    kv_type = {"gqa32": F, "gqa16": H, "gqa8": I8, "kv16": H}[kind]
    rope_type = np.float16 if kind == "gqa16" else np.float32
    inits = [numpy_helper.from_array(cos.astype(rope_type), "cos"), numpy_helper.from_array(sin.astype(rope_type), "sin")]
    attrs = dict(num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, local_window_size=-1)
    nodes = []
    if kind == "kv16":
        nodes.append(helper.make_node(ATTENTION_OP, ["qkv", "pk", "pv", "sl", "tl", "cos", "sin"], ["out", "ok", "ov"], domain=DOMAIN, **attrs))
    elif kind == "gqa16":
        nodes += [helper.make_node("Cast", ["qkv"], ["qkv16"], to=H),
                  helper.make_node("GroupQueryAttention", ["qkv16", "", "", "pk", "pv", "sl", "tl", "cos", "sin"], ["a", "ok", "ov"], domain=MS, **attrs),
                  helper.make_node("Cast", ["a"], ["out"], to=F)]
    elif kind == "gqa8":
        inits += [numpy_helper.from_array(np.array([0.05], np.float32), n) for n in ("ks", "vs")]
        nodes.append(helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sl", "tl", "cos", "sin", "", "", "", "ks", "vs"],
                                      ["out", "ok", "ov"], domain=MS, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR",
                                      kv_cache_bit_width=8, **attrs))
    else:
        nodes.append(helper.make_node("GroupQueryAttention", ["qkv", "", "", "pk", "pv", "sl", "tl", "cos", "sin"], ["out", "ok", "ov"],
                                      domain=MS, **attrs))
    kv = [1, KV_HEADS, CAPACITY, DIM]
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("qkv", F, [1, "seq", (HEADS + 2 * KV_HEADS) * DIM]),
                                        helper.make_tensor_value_info("pk", kv_type, kv), helper.make_tensor_value_info("pv", kv_type, kv),
                                        helper.make_tensor_value_info("sl", I32, [1]), helper.make_tensor_value_info("tl", I32, [])],
                          [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("ok", kv_type, None),
                           helper.make_tensor_value_info("ov", kv_type, None)], inits)
    domains = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)] + ([helper.make_opsetid(DOMAIN, 1)] if kind == "kv16" else [])
    return helper.make_model(g, ir_version=10, opset_imports=domains).SerializeToString(), kv_type


def time_kind(kind: str, positions: int, threads: int, reps: int, library: str | None) -> float:
    """Median microseconds of one decode step."""
    model, kv_type = graph(kind)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if kind == "kv16":
        options.register_custom_ops_library(library)
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    dtype = {F: np.float32, H: np.float16, I8: np.int8}[kv_type]
    cache = [(rng.standard_normal((1, KV_HEADS, CAPACITY, DIM)) * (1 if dtype != np.int8 else 20)).astype(dtype) for _ in range(2)]
    binding = session.io_binding()
    binding.bind_output("out", "cpu")
    values = [ort.OrtValue.ortvalue_from_numpy(c) for c in cache]
    for (past, present), value in zip((("pk", "ok"), ("pv", "ov")), values):
        binding.bind_ortvalue_input(past, value)
        if kind == "gqa8":
            binding.bind_output(present, "cpu")  # its present is not the past's buffer
        else:
            binding.bind_ortvalue_output(present, value)
    binding.bind_cpu_input("qkv", rng.standard_normal((1, 1, (HEADS + 2 * KV_HEADS) * DIM)).astype(np.float32))
    binding.bind_cpu_input("sl", np.array([positions], np.int32))
    binding.bind_cpu_input("tl", np.array(positions + 1, np.int32))
    for _ in range(20):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    library = gguf_kernel_library()
    conditions = Conditions.start()
    rows = []
    kinds = [("GQA fp32", "gqa32", None), ("GQA fp16 + Cast", "gqa16", None), ("GQA int8 (quantized KV)", "gqa8", None)]
    if library is not None:
        kinds += [("KvAttention fp16", "kv16", None), ("KvAttention fp16, portable C", "kv16", "portable")]
    for threads in args.threads:
        for positions in args.positions:
            for label, kind, isa in kinds:
                if isa:
                    os.environ["EDGEPIPE_GGUF_ISA"] = isa
                try:
                    us = time_kind(kind, positions, threads, args.reps, str(library) if library else None)
                except Exception as exc:  # an ONNX Runtime without that form: say so in the table
                    us, label = float("nan"), f"{label} (fails: {str(exc).splitlines()[0][:80]})"
                finally:
                    os.environ.pop("EDGEPIPE_GGUF_ISA", None)
                rows.append({"threads": threads, "positions": positions, "form": label, "us_per_layer": us,
                             "ms_per_token_28_layers": us * LAYERS / 1000})
                print(f"{threads} thr, {positions} positions, {label}: {us:.1f} us/layer, {us * LAYERS / 1000:.2f} ms/token", flush=True)
    conditions.finish()
    md = ["# One decode step's attention over a long KV cache (Qwen2.5-1.5B shapes)", "",
          f"- {conditions.line()}", f"- produced by `python benchmarks/kv_attention.py`; median of {args.reps} calls; "
          "12 query heads, 2 KV heads, head dim 128, rotary inside, capacity 1,280 bound in place", "",
          "| threads | cached positions | form | µs per layer | ms per token (x 28 layers) |", "| ---: | ---: | --- | ---: | ---: |"]
    md += [f"| {r['threads']} | {r['positions']} | {r['form']} | {r['us_per_layer']:.1f} | {r['ms_per_token_28_layers']:.2f} |" for r in rows]
    write_results("kv_attention", {"conditions": conditions.as_dict(), "rows": rows}, "\n".join(md), args.out)


if __name__ == "__main__":
    main()
