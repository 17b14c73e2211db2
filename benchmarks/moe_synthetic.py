"""Synthetic GGUFs of Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 small layers: top-1 agreement with llama.cpp, and MoE decode speed.

    python benchmarks/moe_synthetic.py --quick    # agreement on few layers, 48 tokens per prompt; a speed smoke run
    python benchmarks/moe_synthetic.py            # agreement (100 tokens per prompt); speed on a 16-layer Qwen3-30B-A3B shape
    python benchmarks/moe_synthetic.py --shapes   # speed only (no agreement shapes)

Writes `benchmarks/results/moe_synthetic.json` and `.md` (`moe_synthetic-quick.*` for `--quick`,
`-agreement` added with `--speed-layers 0`).

The files (``edgepipe/bench/arch_files.py``): each architecture's real per-layer shapes, a few
layers, the bundled tokenizer, Q4_K_M's block types (Q4_K, Q6_K, Q8_0, Q5_K), random blocks
scaled so that activations keep their size and the head's logits are peaked.

Agreement (as `decode.py` and `agreement_floor.py` measure it): llama.cpp greedily continues the
three chat prompts; llama.cpp (f16 KV, its default), llama.cpp with an f32 KV cache and edgepipe's
kernel form (``gguf``: the file's blocks) are teacher-forced along those sequences, each engine in
a process of its own, and the argmax at every position is compared. The floor is llama.cpp f32-KV
against llama.cpp; edgepipe passes where its agreement with llama.cpp is within 1 point of it.

Speed (as `decode.py` times it): greedy decode of exactly N tokens, EOS ignored, the same prompt ids,
edgepipe ``gguf`` and llama.cpp at 1 and 2 threads, every engine and repetition in a process of
its own, repetitions interleaved, medians. GB/s counts the bytes a decode token reads: every
weight but the gathered embedding, and of each MoE layer's experts only the routed ``k / E``.
The default 16 layers (5.6 GB; the real model has 48) fit this 24 GiB machine three times over:
edgepipe holds its weights in its process (RSS about the model) beside its package's pages, and
llama.cpp maps the GGUF, which must stay in the page cache between the interleaved runs or its
runs would read the disk (24 layers, 8.4 GB a copy, would leave under 2 GiB for anything else).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from edgepipe.bench.arch_files import SHAPES, write_arch_gguf
from edgepipe.bench.decode_engines import AGREE_PROMPTS, PROMPT, matches
from edgepipe.bench.machine import Conditions, package_version as version
from edgepipe.bench.results import write_results
from edgepipe.model.store import bundled_gguf, resolve

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
AGREE_LAYERS = {"quick": {"qwen3-30b-a3b": 2, "mixtral-8x7b": 1, "gpt2-small": 4},
                "full": {"qwen3-30b-a3b": 4, "mixtral-8x7b": 2, "gpt2-small": 12}}


def child(job: dict, timeout: float = 1800) -> dict:
    done = subprocess.run([sys.executable, "-m", "edgepipe.bench.decode_engines", "run", json.dumps(job)],
                          capture_output=True, text=True, env=ENV, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{job['engine']} ({job['task']}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def chat_ids(path: Path, home: Path, prompts: list[str]) -> list[list[int]]:
    tok = resolve(str(path), "gguf", home).tokenizer
    return [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in prompts]


def agreement(shape: str, layers: int, work: Path, tokens: int) -> dict:
    path = work / f"{shape}-{layers}l.gguf"
    t0 = time.perf_counter()
    info = write_arch_gguf(path, shape, bundled_gguf(), layers)
    print(f"\n== {shape}, {layers} layer(s): {info['bytes'] / 1e6:.0f} MB {info['types']} in {time.perf_counter() - t0:.0f} s", flush=True)
    home = work / "home"
    ids = chat_ids(path, home, AGREE_PROMPTS)
    common = {"home": str(home), "model": str(path), "n_ctx": max(map(len, ids)) + tokens + 8}
    ref = child({"task": "reference", "engine": "llama.cpp", "precision": "gguf", "prompts": ids, "n": tokens, "threads": 2, **common})["tokens"]
    sequences = list(zip(ids, ref))
    runs = {"llama.cpp": child({"task": "agree", "engine": "llama.cpp", "precision": "gguf", "sequences": sequences, "threads": 2, **common}),
            "llama.cpp f32 KV": child({"task": "agree", "engine": "llama.cpp", "precision": "gguf", "sequences": sequences, "threads": 2,
                                       "kv_cache": "f32", **common}),
            "edgepipe gguf": child({"task": "agree", "engine": "edgepipe", "precision": "gguf", "sequences": sequences, "threads": 2, **common})}
    pred = {name: r["predicted"] for name, r in runs.items()}
    hits, positions = matches(pred["edgepipe gguf"], pred["llama.cpp"])
    floor = matches(pred["llama.cpp f32 KV"], pred["llama.cpp"])[0]
    out = {"shape": shape, "architecture": SHAPES[shape]["arch"], "layers": layers, "file_mb": round(info["bytes"] / 1e6, 1),
           "block_types": info["types"], "positions": positions, "distinct_reference_tokens": len({t for r in ref for t in r}),
           "edgepipe_vs_llama_cpp": round(hits / positions, 4), "llama_cpp_f32_kv_vs_llama_cpp": round(floor / positions, 4),
           "edgepipe_vs_llama_cpp_f32_kv": round(matches(pred["edgepipe gguf"], pred["llama.cpp f32 KV"])[0] / positions, 4),
           "peak_rss_mib": {name: round(r["peak_rss_mib"]) for name, r in runs.items()}}
    out["within_1_point_of_floor"] = out["edgepipe_vs_llama_cpp"] >= out["llama_cpp_f32_kv_vs_llama_cpp"] - 0.01
    print(f"  {positions} positions ({out['distinct_reference_tokens']} distinct tokens): edgepipe vs llama.cpp {out['edgepipe_vs_llama_cpp']:.1%}, "
          f"floor (llama.cpp f32 KV vs f16) {out['llama_cpp_f32_kv_vs_llama_cpp']:.1%}, edgepipe vs llama.cpp f32 KV "
          f"{out['edgepipe_vs_llama_cpp_f32_kv']:.1%} -> {'within' if out['within_1_point_of_floor'] else 'NOT within'} 1 point", flush=True)
    shutil.rmtree(home, ignore_errors=True)
    path.unlink()
    return out


def speed(layers: int, work: Path, threads: list[int], n: int, reps: int) -> dict:
    shape = "qwen3-30b-a3b"
    path = work / f"{shape}-{layers}l.gguf"
    t0 = time.perf_counter()
    info = write_arch_gguf(path, shape, bundled_gguf(), layers)
    print(f"\n== speed: {shape}, {layers} layers, {info['bytes'] / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s; "
          f"{info['routed_bytes'] / 1e6:.0f} MB read per token (routed experts only)", flush=True)
    home = work / "home"
    t0 = time.perf_counter()
    pkg = resolve(str(path), "gguf", home)
    pkg.stage_graph(0, len(pkg.manifest.units))
    import_s = time.perf_counter() - t0
    prompt = chat_ids(path, home, [PROMPT])[0]
    configs = [(engine, t) for t in threads for engine in ("edgepipe", "llama.cpp")]
    timed: dict = {c: [] for c in configs}
    for rep in range(reps):
        for engine, t in configs:
            out = child({"task": "time", "engine": engine, "precision": "gguf", "threads": t, "home": str(home), "model": str(path),
                         "prompt": prompt, "lengths": [n], "warmup": 16, "n_ctx": len(prompt) + n + 8})
            r = out["runs"][0]
            timed[(engine, t)].append({**r, "peak_rss_mib": out["peak_rss_mib"]})
            print(f"  rep {rep + 1}/{reps} {engine:<9} threads {t}: {(r['generated'] - 1) / r['decode_s']:.2f} tok/s  load {os.getloadavg()[0]:.1f}",
                  flush=True)
    rows = []
    for (engine, t), runs in timed.items():
        tok_s = statistics.median((r["generated"] - 1) / r["decode_s"] for r in runs)
        rows.append({"engine": engine, "threads": t, "new_tokens": n, "decode_tok_s": round(tok_s, 2),
                     "decode_tok_s_reps": [round((r["generated"] - 1) / r["decode_s"], 2) for r in runs],
                     "ttft_ms": round(statistics.median(r["ttft_s"] for r in runs) * 1e3), "routed_mb_per_token": round(info["routed_bytes"] / 1e6, 1),
                     "gb_s": round(info["routed_bytes"] * tok_s / 1e9, 2), "load1": [round(r["load1"], 2) for r in runs],
                     "peak_rss_mib": round(statistics.median(r["peak_rss_mib"] for r in runs))})
    by = {(r["engine"], r["threads"]): r for r in rows}
    ratios = {str(t): round(by[("edgepipe", t)]["decode_tok_s"] / by[("llama.cpp", t)]["decode_tok_s"], 3) for t in threads}
    shutil.rmtree(home, ignore_errors=True)
    path.unlink()
    return {"shape": shape, "layers": layers, "file_gb": round(info["bytes"] / 1e9, 2), "block_types": info["types"],
            "routed_mb_per_token": round(info["routed_bytes"] / 1e6, 1), "import_s": round(import_s, 1), "prompt_tokens": len(prompt),
            "repetitions": reps, "rows": rows, "edgepipe_over_llama_cpp": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="agreement on 1-4 layers, 48 tokens per prompt; speed: 2 layers, 32 tokens, 1 repetition, 2 threads")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help=f"agreement shapes (default all: {' '.join(SHAPES)}; none: speed only)")
    ap.add_argument("--tokens", type=int, help="agreement continuation tokens per prompt (default 100, quick 48)")
    ap.add_argument("--speed-layers", type=int, help="layers of the timed Qwen3-30B-A3B shape (default 16, quick 2; 0: no speed run)")
    ap.add_argument("--threads", nargs="+", type=int, help="thread counts (default 1 2; quick 2)")
    ap.add_argument("--reps", type=int, help="interleaved repetitions (default 3, quick 1)")
    ap.add_argument("--new-tokens", type=int, help="timed decode tokens (default 128, quick 32)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit("llama.cpp is not installed (pip install -e '.[bench]'): nothing to compare with")
    mode = "quick" if args.quick else "full"
    tokens = args.tokens or (48 if args.quick else 100)
    speed_layers = (2 if args.quick else 16) if args.speed_layers is None else args.speed_layers
    threads = args.threads or ([2] if args.quick else [1, 2])
    reps = args.reps or (1 if args.quick else 3)
    n = args.new_tokens or (32 if args.quick else 128)
    started, run = time.time(), Conditions.start()
    work = Path(tempfile.mkdtemp(prefix="edgepipe-moe-synth-", dir="/tmp"))
    try:
        agree = [agreement(s, AGREE_LAYERS[mode][s], work, tokens) for s in args.shapes]
        timed = speed(speed_layers, work, threads, n, reps) if speed_layers else None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"quick": args.quick, **run.finish().as_dict(), "elapsed_s": round(time.time() - started),
              "versions": {d: version(d) for d in ("edgepipe", "onnxruntime", "llama_cpp_python", "gguf", "numpy")},
              "agreement_tokens_per_prompt": tokens, "agreement": agree, "speed": timed,
              "command": " ".join(["python benchmarks/moe_synthetic.py", *sys.argv[1:]])}
    stem = "moe_synthetic" + ("-quick" if args.quick else "") + ("-agreement" if not speed_layers else "-speed" if not agree else "")
    written = write_results(stem, report, markdown(report), args.out)
    print("\n" + markdown(report))
    print(f"wrote {' and '.join(map(str, written))} ({report['elapsed_s']} s)")


def markdown(report: dict) -> str:
    lines = ["# Synthetic Qwen3-30B-A3B, Mixtral-8x7B and GPT-2 small layers against llama.cpp", "",
             f"- date: {report['date']}; produced by `{report['command']}` in {report['elapsed_s']} s",
             f"- {Conditions.from_dict(report).line()} (agreement is exact arithmetic, valid under load; speed is not)",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)]
    if report["agreement"]:
        lines += [
             f"- agreement: teacher-forced top-1 along llama.cpp's greedy continuations of {len(AGREE_PROMPTS)} chat prompts x "
             f"{report['agreement_tokens_per_prompt']} tokens; floor = llama.cpp f32 KV vs its default f16 KV", "",
             "| shape | arch | layers | block types | positions (distinct tokens) | edgepipe = llama.cpp | floor: llama.cpp f32 KV = llama.cpp | edgepipe = llama.cpp f32 KV | within 1 point |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for a in report["agreement"]:
        types = ", ".join(f"{k} {v}" for k, v in sorted(a["block_types"].items()))
        lines.append(f"| {a['shape']} | {a['architecture']} | {a['layers']} | {types} | {a['positions']} ({a['distinct_reference_tokens']}) | "
                     f"{a['edgepipe_vs_llama_cpp']:.1%} | {a['llama_cpp_f32_kv_vs_llama_cpp']:.1%} | {a['edgepipe_vs_llama_cpp_f32_kv']:.1%} | "
                     f"{'yes' if a['within_1_point_of_floor'] else '**no**'} |")
    s = report.get("speed")
    if s:
        lines += ["", f"## Decode speed: {s['shape']} shape, {s['layers']} layers ({s['file_gb']} GB; "
                  f"{s['routed_mb_per_token']} MB read per token, routed experts only)", "",
                  f"Prompt {s['prompt_tokens']} tokens, {s['repetitions']} repetition(s); edgepipe's kernel form (`gguf`) imported in {s['import_s']} s.", "",
                  "| threads | engine | new tokens | TTFT ms | decode tok/s (median; reps) | GB/s read | peak RSS MiB | load1 |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in sorted(s["rows"], key=lambda r: (r["threads"], r["engine"])):
            lines.append(f"| {r['threads']} | {r['engine']} | {r['new_tokens']} | {r['ttft_ms']} | {r['decode_tok_s']} "
                         f"({', '.join(map(str, r['decode_tok_s_reps']))}) | {r['gb_s']} | {r['peak_rss_mib']} | {r['load1']} |")
        lines += ["", "edgepipe / llama.cpp decode tok/s: " + ", ".join(f"{t} thread(s) {v:.2f}x" for t, v in s["edgepipe_over_llama_cpp"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
