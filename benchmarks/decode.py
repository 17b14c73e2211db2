"""Decode benchmark: edgepipe against llama.cpp on the same GGUF, side by side in one run.

    python benchmarks/decode.py                      # SmolLM2-135M Q4_1 + the 0.5B Qwen (if present) + 8B-shaped import
    python benchmarks/decode.py --model x.gguf ...   # any GGUF(s); --model may repeat
    python benchmarks/decode.py --quick              # 128 tokens, 1 repetition, 2 threads, no synthetic import

Writes `benchmarks/results/decode.json` and `decode.md` (`decode-quick.*` for `--quick`).

Per model: edgepipe imports the file with its default precision (``native``: the file's own
blocks, exactly) and runs the single-process LocalPipeline through the same `generate` loop as
`edgepipe generate`; llama.cpp (llama-cpp-python, the `bench` extra) runs the same file. Same
prompt token ids, greedy, exactly N new tokens (EOS ignored), N = 128 and 1024, at 1 and 2
threads; every engine and repetition in a process of its own, repetitions interleaved
(A B A B ...), medians reported. Time to first token = prefill of the prompt + first sample.

Bandwidth: bytes of weights each engine streams per token (every weight file but the embedding
table, which is only gathered, unless the head reads it too; of a mixture-of-experts layer only
the routed experts, expert_used_count of expert_count) x tokens/s, against this machine's
read bandwidth measured here with numpy (1 and 2 threads summing a 1 GiB array).

Agreement: llama.cpp greedily continues three chat prompts; both engines are then teacher-forced
through those sequences and edgepipe's argmax at each position is compared with llama.cpp's.

Synthetic import (full run, or `--synthetic`): writes a GGUF with Llama-3-8B's shapes (random
Q4_K blocks, Q6_K for ffn_down/attn_v/output as in Q4_K_M) under /tmp with the `gguf` writer,
runs `edgepipe import` on it in a child process, records its wall time and peak RSS, deletes both.
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

from edgepipe.bench.decode_engines import AGREE_PROMPTS, PROMPT, matches
from edgepipe.bench.machine import Conditions, package_version as version
from edgepipe.bench.results import write_results
from edgepipe.bench.synthetic import LLAMA3_8B, write_synthetic_gguf
from edgepipe.model.store import bundled_gguf, home_dir, reference_gguf, resolve
from edgepipe.native import native_library

ROOT = Path(__file__).resolve().parents[1]
WARMUP_TOKENS = 16
QWEN05 = reference_gguf("qwen05")  # scripts/fetch_qwen05.sh
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def child(job: dict, timeout: float = 900) -> dict:
    done = subprocess.run([sys.executable, "-m", "edgepipe.bench.decode_engines", "run", json.dumps(job)],
                          capture_output=True, text=True, env=ENV, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{job['engine']} ({job['task']}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def streamed_bytes_edgepipe(pkg) -> int:
    """Weight bytes read per decode token: every unit's files but the embedding's (unless the head shares them)."""
    m = pkg.manifest
    files = set()
    for u in range(1, len(m.units)):
        files.update(m.variant(u).files)
    return sum(pkg.blob(s).stat().st_size for s in files)


def package_weight_mb(pkg, precision: str) -> float:
    """MB of the weight files of one variant of a package."""
    m = pkg.manifest
    return round(sum(pkg.blob(s).stat().st_size for s in m.stage_files(0, len(m.units), precision)) / 1e6, 1)


def streamed_bytes_gguf(path: Path) -> int:
    """Weight bytes a one-row decode step reads from the file: every tensor but the gathered
    embedding (unless the head shares it), and of a mixture-of-experts layer's expert tensors
    (``*_exps``) only the routed share, expert_used_count / expert_count."""
    from edgepipe.model.gguf_source import read_gguf_header

    meta, tensors = read_gguf_header(path)
    tied = "output.weight" not in tensors
    routed = routed_share(meta)
    return round(sum(t.nbytes * (routed if "_exps." in name else 1)
                     for name, t in tensors.items() if name != "token_embd.weight" or tied))


def routed_share(meta: dict) -> float:
    """Share of a MoE layer's experts one token reads (1.0 for a dense model)."""
    arch = meta.get("general.architecture", "")
    experts, used = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    return int(used) / int(experts) if experts and used else 1.0


