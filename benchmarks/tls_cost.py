"""What TLS costs: decode tokens/s through 3 local workers, plain vs ``serve --tls``
(control, blobs and activations over https/wss), same greedy request, alternating runs.

    python benchmarks/tls_cost.py [--tokens 128] [--runs 5]     # results to benchmarks/results/tls.md|json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from edgepipe.bench.client import stream_once
from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import resolve


def start(home: Path, use_tls: bool, workers: int = 3) -> Server:
    """A 3-worker cluster, over TLS or not (a TLS fingerprint pinned in the environment is dropped)."""
    env = {k: v for k, v in os.environ.items() if k != "EDGEPIPE_TLS_FINGERPRINT"}
    return Server(home, workers=workers, args=("--precision", "int4", "--placement", "memory", *(["--tls"] if use_tls else [])), timeout=300, env=env,
                  client_timeout=300, log=Path(tempfile.mkdtemp(prefix="edgepipe-tls-")) / "serve.log")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    home = bench_home()
    resolve("smollm2", "int4", home)
    run = Conditions.start()
    out = {**run.as_dict(), "tokens": args.tokens, "runs": {"plain": [], "tls": []}}
    clusters = {}
    try:
        clusters["plain"] = start(home, False)
        clusters["tls"] = start(home, True)
        out["data_urls"] = {k: [w["data_url"] for w in c.status()["workers"]] for k, c in clusters.items()}
        for c in clusters.values():
            stream_once(c.client, 16)  # warm-up
        for _ in range(args.runs):
            for name, c in clusters.items():  # alternate, so load drifts hit both alike
                _, decode_s, n = stream_once(c.client, args.tokens)
                out["runs"][name].append(round((n - 1) / decode_s, 2))
    finally:
        for c in clusters.values():
            c.close()
    out.update(run.finish().as_dict())
    med = {k: statistics.median(v) for k, v in out["runs"].items()}
    out["median_tokens_per_s"] = med
    out["tls_cost_percent"] = round(100 * (med["plain"] - med["tls"]) / med["plain"], 1)
    markdown = (
        f"{run.line()} · SmolLM2-135M int4 · 3 local workers (both clusters running at once, runs alternating) · "
        f"{args.tokens} greedy tokens, {args.runs} runs\n\n"
        "| transport | decode tokens/s (median) | runs |\n|---|---|---|\n"
        f"| plain ws/http | {med['plain']:.1f} | {out['runs']['plain']} |\n"
        f"| TLS (https, wss control, wss activations) | {med['tls']:.1f} | {out['runs']['tls']} |\n\n"
        f"TLS costs {out['tls_cost_percent']}% of decode tokens/s here (noisy: shared 2-core machine, see load).\n")
    write_results("tls", out, markdown)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
