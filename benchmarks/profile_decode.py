"""Where a decode step's time goes: ONNX Runtime's node profile of the single-stage runner.

    python benchmarks/profile_decode.py                        # bundled SmolLM2 Q4_1 + the 0.5B Qwen (if present)
    python benchmarks/profile_decode.py --model x.gguf --threads 2 --steps 48
    python benchmarks/profile_decode.py --package <dir>        # an already imported package (e.g. one built by older code)
    python benchmarks/profile_decode.py --batch-invariant      # runners as under serve --batch-invariant

Per model: the package's one-stage graph runs a chat prompt, a warm-up, then ``--steps`` greedy
decode steps through ``StageRunner`` (IOBinding, KV in place, exactly as ``edgepipe generate``),
first timed plainly (wall and CPU time per step), then again with ``enable_profiling``. Node
kernel times are grouped by what the node does, named from the graph (weight names, bit width):
the layers' MatMulNBits by bit width, the LM head, the block-offset matmuls (BlockSum + MatMul +
Add), attention, norms, and the rest; "outside the
session" is wall time per step minus the profile's ``model_run`` (Python, binding, feeds).

Writes `benchmarks/results/profile_decode.json` and `.md` with the load average beside them
(a shared machine: compare shares within one run, not absolute times across runs).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from edgepipe.bench.machine import Conditions, load_average
from edgepipe.bench.results import write_results
from edgepipe.model.store import bundled_gguf, home_dir, reference_gguf, resolve
from edgepipe.native import register_gguf_kernel
from edgepipe.runtime.stage_runner import SamplingBatch, StageRunner

PROMPT = "Write a long story about a dragon who learns to bake bread."
QWEN05 = reference_gguf("qwen05")  # scripts/fetch_qwen05.sh


def node_groups(graph: onnx.ModelProto) -> dict[str, str]:
    """Node name -> what it does (grouping used by the report)."""
    consts = {t.name for t in graph.graph.initializer}
    producer = {o: n for n in graph.graph.node for o in n.output}
    groups = {}
    for n in graph.graph.node:
        ins = " ".join(n.input)
        attrs = {a.name: helper_attr(a) for a in n.attribute}
        if n.op_type == "MatMulNBits":
            groups[n.name] = "lm_head MatMulNBits" if "lm_head" in ins else f"MatMulNBits {attrs.get('bits')}-bit (layers)"
        elif ".offsets" in ins or ".blocks" in ins or (n.op_type == "ReduceSum" and ".last" in ins):
            groups[n.name] = "block offsets (BlockSum + MatMul)"
        elif n.op_type == "Add" and any(producer.get(i) is not None and producer[i].name in groups
                                        and groups[producer[i].name].startswith("block offsets") for i in n.input):
            groups[n.name] = "block offsets (BlockSum + MatMul)"
        elif n.op_type == "GroupQueryAttention":
            groups[n.name] = "attention (GroupQueryAttention)"
        elif "Normalization" in n.op_type:
            groups[n.name] = "norms"
        elif n.op_type in ("MatMul", "Gemm") and "lm_head" in ins:
            groups[n.name] = "lm_head float"
        elif n.op_type in ("GatherBlockQuantized", "Gather") and any(i in consts and "table" in i for i in n.input):
            groups[n.name] = "embedding"
        elif n.op_type in ("If", "LogSoftmax", "TopK", "ArgMax", "GatherElements", "Squeeze", "Unsqueeze", "Size", "Greater") and n.name.startswith("head."):
            groups[n.name] = "head sampling / logprobs"
    return groups


def helper_attr(a: onnx.AttributeProto):
    return onnx.helper.get_attribute_value(a)


def session_options(threads: int, profile_prefix: str | None = None) -> ort.SessionOptions:
    """The stage runner's options (ORT_ENABLE_ALL, no spinning), optionally profiling."""
    o = ort.SessionOptions()
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix:
        o.enable_profiling = True
        o.profile_file_prefix = profile_prefix
    return o


