"""Decode benchmark: edgepipe against onnxruntime-genai and llama.cpp, side by side in one run.

Run `python benchmarks/decode.py` (6-10 minutes on 2 cores; the timed part adds no repetition
that would pass `--budget`, 420 s, since a loaded machine can slow multi-threaded engines
tenfold) or `--quick` (128 tokens, one repetition, default threads only, about 2 minutes). It
prints a table and writes `benchmarks/results/decode.json` and `benchmarks/results/decode.md`
(`decode-quick.*` for `--quick`).
The first run also builds onnxruntime-genai's model (about a minute; needs torch, transformers
and onnx-ir, as in the test extras plus `pip install onnx-ir`).

What runs, on the bundled SmolLM2-135M-Instruct (the same prompt token ids for every engine,
greedy, exactly N new tokens with EOS ignored, N = 128 and 1024):

- edgepipe: the single-process LocalPipeline at int4, one stage and (128 tokens, default
  threads) three stages cut before units 11 and 21, through the same `generate` loop as
  `edgepipe generate`;
- onnxruntime-genai: its own Generator on its own model, built once by its model builder from
  the same GGUF (dequantized by transformers, then quantized to int4 by the builder) and
  cached under `$EDGEPIPE_HOME/bench/`;
- llama.cpp through llama-cpp-python on the original Q4_1 GGUF (skipped if not installed).

Every engine runs in a process of its own (`edgepipe.bench.decode_engines`), so peak RSS is
per engine; repetitions are interleaved (A B C A B C ...) and medians reported, because these
machines are shared and noisy. Threads: "default" is each ONNX Runtime engine's own default
(one intra-op thread per core) and n_threads = cores for llama.cpp (llama-cpp-python alone
would take half); then 1 thread for all.

Quality: top-1 agreement with fp32 (edgepipe's dequantized GGUF) over a few hundred positions,
teacher-forced: fp32 greedily continues three prompts, then each quantized engine is fed the
same tokens and its argmax at every position is compared with fp32's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgepipe.model.store import home_dir, resolve  # noqa: E402

PROMPT = "Write a long story about a dragon who learns to bake bread."
AGREE_PROMPTS = [
    "Why is the sky blue?",
    "Write a Python function that checks whether a number is prime, and explain it.",
    "Give me three tips for a job interview.",
]
CUTS = [11, 21]
WARMUP_TOKENS = 16


def child(job: dict, timeout: float = 600) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "edgepipe.bench.decode_engines", "run", json.dumps(job)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{job['engine']} ({job['task']}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"nproc": os.cpu_count(), "cpu": cpu, "memory_mib": mem, "os": platform.platform(), "python": platform.python_version()}


def ensure_genai(bench: Path, precision: str) -> Path:
    out = bench / f"genai-{version('onnxruntime-genai')}-{precision}"
    if not (out / "genai_config.json").is_file():
        print(f"building onnxruntime-genai's {precision} model (once, cached in {out}) ...", flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "edgepipe.bench.decode_engines", "build-genai", str(out), precision,
                               str(bench / "genai-work")], env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the onnxruntime-genai model failed:\n{done.stderr[-3000:]}")
    return out


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    """Share of positions with the same token, and the length of the common prefix."""
    n = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i in range(n) if a[i] != b[i]), n)
    return (same / n if n else 0.0), prefix


EP_WEIGHTS = "int4 MatMulNBits (asym, blocks of 32)"
GENAI_WEIGHTS = "int4 MatMulNBits (builder default)"
LLAMA_WEIGHTS = "Q4_1 GGUF (original)"


def timing_configs(thread_settings: list[int | None], lengths: list[int], genai_dir: Path, has_llama: bool) -> list[dict]:
    """The engines to time, in the order each repetition runs them."""
    configs = []
    for threads in thread_settings:
        common = {"threads": threads, "t": "default" if threads is None else str(threads)}
        configs.append({"label": "edgepipe, 1 stage", "engine": "edgepipe", "precision": "int4", "weights": EP_WEIGHTS, **common})
        if threads is None:  # the shortest length only: it shows what the cuts cost, and keeps the run short
            configs.append({"label": "edgepipe, 3 stages", "engine": "edgepipe", "precision": "int4", "weights": EP_WEIGHTS,
                            "cuts": CUTS, "lengths": lengths[:1], **common})
        configs.append({"label": "onnxruntime-genai", "engine": "genai", "precision": "int4", "weights": GENAI_WEIGHTS,
                        "genai_dir": str(genai_dir), **common})
        if has_llama:
            configs.append({"label": "llama.cpp", "engine": "llama.cpp", "precision": "q4_1", "weights": LLAMA_WEIGHTS, **common})
    return configs


def run_interleaved(configs: list[dict], reps: int, lengths: list[int], prompt: list[int], home: Path,
                    budget_s: float) -> list[list[dict]]:
    """``results[i][rep]``: one child process per engine and repetition, in the order A B C A B C ...

    A repetition is started only if it is expected to end within ``budget_s`` of the first one's
    start (on a loaded machine multi-threaded engines can slow down tenfold); at least one runs.
    """
    results: list[list[dict]] = [[] for _ in configs]
    start = time.perf_counter()
    for rep in range(reps):
        elapsed = time.perf_counter() - start
        if rep and elapsed + elapsed / rep > budget_s:
            print(f"  stopping after {rep} repetition(s): another would pass the {budget_s:.0f} s budget", flush=True)
            break
        for i, cfg in enumerate(configs):
            job = {"task": "time", "home": str(home), "prompt": prompt, "lengths": cfg.get("lengths", lengths), "warmup": WARMUP_TOKENS,
                   **{k: cfg[k] for k in ("engine", "precision", "threads", "cuts", "genai_dir") if k in cfg}}
            out = child(job)
            results[i].append(out)
            speeds = ", ".join(f"{r['n']}: {(r['generated'] - 1) / r['decode_s']:.0f} tok/s" for r in out["runs"])
            print(f"  rep {rep + 1}/{reps}  {cfg['label']:<20} threads {cfg['t']:<8} {speeds}  peak {out['peak_rss_mib']:.0f} MiB", flush=True)
    return results


def summarize(configs: list[dict], results: list[list[dict]], lengths: list[int]) -> list[dict]:
    """One row per engine and length: medians over repetitions, tokens compared with edgepipe's."""
    rows = []
    for i, cfg in enumerate(configs):
        reference = next(j for j, c in enumerate(configs) if c["engine"] == "edgepipe" and not c.get("cuts") and c["t"] == cfg["t"])
        for n in cfg.get("lengths", lengths):
            runs = [next(r for r in out["runs"] if r["n"] == n) for out in results[i]]
            ref_tokens = next(r for r in results[reference][0]["runs"] if r["n"] == n)["tokens"]
            same, prefix = agreement(runs[0]["tokens"], ref_tokens)
            rows.append({
                "engine": cfg["label"], "weights": cfg["weights"], "threads": cfg["t"], "new_tokens": n,
                "generated": min(r["generated"] for r in runs),
                "ttft_ms": round(statistics.median(r["ttft_s"] for r in runs) * 1e3, 1),
                "decode_tok_s": round(statistics.median((r["generated"] - 1) / r["decode_s"] for r in runs), 1),
                "decode_tok_s_reps": [round((r["generated"] - 1) / r["decode_s"], 1) for r in runs],
                "cpu_ms_per_token": round(statistics.median(r["cpu_ms_per_token"] for r in runs), 2),
                "load1": [round(r["load1"], 2) for r in runs],
                "peak_rss_mib": round(statistics.median(out["peak_rss_mib"] for out in results[i])),
                "load_s": round(statistics.median(out["load_s"] for out in results[i]), 2),
                "same_tokens_as_edgepipe": round(same, 3), "common_prefix_with_edgepipe": prefix,
            })
    return rows