def expert_bytes_gguf(path: Path) -> int:
    from edgepipe.model.gguf_source import read_gguf_header

    _, tensors = read_gguf_header(path)
    return sum(t.nbytes for name, t in tensors.items() if "_exps." in name)


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    """Share of positions with the same token, and the length of the common prefix."""
    n = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    prefix = next((i for i in range(n) if a[i] != b[i]), n)
    return (same / n if n else 0.0), prefix



def bench_model(path: Path, home: Path, reps: int, lengths: list[int], thread_settings: list[int], agree_n: int,
                has_llama: bool, budget_s: float, with_invariant: bool = False, precisions: tuple[str, ...] = ("native",)) -> dict:
    print(f"\n== {path.name} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
    t0 = time.perf_counter()
    pkg = resolve(str(path), "native", home)
    import_s = time.perf_counter() - t0
    pkg.stage_graph(0, len(pkg.manifest.units))  # merge the one-stage graph now, not inside a timed load
    tok = pkg.tokenizer
    prompt = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    ep_bytes, gguf_bytes = streamed_bytes_edgepipe(pkg), streamed_bytes_gguf(path)
    # A package's files hold every expert; a decode step reads the routed ones: take the unread
    # experts' bytes out, as the file counts them (exact for the kernel form, which keeps the file's
    # blocks; scaled by the package's size against the file's for the others).
    from edgepipe.model.gguf_source import read_gguf_header
    meta, tensors = read_gguf_header(path)
    unread = expert_bytes_gguf(path) * (1 - routed_share(meta))
    file_bytes = sum(t.nbytes for t in tensors.values())
    def read_per_token(package_bytes: int) -> int:
        return round(package_bytes - unread * package_bytes / file_bytes) if unread else package_bytes
    ep_bytes = read_per_token(ep_bytes)
    other_bytes, package_mb = {}, {"native": package_weight_mb(pkg, "native")}
    for precision in precisions[1:] if precisions[0] == "native" else precisions:  # e.g. gguf: the kernel library's variant
        other = resolve(str(path), precision, home)
        other.stage_graph(0, len(other.manifest.units))
        other_bytes[precision] = read_per_token(streamed_bytes_edgepipe(other))
        package_mb[precision] = package_weight_mb(other, precision)
    configs = []
    for threads in thread_settings:
        if "native" in precisions:
            configs.append({"label": "edgepipe", "engine": "edgepipe", "precision": "native", "threads": threads, "bytes": ep_bytes})
        for precision, nbytes in other_bytes.items():
            configs.append({"label": f"edgepipe {precision}", "engine": "edgepipe", "precision": precision, "threads": threads, "bytes": nbytes})
        if with_invariant:
            configs.append({"label": "edgepipe batch-invariant", "engine": "edgepipe", "precision": "native", "threads": threads,
                            "bytes": ep_bytes, "batch_invariant": True})
        if has_llama:
            configs.append({"label": "llama.cpp", "engine": "llama.cpp", "precision": "gguf", "threads": threads, "bytes": gguf_bytes})
    results: list[list[dict]] = [[] for _ in configs]
    start = time.perf_counter()
    for rep in range(reps):
        elapsed = time.perf_counter() - start
        if rep and elapsed + elapsed / rep > budget_s:
            print(f"  stopping after {rep} repetition(s): another would pass the {budget_s:.0f} s budget", flush=True)
            break
        for i, cfg in enumerate(configs):
            job = {"task": "time", "home": str(home), "model": str(path), "prompt": prompt, "lengths": lengths, "warmup": WARMUP_TOKENS,
                   "n_ctx": len(prompt) + max(lengths) + 8, "batch_invariant": cfg.get("batch_invariant", False),
                   **{k: cfg[k] for k in ("engine", "precision", "threads")}}
            out = child(job)
            results[i].append(out)
            speeds = ", ".join(f"{r['n']}: {(r['generated'] - 1) / r['decode_s']:.1f} tok/s" for r in out["runs"])
            print(f"  rep {rep + 1}/{reps}  {cfg['label']:<10} threads {cfg['threads']}  {speeds}  load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for i, cfg in enumerate(configs):
        for n in lengths:
            runs = [next(r for r in out["runs"] if r["n"] == n) for out in results[i]]
            tok_s = statistics.median((r["generated"] - 1) / r["decode_s"] for r in runs)
            rows.append({"engine": cfg["label"], "threads": cfg["threads"], "new_tokens": n,
                         "ttft_ms": round(statistics.median(r["ttft_s"] for r in runs) * 1e3, 1),
                         "decode_tok_s": round(tok_s, 1), "decode_tok_s_reps": [round((r["generated"] - 1) / r["decode_s"], 1) for r in runs],
                         "streamed_mb_per_token": round(cfg["bytes"] / 1e6, 1), "gb_s": round(cfg["bytes"] * tok_s / 1e9, 2),
                         "load1": [round(r["load1"], 2) for r in runs],
                         "peak_rss_mib": round(statistics.median(out["peak_rss_mib"] for out in results[i]))})
    ratios = []
    for threads in thread_settings:
        for n in lengths:
            by = {r["engine"]: r for r in rows if r["threads"] == threads and r["new_tokens"] == n}
            if "llama.cpp" in by and "edgepipe" in by:
                ratios.append({"threads": threads, "new_tokens": n,
                               "tok_s": round(by["edgepipe"]["decode_tok_s"] / by["llama.cpp"]["decode_tok_s"], 3),
                               "ttft": round(by["edgepipe"]["ttft_ms"] / by["llama.cpp"]["ttft_ms"], 3)})
    quality = None
    if has_llama:
        print(f"  top-1 agreement: llama.cpp greedy reference, {len(AGREE_PROMPTS)} prompts x {agree_n} tokens ...", flush=True)
        agree_ids = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in AGREE_PROMPTS]
        common = {"home": str(home), "model": str(path), "threads": 1, "n_ctx": max(map(len, agree_ids)) + agree_n + 8}
        ref = child({"task": "reference", "engine": "llama.cpp", "precision": "gguf", "prompts": agree_ids, "n": agree_n, **common})["tokens"]
        sequences = list(zip(agree_ids, ref))
        llama_pred = child({"task": "agree", "engine": "llama.cpp", "precision": "gguf", "sequences": sequences, **common})["predicted"]
        ep_pred = child({"task": "agree", "engine": "edgepipe", "precision": "native", "sequences": sequences, **common})["predicted"]
        # The noise floor: llama.cpp against itself with K/V kept in f32 instead of f16.
        f32_pred = child({"task": "agree", "engine": "llama.cpp", "precision": "gguf", "sequences": sequences, "kv_cache": "f32", **common})["predicted"]
        hits, positions = matches(ep_pred, llama_pred)
        quality = {"positions": positions, "top1_agreement_with_llama_cpp": round(hits / positions, 4),
                   "llama_cpp_f32_kv_vs_llama_cpp": round(matches(f32_pred, llama_pred)[0] / positions, 4),
                   "edgepipe_vs_llama_cpp_f32_kv": round(matches(ep_pred, f32_pred)[0] / positions, 4)}
        print(f"  edgepipe vs llama.cpp: {hits}/{positions} = {hits / positions:.1%}; llama.cpp f32-KV vs llama.cpp: "
              f"{quality['llama_cpp_f32_kv_vs_llama_cpp']:.1%}; edgepipe vs llama.cpp f32-KV: {quality['edgepipe_vs_llama_cpp_f32_kv']:.1%}", flush=True)
    m = pkg.manifest
    return {"model": path.name, "file_mb": round(path.stat().st_size / 1e6, 1), "architecture": m.config["architecture"],
            "package": pkg.root.name, "package_weight_mb": package_mb["native"], "package_weight_mb_by_precision": package_mb,
            "import_s_in_benchmark": round(import_s, 1), "prompt_tokens": len(prompt),
            "rows": rows, "ratios": ratios, "agreement": quality, "repetitions": len(results[0])}


# -- synthetic 8B-shaped import ---------------------------------------------------------------

def synthetic_import(work: Path) -> dict:
    gguf_path = work / "synthetic-8b-q4_k_m.gguf"
    print(f"\n== synthetic 8B-shaped GGUF -> {gguf_path}", flush=True)
    t0 = time.perf_counter()
    size = write_synthetic_gguf(gguf_path, **LLAMA3_8B)
    print(f"  wrote {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    home = work / "home"
    # The child prints its own ru_maxrss: RUSAGE_CHILDREN would also count the engines run before.
    code = ("import resource, sys\nfrom edgepipe.cli import app\ntry:\n    app()\nfinally:\n"
            "    print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    cmd = [sys.executable, "-c", code, "import", str(gguf_path), "--home", str(home)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"import failed:\n{done.stderr[-3000:]}")
    peak_kib = int(next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("PEAK_RSS_KIB")))
    pkg_bytes = sum(f.stat().st_size for f in (home / "models").rglob("*") if f.is_file())
    out = {"shape": "Llama-3-8B (32 layers, hidden 4096, ffn 14336, 32/8 heads, vocab 128256), Q4_K + Q6_K (attn_v, ffn_down, output)",
           "file_gb": round(size / 1e9, 2), "package_gb": round(pkg_bytes / 1e9, 2), "import_s": round(wall, 1),
           "import_gb_s": round(size / wall / 1e9, 3), "peak_rss_mib": round(peak_kib / 1024),
           "load1_at_start": round(load, 2), "stdout": done.stdout.strip()[-300:]}
    print(f"  import {wall:.0f} s, peak RSS {out['peak_rss_mib']} MiB, package {pkg_bytes / 1e9:.2f} GB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="a GGUF file (repeatable; default: bundled SmolLM2 Q4_1 and the 0.5B Qwen if present)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 128 tokens, 1 repetition, 2 threads, 48 agreement tokens per prompt")
    ap.add_argument("--reps", type=int, help="interleaved repetitions per engine (default 3, quick 1)")
    ap.add_argument("--lengths", nargs="+", help="new-token counts, e.g. 128 1024 or 128,1024 (default 128 1024; quick 128)")
    ap.add_argument("--threads", nargs="+", help="thread counts, e.g. 1 2 or 1,2 (default 1 2; quick 2)")
    ap.add_argument("--synthetic", action=argparse.BooleanOptionalAction, default=None,
                    help="measure importing an 8B-shaped synthetic GGUF (default: on, off with --quick)")
    ap.add_argument("--home", help="edgepipe home (default $EDGEPIPE_HOME or the user data dir)")
    ap.add_argument("--budget", type=float, default=900, help="seconds of timed repetitions per model (default 900)")
    ap.add_argument("--with-invariant", action="store_true", help="also time edgepipe batch-invariant (serve --batch-invariant's runners)")
    ap.add_argument("--precisions", nargs="+", default=["native"],
                    help="edgepipe package variants to time, e.g. native gguf (gguf: the GGUF kernel library; default native)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    ints = lambda values: [int(v) for arg in values for v in arg.split(",") if v]  # noqa: E731
    lengths = ints(args.lengths or (["128"] if args.quick else ["128", "1024"]))
    thread_settings = ints(args.threads or (["2"] if args.quick else ["1", "2"]))
    synthetic = (not args.quick) if args.synthetic is None else args.synthetic
    models = [Path(m) for m in args.model] if args.model else [bundled_gguf()] + ([QWEN05] if QWEN05.is_file() else [])

    started, run = time.time(), Conditions.start()
    home = home_dir(args.home)
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if not has_llama:
        print("llama.cpp: not installed (pip install -e '.[bench]'); its columns are skipped")
    if "gguf" in args.precisions and (library := native_library()).path is None:
        args.precisions = [p for p in args.precisions if p != "gguf"]
        print(f"gguf: no GGUF kernel library ({library.reason}); its rows are skipped")
        if not args.precisions:
            sys.exit("nothing to time: pass --precisions native (the MatMulNBits form runs everywhere)")
    # In a child: a 1 GiB array here would raise the peak RSS every engine process inherits.
    probe = [sys.executable, "-m", "edgepipe.bench.machine"]
    bandwidth = {f"{t}_threads": float(subprocess.run([*probe, str(t)], capture_output=True, text=True, env=ENV,
                                                      check=True).stdout.split()[-1]) for t in sorted(set(thread_settings) | {1})}
    print(f"memory read bandwidth (numpy): {bandwidth} GB/s", flush=True)
    per_model = [bench_model(m, home, reps, lengths, thread_settings, 48 if args.quick else 100, has_llama, args.budget, args.with_invariant, tuple(args.precisions)) for m in models]
    synth = None
    if synthetic:
        work = Path(tempfile.mkdtemp(prefix="edgepipe-synth-", dir="/tmp"))
        try:
            synth = synthetic_import(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "quick": args.quick, **run.finish().as_dict(),
        "versions": {d: version(d) for d in ("edgepipe", "onnxruntime", "llama_cpp_python", "gguf", "numpy")},
        "memory_bandwidth_gb_s": bandwidth, "lengths": lengths, "threads": thread_settings,
        "conditions": {
            "decoding": "greedy, exactly N new tokens, EOS ignored; same prompt ids for both engines",
            "process": f"one process per engine and repetition, repetitions interleaved; a {WARMUP_TOKENS}-token warm-up before timing",
            "ttft": "request start to the first sampled token (prefill of the prompt)",
            "decode_tok_s": "(generated - 1) / (time from first to last token), median over repetitions",
            "gb_s": "weight bytes read per token (all but the gathered embedding table; of MoE experts the routed share) x decode tok/s",
            "agreement": f"teacher-forced top-1, edgepipe vs llama.cpp, along llama.cpp's greedy continuations of {len(AGREE_PROMPTS)} chat prompts; "
                         "beside it llama.cpp with an f32 KV cache vs its default f16 one (how far llama.cpp moves from itself)",
            "elapsed_s": round(time.time() - started),
        },
        "models": per_model, "synthetic_import": synth,
        "llama_cpp": version("llama_cpp_python") if has_llama else "not installed: its columns and the agreement are missing",
    }
    stem = "decode-quick" if args.quick else "decode"  # a smoke run never overwrites the full results
    written = write_results(stem, report, markdown(report), args.out)
    print("\n" + markdown(report))
    print(f"wrote {' and '.join(map(str, written))} ({report['conditions']['elapsed_s']} s)")


def markdown(report: dict) -> str:
    c, bw = report["conditions"], report["memory_bandwidth_gb_s"]
    lines = [
        "# Decode benchmark: edgepipe vs llama.cpp on the same GGUF", "",
        f"- date: {report['date']}; produced by `python benchmarks/decode.py{' --quick' if report['quick'] else ''}` in {c['elapsed_s']} s",
        f"- {Conditions.from_dict(report).line()} (`/proc/loadavg`; a shared machine: compare engines only within one run)",
        f"- memory read bandwidth measured here (numpy): " + ", ".join(f"{k.replace('_', ' ')}: {v} GB/s" for k, v in bw.items()),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v) + f"; llama.cpp: {report.get('llama_cpp')}",
        f"- {c['decoding']}; {c['process']}; TTFT: {c['ttft']}; tok/s: {c['decode_tok_s']}; GB/s: {c['gb_s']}",
        f"- agreement: {c['agreement']}", "",
    ]
    for mod in report["models"]:
        q = mod["agreement"]
        sizes = mod.get("package_weight_mb_by_precision") or {"native": mod["package_weight_mb"]}
        lines += [f"## {mod['model']} ({mod['architecture']}, file {mod['file_mb']} MB, package "
                  + ", ".join(f"{mb} MB {precision}" for precision, mb in sizes.items()) + ")", "",
                  f"Prompt {mod['prompt_tokens']} tokens, {mod['repetitions']} repetition(s). "
                  + (f"Top-1 agreement with llama.cpp: **{q['top1_agreement_with_llama_cpp']:.1%}** of {q['positions']} positions" if q else "")
                  + (f" (llama.cpp with an f32 KV cache against its default f16 one: {q['llama_cpp_f32_kv_vs_llama_cpp']:.1%}; "
                     f"edgepipe against llama.cpp f32-KV: {q['edgepipe_vs_llama_cpp_f32_kv']:.1%})" if q and "llama_cpp_f32_kv_vs_llama_cpp" in q else "")
                  + ("." if q else ""), "",
                  "| threads | engine | new tokens | TTFT ms | decode tok/s (median; reps) | MB/token | GB/s | peak RSS MiB | load1 |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in mod["rows"]:
            reps = ", ".join(f"{x:.1f}" for x in r["decode_tok_s_reps"])
            lines.append(f"| {r['threads']} | {r['engine']} | {r['new_tokens']} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} ({reps}) | "
                         f"{r['streamed_mb_per_token']} | {r['gb_s']} | {r['peak_rss_mib']} | {r['load1']} |")
        if mod["ratios"]:
            lines += ["", "| threads | new tokens | edgepipe / llama.cpp tok/s | edgepipe / llama.cpp TTFT |", "| ---: | ---: | ---: | ---: |"]
            lines += [f"| {q['threads']} | {q['new_tokens']} | {q['tok_s']:.2f}x | {q['ttft']:.2f}x |" for q in mod["ratios"]]
        lines.append("")
    s = report.get("synthetic_import")
    if s:
        lines += ["## Import of an 8B-shaped synthetic GGUF", "", f"{s['shape']}: file {s['file_gb']} GB, package {s['package_gb']} GB; "
                  f"`edgepipe import` took **{s['import_s']} s** ({s['import_gb_s']} GB/s) with **peak RSS {s['peak_rss_mib']} MiB** "
                  f"(load1 {s['load1_at_start']} at start).", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
