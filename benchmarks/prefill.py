"""Prefill: edgepipe's kernel form against llama.cpp's `llama-bench` on the same GGUF, interleaved.

    python benchmarks/prefill.py                                  # the 1.5B Q4_K_M and the 0.5B, 512 and 1531 tokens
    python benchmarks/prefill.py --model x.gguf --tokens 512 --threads 1 2 --reps 2

Needs `scripts/build_llama_cpp.sh` (llama-bench) and the GGUFs (`scripts/fetch_qwen15.sh`,
`scripts/fetch_qwen05.sh`). Writes `benchmarks/results/prefill.{json,md}` (`--stem` to rename).

edgepipe: the single-process pipeline (`edgepipe generate`'s loop, precision `gguf`), in a
process of its own per repetition (`edgepipe.bench.decode_engines`): one prefill of the prompt
as warm-up, then `--samples` timed prefills, each a fresh sequence of N prompt tokens up to the
first sampled token (TTFT); prefill tok/s = N / median TTFT. The prompt is N token ids of real
text (this repository's docs, tokenized by the model's own tokenizer). llama.cpp: `llama-bench
-p N -n 0 -r 3` (its pp test: a fresh context, the prompt in batches of 2048, ubatches of 512;
its token ids are random, which a dense model's cost does not depend on). Each engine in its own
process, repetitions interleaved (edgepipe, llama.cpp, edgepipe, llama.cpp ...), means reported
beside each repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import resolve

ROOT = Path(__file__).resolve().parents[1]
LLAMA_BIN = Path(os.environ.get("EDGEPIPE_LLAMA_CPP") or Path.home() / ".cache" / "edgepipe" / "llama.cpp") / "0.3.36" / "bin"
MODELS = Path(os.environ.get("EDGEPIPE_MODELS") or Path.home() / ".cache" / "edgepipe" / "models")
DEFAULT_MODELS = [MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", MODELS / "qwen2.5-coder-0.5b-instruct.gguf"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def prompt_ids(package, n: int) -> list[int]:
    """``n`` token ids of real text: this repository's docs, as the model's tokenizer reads them."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = package.tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the docs give only {len(ids)} tokens; ask for fewer than {n}")
    return ids[:n]


def edgepipe_prefill(model: Path, ids: list[int], threads: int, samples: int) -> list[float]:
    job = {"engine": "edgepipe", "task": "time", "precision": "gguf", "threads": threads, "model": str(model),
           "prompt": ids, "lengths": [1] * samples, "warmup": 1}
    done = subprocess.run([sys.executable, "-m", "edgepipe.bench.decode_engines", "run", json.dumps(job)],
                          capture_output=True, text=True, env=ENV, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"edgepipe failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return [r["ttft_s"] for r in out["runs"]]


def llama_prefill(model: Path, n: int, threads: int) -> float:
    done = subprocess.run([str(LLAMA_BIN / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", str(n), "-n", "0",
                           "-r", "3", "-o", "json"], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed:\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def kernel_isa() -> str:
    """The ISA edgepipe's kernel library runs here (EDGEPIPE_GGUF_ISA, else the best the CPU has)."""
    import ctypes
    from edgepipe.native import gguf_kernel_library
    path = gguf_kernel_library()
    if path is None:
        return "none (no kernel library)"
    lib = ctypes.CDLL(str(path))
    lib.edgepipe_gguf_isa.restype = ctypes.c_char_p
    return lib.edgepipe_gguf_isa().decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", type=Path, help="GGUF (repeatable; default the 1.5B Q4_K_M and the 0.5B)")
    ap.add_argument("--tokens", nargs="+", type=int, default=[512, 1531], help="prompt lengths")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per engine")
    ap.add_argument("--samples", type=int, default=3, help="timed prefills per edgepipe process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stem", default="prefill")
    args = ap.parse_args()
    if not (LLAMA_BIN / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {LLAMA_BIN}: run scripts/build_llama_cpp.sh")
    models = args.model or DEFAULT_MODELS
    if missing := [m for m in models if not m.is_file()]:
        raise SystemExit(f"missing {', '.join(map(str, missing))}: run scripts/fetch_qwen15.sh / scripts/fetch_qwen05.sh")
    cond = Conditions.start()
    rows = []
    for model in models:
        package = resolve(str(model), "gguf")
        for n in args.tokens:
            ids = prompt_ids(package, n)
            for t in args.threads:
                ours, theirs = [], []
                for rep in range(args.reps):
                    ttft = statistics.median(edgepipe_prefill(model, ids, t, args.samples))
                    ours.append(n / ttft)
                    theirs.append(llama_prefill(model, n, t))
                    print(f"{model.name} {n} tokens, {t} thread(s), rep {rep + 1}: edgepipe {ours[-1]:.1f} tok/s, "
                          f"llama.cpp {theirs[-1]:.1f} (load {os.getloadavg()[0]:.2f})", flush=True)
                rows.append({"model": model.name, "tokens": n, "threads": t, "edgepipe_tok_s": [round(v, 1) for v in ours],
                             "llama_cpp_tok_s": [round(v, 1) for v in theirs],
                             "ratio": round(statistics.mean(ours) / statistics.mean(theirs), 3)})
    cond.finish()
    lines = ["# Prefill: edgepipe (kernel form) against llama-bench", "", f"- {cond.line()}",
             f"- `python benchmarks/prefill.py {' '.join(sys.argv[1:])}`; edgepipe: median of {args.samples} prefills a process; "
             "llama.cpp: `llama-bench -p N -n 0 -r 3`; each engine in its own process, repetitions interleaved",
             f"- edgepipe's kernel ISA: `{kernel_isa()}`", "",
             "| model | prompt tokens | threads | edgepipe tok/s (reps) | llama.cpp tok/s (reps) | ratio (means) |",
             "| --- | ---: | ---: | --- | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['threads']} | {' / '.join(map(str, r['edgepipe_tok_s']))} | "
                     f"{' / '.join(map(str, r['llama_cpp_tok_s']))} | **{r['ratio']:.2f}x** |")
    for path in write_results(args.stem, {**cond.as_dict(), "kernel_isa": kernel_isa(), "rows": rows}, "\n".join(lines), args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