def ratios(rows: list[dict], lengths: list[int]) -> list[dict]:
    """edgepipe (one stage) over each peer, per thread setting and length; > 1 means edgepipe is faster (tok/s)."""
    out = []
    for t in dict.fromkeys(r["threads"] for r in rows):
        for n in lengths:
            by = {r["engine"]: r for r in rows if r["threads"] == t and r["new_tokens"] == n}
            ep = by["edgepipe, 1 stage"]
            entry = {"threads": t, "new_tokens": n}
            for peer, key in (("onnxruntime-genai", "genai"), ("llama.cpp", "llama_cpp")):
                if peer in by:
                    entry[f"edgepipe_over_{key}_tok_s"] = round(ep["decode_tok_s"] / by[peer]["decode_tok_s"], 3)
                    entry[f"edgepipe_over_{key}_ttft"] = round(ep["ttft_ms"] / by[peer]["ttft_ms"], 3)
            if "edgepipe, 3 stages" in by:
                entry["three_stages_over_one_tok_s"] = round(by["edgepipe, 3 stages"]["decode_tok_s"] / ep["decode_tok_s"], 3)
            out.append(entry)
    return out


def top1_vs_fp32(agree_ids: list[list[int]], n: int, home: Path, genai_dir: Path, has_llama: bool) -> list[dict]:
    """Teacher-forced top-1 agreement of each quantized engine with edgepipe fp32's greedy continuations."""
    ref = child({"task": "reference", "engine": "edgepipe", "precision": "fp32", "threads": 1, "home": str(home),
                 "prompts": agree_ids, "n": n})["tokens"]
    sequences = list(zip(agree_ids, ref))
    candidates = [("edgepipe", EP_WEIGHTS, {"precision": "int4"}), ("edgepipe", "int8 MatMulNBits", {"precision": "int8"}),
                  ("onnxruntime-genai", GENAI_WEIGHTS, {"engine": "genai", "genai_dir": str(genai_dir)})]
    if has_llama:
        candidates.append(("llama.cpp", LLAMA_WEIGHTS, {"engine": "llama.cpp"}))
    quality = []
    for label, weights, extra in candidates:
        job = {"task": "agree", "engine": "edgepipe", "threads": 1, "home": str(home), "sequences": sequences, **extra}
        predicted = child(job)["predicted"]
        hits = sum(p == r for pred, (_, cont) in zip(predicted, sequences) for p, r in zip(pred, cont))
        total = sum(len(c) for _, c in sequences)
        quality.append({"engine": label, "weights": weights, "positions": total, "top1_agreement": round(hits / total, 4)})
        print(f"  {label:<20} {weights:<40} {hits}/{total} = {hits / total:.1%}", flush=True)
    return quality


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 tokens, 1 repetition, default threads, fewer agreement positions")
    ap.add_argument("--reps", type=int, help="interleaved repetitions per engine (default 3, quick 1)")
    ap.add_argument("--lengths", help="comma-separated new-token counts (default 128,1024; quick 128)")
    ap.add_argument("--threads", help="comma-separated thread settings, 'default' or a number (default: default,1)")
    ap.add_argument("--home", help="edgepipe home (default $EDGEPIPE_HOME or the user data dir)")
    ap.add_argument("--budget", type=float, default=420, help="seconds for the timed repetitions (default 420); later ones are skipped")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    lengths = [int(x) for x in (args.lengths or ("128" if args.quick else "128,1024")).split(",")]
    thread_settings = [None if t == "default" else int(t) for t in (args.threads or ("default" if args.quick else "default,1")).split(",")]
    agree_n = 48 if args.quick else 100
    agree_prompts = AGREE_PROMPTS[:2] if args.quick else AGREE_PROMPTS

    started, load_before = time.time(), os.getloadavg()
    home = home_dir(args.home)
    bench = home / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    packages = {p: resolve("smollm2", p, home) for p in ("int4", "int8", "fp32")}
    bounds = [0, *CUTS, len(packages["int4"].manifest.units)]
    for a, b in [*zip(bounds, bounds[1:]), (0, bounds[-1])]:  # merge stage graphs now, not inside a timed load
        packages["int4"].stage_graph(a, b)
    genai_dir = ensure_genai(bench, "int4")
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if not has_llama:
        print("llama.cpp: not installed (pip install llama-cpp-python); its column is skipped")
    tok = packages["int4"].tokenizer
    prompt = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))

    configs = timing_configs(thread_settings, lengths, genai_dir, has_llama)
    print(f"prompt: {len(prompt)} tokens; lengths {lengths}; {reps} interleaved repetition(s); "
          f"threads {list(dict.fromkeys(c['t'] for c in configs))}", flush=True)
    results = run_interleaved(configs, reps, lengths, prompt, home, args.budget)
    rows = summarize(configs, results, lengths)

    print(f"top-1 agreement: fp32 greedy reference, {len(agree_prompts)} prompts x {agree_n} tokens ...", flush=True)
    agree_ids = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in agree_prompts]
    quality = top1_vs_fp32(agree_ids, agree_n, home, genai_dir, has_llama)

    report = {
        "quick": args.quick,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "versions": {d: version(d) for d in ("edgepipe", "onnxruntime", "onnxruntime-genai", "llama_cpp_python", "numpy")},
        "conditions": {
            "model": f"SmolLM2-135M-Instruct (package {packages['int4'].root.name}); llama.cpp on the bundled Q4_1 GGUF",
            "prompt": PROMPT, "prompt_tokens": len(prompt), "new_tokens": lengths, "repetitions": len(results[0]), "repetitions_asked": reps,
            "decoding": "greedy, exactly N new tokens, EOS ignored (edgepipe eos_ids=(); genai EOS moved to an unused special token; llama.cpp argmax loop)",
            "process": f"one process per engine and repetition, repetitions interleaved; a {WARMUP_TOKENS}-token warm-up generation before timing",
            "ttft": "request start to the first sampled token (prefill of the prompt; genai includes creating its Generator)",
            "decode_tok_s": "(generated - 1) / (time from first to last token), median over repetitions",
            "peak_rss": "ru_maxrss of the engine's process (interpreter and libraries included), median over repetitions",
            "cpu_ms_per_token": "process CPU time (all threads, spin-waiting included) of a whole request / tokens, median",
            "threads": "default = the engine's own default for edgepipe and genai (ONNX Runtime: intra-op threads = cores); llama.cpp n_threads = cores",
            "genai_model": f"onnxruntime_genai.models.builder -i <HF folder dequantized from the GGUF by transformers> -p int4 -e cpu ({genai_dir.name})",
            "agreement": f"teacher-forced top-1 vs edgepipe fp32, {len(agree_prompts)} chat prompts x {agree_n} greedy fp32 tokens",
            "elapsed_s": round(time.time() - started),
        },
        "rows": rows, "ratios": ratios(rows, lengths), "top1_vs_fp32": quality,
        "llama_cpp": "ok" if has_llama else "not installed",
    }
    print_table(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode-quick" if args.quick else "decode"  # a smoke run never overwrites the full results
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'} ({report['conditions']['elapsed_s']} s)")


def print_table(report: dict) -> None:
    head = (f"{'threads':<8} {'engine':<20} {'weights':<38} {'N':>5} {'TTFT ms':>8} {'tok/s':>7} {'CPU ms/tok':>10} "
            f"{'peak MiB':>9} {'load s':>7} {'same as ep':>10}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in report["rows"]:
        flag = "" if r["generated"] == r["new_tokens"] else f"  (stopped at {r['generated']})"
        print(f"{r['threads']:<8} {r['engine']:<20} {r['weights']:<38} {r['new_tokens']:>5} {r['ttft_ms']:>8.1f} {r['decode_tok_s']:>7.1f} {r['cpu_ms_per_token']:>10.2f} "
              f"{r['peak_rss_mib']:>9} {r['load_s']:>7.2f} {r['same_tokens_as_edgepipe']:>10.0%}{flag}")
    print()
    for q in report["ratios"]:
        parts = [f"threads {q['threads']}, N={q['new_tokens']}:"]
        if "edgepipe_over_genai_tok_s" in q:
            verdict = "meets" if q["edgepipe_over_genai_tok_s"] >= 1.0 else "misses"
            parts.append(f"edgepipe/genai {q['edgepipe_over_genai_tok_s']:.2f}x tok/s ({verdict} the 1.0x goal), TTFT {q['edgepipe_over_genai_ttft']:.2f}x")
        if "edgepipe_over_llama_cpp_tok_s" in q:
            parts.append(f"edgepipe/llama.cpp {q['edgepipe_over_llama_cpp_tok_s']:.2f}x tok/s, TTFT {q['edgepipe_over_llama_cpp_ttft']:.2f}x")
        if "three_stages_over_one_tok_s" in q:
            parts.append(f"3 stages/1 stage {q['three_stages_over_one_tok_s']:.2f}x")
        print("  ".join(parts))
    print("\ntop-1 agreement with fp32 (teacher-forced):")
    for q in report["top1_vs_fp32"]:
        print(f"  {q['engine']:<20} {q['weights']:<40} {q['top1_agreement']:.1%} of {q['positions']} positions")
    print()


def markdown(report: dict) -> str:
    m, v, c = report["machine"], report["versions"], report["conditions"]
    lines = [
        "# Decode benchmark",
        "",
        f"- date: {report['date']}",
        f"- machine: {m['nproc']} cores, {m['cpu']}, {m['memory_mib']} MiB RAM, {m['os']}, Python {m['python']}; "
        f"load average {report['load_average']['before'][0]} before, {report['load_average']['after'][0]} after (shared machine)",
        f"- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + (", llama.cpp not installed" if report["llama_cpp"] != "ok" else ""),
        f"- model: {c['model']}; prompt {c['prompt_tokens']} tokens (chat template): \"{c['prompt']}\"",
        f"- {c['decoding']}; {c['repetitions']} repetitions, {c['process']}",
        f"- TTFT: {c['ttft']}; tok/s: {c['decode_tok_s']}; CPU ms/token: {c['cpu_ms_per_token']}; peak RSS: {c['peak_rss']}",
        f"- threads: {c['threads']}",
        f"- onnxruntime-genai model: {c['genai_model']}",
        f"- produced by `python benchmarks/decode.py` in {c['elapsed_s']} s",
        "",
        "| threads | engine | weights | new tokens | TTFT ms | decode tok/s (median; reps) | CPU ms/token | peak RSS MiB | load s | same tokens as edgepipe |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        reps = ", ".join(f"{x:.0f}" for x in r["decode_tok_s_reps"])
        stopped = "" if r["generated"] == r["new_tokens"] else f" (stopped at {r['generated']})"
        lines.append(f"| {r['threads']} | {r['engine']} | {r['weights']} | {r['new_tokens']}{stopped} | {r['ttft_ms']:.1f} | "
                     f"{r['decode_tok_s']:.1f} ({reps}) | {r['cpu_ms_per_token']:.2f} | {r['peak_rss_mib']} | {r['load_s']:.2f} | {r['same_tokens_as_edgepipe']:.0%} |")
    lines += ["", "| threads | new tokens | edgepipe / genai tok/s | edgepipe / genai TTFT | edgepipe / llama.cpp tok/s | edgepipe / llama.cpp TTFT | 3 stages / 1 stage tok/s |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for q in report["ratios"]:
        cell = lambda k: f"{q[k]:.2f}x" if k in q else "-"  # noqa: E731
        lines.append(f"| {q['threads']} | {q['new_tokens']} | {cell('edgepipe_over_genai_tok_s')} | {cell('edgepipe_over_genai_ttft')} | "
                     f"{cell('edgepipe_over_llama_cpp_tok_s')} | {cell('edgepipe_over_llama_cpp_ttft')} | {cell('three_stages_over_one_tok_s')} |")
    lines += ["", f"Top-1 agreement with fp32, {c['agreement']}:", "", "| engine | weights | positions | top-1 agreement |", "| --- | --- | ---: | ---: |"]
    for q in report["top1_vs_fp32"]:
        lines.append(f"| {q['engine']} | {q['weights']} | {q['positions']} | {q['top1_agreement']:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
