"""KV memory of one sequence with sliding-window layers trimmed to their window, and without.

Usage: python benchmarks/window_kv.py PACKAGE_DIR [TOKENS]   (e.g. Gemma 3 270M imported with
``edgepipe import``; TOKENS default 1024). Runs one sequence to TOKENS positions in one stage
runner chain, twice (trimmed, and with trimming switched off), and prints the bytes each
holds: live positions (what a KV move sends), the pool's allocation, and the planner's figure.
Writes benchmarks/results/window_kv.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.package import Package
from edgepipe.plan import ModelProfile, UnitProfile
from edgepipe.runtime import stage_runner
from edgepipe.runtime.stage_runner import SamplingBatch

MiB = 1 << 20


def run(pkg: Package, tokens: int) -> dict:
    pipe = pkg.pipeline()
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = pkg.tokenizer.encode(text)[: tokens - 16]
    feed = ids
    while pipe.runners[0].length("s") < tokens:
        feed = [pipe.step("s", feed, SamplingBatch.greedy(1))]
    live = sum(a.nbytes for r in pipe.runners for a in r.export_kv("s").values())
    pool = sum(r.kv_bytes for r in pipe.runners)
    rows = max(r._pool.rows for r in pipe.runners if r.layers)
    return {"length": pipe.runners[0].length("s"), "live": live, "pool": pool, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", type=Path, help="an imported package folder with sliding-window layers (e.g. Gemma 3 270M)")
    ap.add_argument("tokens", type=int, nargs="?", default=1024)
    args = ap.parse_args()
    pkg, tokens = Package(args.package), args.tokens
    run = Conditions.start()
    trimmed = run(pkg, tokens)
    stage_runner.window_start = lambda length, window: 0  # keep every position
    full = run(pkg, tokens)
    m = pkg.manifest
    profile = ModelProfile(m.name, tuple(UnitProfile(u.index, u.name, 0.0, 0, u.kv_bytes_per_token, 0, u.kv_window) for u in m.units),
                           context_tokens=tokens, runtime_overhead_bytes=0)
    planned = profile.stage_bytes(0, len(m.units), 1)
    planned_full = tokens * sum(u.kv_bytes_per_token for u in m.units)
    lines = [
        f"# KV per sequence, sliding-window layers trimmed vs kept whole ({m.name})",
        "",
        f"{run.finish().line()}; "
        f"`python benchmarks/window_kv.py {args.package} {tokens}`; windows {sorted(set(m.config['layer_windows']))}, "
        f"{sum(1 for w in m.config['layer_windows'] if w)} of {m.config['n_layers']} layers windowed.",
        "",
        "| at position | live KV (a move sends) | pool allocation (KV rows) | planner's figure |",
        "|---|---|---|---|",
        f"| trimmed, {trimmed['length']} | {trimmed['live'] / MiB:.2f} MiB | {trimmed['pool'] / MiB:.2f} MiB ({trimmed['rows']} row{'s' if trimmed['rows'] > 1 else ''}) | {planned / MiB:.2f} MiB |",
        f"| whole, {full['length']} | {full['live'] / MiB:.2f} MiB | {full['pool'] / MiB:.2f} MiB ({full['rows']} row{'s' if full['rows'] > 1 else ''}) | {planned_full / MiB:.2f} MiB |",
        "",
    ]
    write_results("window_kv", None, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