def decode_steps(runner: StageRunner, prompt: list[int], steps: int, warmup: int = 8) -> tuple[list[float], list[float], list[int]]:
    """Prefill, ``warmup`` steps, then ``steps`` timed greedy steps: (wall s, cpu s, tokens)."""
    greedy = SamplingBatch.greedy(1)
    tok = int(runner.run("p", np.array([prompt], np.int64), greedy)[0])
    tokens, wall, cpu = [tok], [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        tok = int(runner.run("p", np.array([[tok]], np.int64), greedy)[0])
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        tokens.append(tok)
    runner.drop("p")
    return wall, cpu, tokens


def profile_package(pkg, threads: int, steps: int, batch_invariant: bool = False) -> dict:
    m = pkg.manifest
    n_units = len(m.units)
    graph_path = pkg.blob(pkg.stage_graph(0, n_units))
    tok = pkg.tokenizer
    prompt = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    runner = pkg.runner(0, n_units, threads=threads, batch_invariant=batch_invariant)
    wall, cpu, tokens = decode_steps(runner, prompt, steps)
    with tempfile.TemporaryDirectory() as tmp:
        options = session_options(threads, str(Path(tmp) / "prof"))
        register_gguf_kernel(options, graph_path)  # the `gguf` form's graphs run the kernel library's ops
        runner.session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
        runner._bound_key = None
        pwall, _, ptokens = decode_steps(runner, prompt, steps)
        events = json.loads(Path(runner.session.end_profiling()).read_text())
    groups = node_groups(onnx.load(str(graph_path), load_external_data=False))
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    timed = runs[-steps:]  # the decode steps after warm-up (prefill and warm-up runs come first)
    t_start = timed[0]["ts"]
    by_group: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < t_start:
            continue
        name, op = e["name"][: -len("_kernel_time")], e["args"].get("op_name", "?")
        group = groups.get(name, f"other ({op})" if op in ("Reshape", "Cast", "Shape", "Concat", "Split", "Slice", "Identity") else f"other compute ({op})")
        by_group[group] += e["dur"]
        by_op[op] += e["dur"]
        count[group] += 1
    run_us = statistics.mean(r["dur"] for r in timed)
    nodes_us = sum(by_group.values()) / steps
    wall_us = statistics.mean(pwall) * 1e6
    rows = sorted(({"group": g, "us_per_step": round(v / steps, 1), "ops_per_step": round(count[g] / steps, 1),
                    "share_of_wall": round(v / steps / wall_us, 4)} for g, v in by_group.items()), key=lambda r: -r["us_per_step"])
    rows.append({"group": "session overhead (model_run minus kernels)", "us_per_step": round(run_us - nodes_us, 1), "ops_per_step": 0,
                 "share_of_wall": round((run_us - nodes_us) / wall_us, 4)})
    rows.append({"group": "outside the session (Python, binding, feeds)", "us_per_step": round(wall_us - run_us, 1), "ops_per_step": 0,
                 "share_of_wall": round((wall_us - run_us) / wall_us, 4)})
    return {"package": pkg.root.name, "batch_invariant": batch_invariant, "threads": threads, "steps": steps,
            "tok_s_wall": round(1 / statistics.median(wall), 2), "tok_s_cpu": round(1 / statistics.median(cpu), 2),
            "profiled_step_us": round(wall_us, 1), "model_run_us": round(run_us, 1), "same_tokens_profiled": tokens == ptokens,
            "groups": rows, "by_op_us": {k: round(v / steps, 1) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "load1": load_average()[0]}


def lone_row_check(threads: int, reps: int = 200) -> list[dict]:
    """Does a product give a row the same bits at M = 1 as at M = 2 (batch invariance), and what
    does each M cost? One linear of SmolLM2's FFN shape per layout, random weights."""
    from onnx import TensorProto, helper

    from edgepipe.model.graphs import _Graph
    from edgepipe.model.weights import BlockQuantized, quantize_blocks

    rng = np.random.default_rng(0)
    n, k = 1536, 576
    dense = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    layouts = {"MatMulNBits 4-bit / 32": (4, 32), "MatMulNBits 4-bit / 16": (4, 16), "MatMulNBits 8-bit / 32": (8, 32),
               "MatMulNBits 8-bit / 16": (8, 16), "float MatMul": None}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, layout in layouts.items():
            g = _Graph("c.")
            if layout:
                w = quantize_blocks(dense, *layout)
                w = BlockQuantized(w.bits, w.block_size, w.q, w.scales, None)
                ins = ["x", g.const(w.packed(), "qw"), g.const(w.scales.reshape(-1), "sc")]
                g.op("MatMulNBits", ins, domain="com.microsoft", out=["y"], K=k, N=n, bits=w.bits, block_size=w.block_size, accuracy_level=4)
            else:
                g.op("MatMul", ["x", g.const(np.ascontiguousarray(dense.T), "w")], out=["y"])
            model = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], "check")
            path = Path(tmp) / "m.onnx"
            onnx.save(model, str(path))
            s = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
            x = rng.standard_normal((4, k)).astype(np.float32)
            alone = np.concatenate([s.run(None, {"x": x[i : i + 1]})[0] for i in range(2)])
            pair = s.run(None, {"x": x[:2]})[0]
            four = s.run(None, {"x": x})[0]
            cost = {}
            for m in (1, 2):
                t = []
                for _ in range(reps):
                    c0 = time.process_time()
                    s.run(None, {"x": x[:m]})
                    t.append(time.process_time() - c0)
                cost[m] = statistics.median(t) * 1e6
            rows.append({"layout": label, "m1_equals_m2": bool(np.array_equal(alone, pair)), "m2_equals_m4": bool(np.array_equal(pair, four[:2])),
                         "cpu_us_m1": round(cost[1], 1), "cpu_us_m2": round(cost[2], 1)})
    return rows


