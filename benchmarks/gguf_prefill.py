"""Prefill time (TTFT) of the `gguf` precision against `native`, in one process, interleaved.

    python benchmarks/gguf_prefill.py [--model x.gguf] [--threads 1] [--reps 7] [--decode 32] [--library old=/path/lib.so ...]

Runs the decode benchmark's chat prompt (``edgepipe.bench.decode_engines.PROMPT``) through the one-stage
pipeline of each variant and times the prefill step (prompt in, first token sampled) — `native`
(MatMulNBits graphs), `gguf` with this checkout's kernel library, and `gguf` with each
`--library LABEL=PATH` (another build, e.g. main's, to compare kernels on the same load). Reports
median and min per variant, the first token (all must agree on it) and the load average; with
`--decode N`, also N greedy decode steps after each prefill (tokens per second, median), so a
kernel change is seen not to cost the one-row path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import edgepipe.native as native
from edgepipe.bench.decode_engines import PROMPT
from edgepipe.bench.machine import Conditions
from edgepipe.model.store import home_dir, reference_gguf, resolve
from edgepipe.runtime.stage_runner import SamplingBatch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(reference_gguf("qwen05")))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--decode", type=int, default=0, help="also time this many decode steps after each prefill")
    ap.add_argument("--library", action="append", default=[], help="LABEL=PATH of another kernel library build")
    args = ap.parse_args()
    if native.gguf_kernel_library() is None:
        sys.exit(f"no GGUF kernel library: {native.native_library().reason}")
    home = home_dir(None)
    packages = {p: resolve(args.model, p, home) for p in ("native", "gguf")}
    tok = packages["native"].tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    libraries = {"gguf": native.gguf_kernel_library(), **{f"gguf {label}": Path(path) for label, path in
                                                          (spec.split("=", 1) for spec in args.library)}}
    pipes = {"native": packages["native"].pipeline([], precision="native", threads=args.threads)}
    for label, library in libraries.items():
        native._cached = native.NativeLibrary(library, None)  # the sessions built next register this build
        pipes[label] = packages["gguf"].pipeline([], precision="gguf", threads=args.threads)
    native.reset_for_tests()
    greedy, times, first = SamplingBatch.greedy(1), {label: [] for label in pipes}, {}
    decode_rates = {label: [] for label in pipes}
    run = Conditions.start()
    for rep in range(args.reps + 1):  # the first round warms up
        for label, pipe in pipes.items():
            start = time.perf_counter()
            token = pipe.step(f"r{rep}", ids, greedy)
            elapsed = time.perf_counter() - start
            decode_start = time.perf_counter()
            for _ in range(args.decode):
                token = pipe.step(f"r{rep}", [token], greedy)
            decode_s = time.perf_counter() - decode_start
            pipe.drop(f"r{rep}")
            first.setdefault(label, token)
            if rep:
                times[label].append(elapsed)
                if args.decode:
                    decode_rates[label].append(args.decode / decode_s)
    print(f"{Path(args.model).name}: prompt {len(ids)} tokens, {args.threads} thread(s), {args.reps} reps; {run.finish().line()}")
    for label, spent in times.items():
        decode = f"  decode {statistics.median(decode_rates[label]):5.1f} tok/s" if args.decode else ""
        print(f"  {label:<14} TTFT median {statistics.median(spent) * 1e3:7.1f} ms  min {min(spent) * 1e3:7.1f} ms{decode}  "
              f"{'last' if args.decode else 'first'} token {first[label]}")


if __name__ == "__main__":
    main()
