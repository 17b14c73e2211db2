"""Pipeline cost: tokens/s and time per output token with 1, 2 and 3 workers on loopback.

All three servers run at once and requests alternate between them (A B C A B C ...), so the
machine's noise hits each configuration alike. Reports the ratio to 1 worker, the
coordinator's share of wall time (its process CPU time / wall time, and its per-step time
before a frame leaves), and activation bytes per decoded token per hop (from /metrics).

    python benchmarks/pipeline.py [--tokens 128] [--rounds 5] [--activation-dtype float16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

import psutil

from edgepipe.bench.client import stream_once
from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--threads", type=int, default=2, help="threads per worker (one sequence: one stage busy at a time)")
    ap.add_argument("--activation-dtype", default="float32")
    args = ap.parse_args()
    home = bench_home()
    run = Conditions.start()
    counts = [int(x) for x in args.workers.split(",")]
    servers = {n: Server(home, workers=n, args=("--placement", "memory", "--worker-threads", str(args.threads), "--max-active", "1",
                                                 "--worker-args", f"--activation-dtype {args.activation_dtype}")) for n in counts}
    try:
        clients = {n: httpx.Client(base_url=s.url, timeout=300) for n, s in servers.items()}
        procs = {n: psutil.Process(s.proc.pid) for n, s in servers.items()}
        for n in counts:  # warm-up
            stream_once(clients[n], 16)
        before = {n: clients[n].get("/metrics").text for n in counts}
        cpu0 = {n: sum(procs[n].cpu_times()[:2]) for n in counts}
        samples = {n: [] for n in counts}
        walls = {n: 0.0 for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                t = time.perf_counter()
                samples[n].append(stream_once(clients[n], args.tokens))
                walls[n] += time.perf_counter() - t
        rows = []
        for n in counts:
            after = clients[n].get("/metrics").text
            tokens = metric(after, "edgepipe_tokens_generated_total") - metric(before[n], "edgepipe_tokens_generated_total")
            hop_bytes = metric(after, "edgepipe_hop_bytes_total") - metric(before[n], "edgepipe_hop_bytes_total")
            coord_step = metric(after, "edgepipe_coordinator_seconds_total") - metric(before[n], "edgepipe_coordinator_seconds_total")
            cpu = sum(procs[n].cpu_times()[:2]) - cpu0[n]
            decode_tps = statistics.median((k - 1) / d for _, d, k in samples[n])
            rows.append({
                "workers": n, "decode_tokens_per_s": decode_tps,
                "tpot_ms": 1e3 / decode_tps, "ttft_ms": 1e3 * statistics.median(t for t, _, _ in samples[n]),
                "coordinator_cpu_share": cpu / walls[n], "coordinator_step_share": coord_step / walls[n],
                "bytes_per_token_per_hop": hop_bytes / tokens / max(n - 1, 1) if n > 1 else 0.0,
            })
        base = rows[0]["decode_tokens_per_s"]
        for r in rows:
            r["vs_1_worker"] = r["decode_tokens_per_s"] / base
        report(rows, args, run.finish())
    finally:
        for s in servers.values():
            s.close()


def report(rows: list[dict], args, run: Conditions) -> None:
    head = f"{run.line()} · SmolLM2-135M int4 · {args.tokens} tokens greedy · {args.rounds} rounds interleaved · " \
           f"{args.threads} threads/worker · activations {args.activation_dtype} · loopback"
    lines = [head, "", "| workers | decode tok/s | vs 1 worker | TPOT ms | TTFT ms | coordinator CPU / wall | coordinator per-step / wall | bytes/token/hop |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['decode_tokens_per_s']:.1f} | {r['vs_1_worker']:.3f} | {r['tpot_ms']:.2f} | {r['ttft_ms']:.1f} | "
                     f"{100 * r['coordinator_cpu_share']:.2f}% | {100 * r['coordinator_step_share']:.3f}% | {r['bytes_per_token_per_hop']:.0f} |")
    text = "\n".join(lines)
    print(text)
    write_results("pipeline", {"conditions": head, **run.as_dict(), "rows": rows}, text)


if __name__ == "__main__":
    main()