def markdown(report: dict) -> str:
    lines = ["# Decode step profile (ONNX Runtime node times)", "",
             f"- {Conditions.from_dict(report).line()} (shared machine: shares within one run are meaningful, absolute times are not)",
             f"- produced by `python benchmarks/profile_decode.py`; onnxruntime {ort.__version__}",
             "- single-stage runner (IOBinding, KV in place), greedy decode steps after a prompt and 8 warm-up steps", ""]
    lines += [f"## Batch invariance of one {report['lone_row_check_shape']} product ({report['lone_row_check_threads']} thread(s))", "",
              "| layout | M=1 bits equal M=2 | M=2 equal M=4 | CPU µs at M=1 | at M=2 |", "| --- | --- | --- | ---: | ---: |"]
    lines += [f"| {r['layout']} | {r['m1_equals_m2']} | {r['m2_equals_m4']} | {r['cpu_us_m1']:.0f} | {r['cpu_us_m2']:.0f} |"
              for r in report["lone_row_check"]]
    lines.append("")
    for r in report["results"]:
        mode = "batch-invariant (a bystander row)" if r["batch_invariant"] else "a lone row alone (M = 1)"
        lines += [f"## {r['package']}, {r['threads']} thread(s), {mode}", "",
                  f"{r['steps']} steps; {r['tok_s_wall']} tok/s wall, {r['tok_s_cpu']} tok/s by CPU time (unprofiled); profiled step "
                  f"{r['profiled_step_us'] / 1e3:.2f} ms, of which `model_run` {r['model_run_us'] / 1e3:.2f} ms"
                  + f"; load1 {r['load1']}; {sum(g['ops_per_step'] for g in r['groups']):g} nodes run per step", "",
                  "| where | µs / step | ops / step | share of the step |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {g['group']} | {g['us_per_step']:.0f} | {g['ops_per_step']:g} | {g['share_of_wall']:.1%} |" for g in r["groups"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="GGUF file or package spec (repeatable; default: SmolLM2 Q4_1 and the 0.5B Qwen)")
    ap.add_argument("--package", action="append", help="an imported package directory (repeatable)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts (default 1)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--precision", default="native", help="the form imported: native (MatMulNBits) or gguf (the kernel library)")
    ap.add_argument("--batch-invariant", action="store_true", help="profile batch-invariant runners (a lone row takes a bystander)")
    ap.add_argument("--home")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    home = home_dir(args.home)
    run = Conditions.start()
    pkgs = [resolve(p) for p in args.package or []]
    if args.model or not pkgs:
        specs = args.model or [str(bundled_gguf())] + ([str(QWEN05)] if QWEN05.is_file() else [])
        pkgs += [resolve(s, args.precision, home) for s in specs]
    threads_list = [int(t) for t in args.threads.split(",")]
    check = lone_row_check(threads_list[0])
    results = []
    for pkg in pkgs:
        for threads in threads_list:
            r = profile_package(pkg, threads, args.steps, args.batch_invariant)
            results.append(r)
            print(f"{r['package']} threads {threads}: {r['tok_s_wall']} tok/s", flush=True)
    report = {**run.finish().as_dict(), "onnxruntime": ort.__version__,
              "lone_row_check_shape": "1536x576 (SmolLM2 ffn_up)", "lone_row_check_threads": threads_list[0], "lone_row_check": check,
              "results": results}
    write_results("profile_decode", report, markdown(report), args.out)
    print("\n" + markdown(report))


if __name__ == "__main__":
    main()
