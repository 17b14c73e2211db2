"""Aggregate tokens/s with 1, 2, 4, 8, 16 concurrent streams, on 1 and on 3 workers.

Runs twice in one go: "raw" (the workers as they are on this machine) and "emulated" (each
decode call of a worker lasts f x its CPU time, so most of a stage's time is emulated waiting,
as on slower devices: three real stages would otherwise share two cores, and CPU time rather
than wall time keeps that sharing out of the emulated duration).
All four servers are up at once and each concurrency level is measured on each in turn.

    python benchmarks/concurrency.py [--tokens 64] [--slowdown 8] [--levels 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results

PROMPTS = ["Tell me about rivers.", "Write a poem about stars.", "Explain gravity.", "Describe a forest.",
           "What is music?", "Tell me about the ocean.", "Describe a city at night.", "What are clouds?"]


def one_stream(url: str, i: int, tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    with httpx.Client(base_url=url, timeout=600) as c:
        r = c.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return len(r.json()["choices"][0]["token_ids"])


def aggregate(url: str, streams: int, tokens: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(lambda i: one_stream(url, i, tokens), range(streams)))
    return total / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slowdown", type=float, default=8.0)
    ap.add_argument("--levels", default="1,2,4,8,16")
    args = ap.parse_args()
    home = bench_home()
    run = Conditions.start()
    levels = [int(x) for x in args.levels.split(",")]
    configs = {
        ("raw", 1): ("--worker-threads", "2"),
        ("raw", 3): ("--placement", "memory", "--worker-threads", "1"),
        ("emulated", 1): ("--worker-threads", "1", "--worker-args", f"--slowdown {args.slowdown}"),
        ("emulated", 3): ("--placement", "memory", "--worker-threads", "1", "--worker-args", f"--slowdown {args.slowdown}"),
    }
    servers = {}
    try:
        for key, extra in configs.items():
            servers[key] = Server(home, workers=key[1], args=(*extra, "--max-active", str(max(levels)), "--max-queue", "64"))
        for s in servers.values():
            aggregate(s.url, 2, 8)  # warm-up
        results = {key: {} for key in configs}
        for level in levels:
            for key, s in servers.items():
                results[key][level] = aggregate(s.url, level, args.tokens)
                print(key, level, round(results[key][level], 1), flush=True)
    finally:
        for s in servers.values():
            s.close()
    report(results, levels, args, run.finish())


def report(results, levels, args, run: Conditions) -> None:
    head = (f"{run.line()} · SmolLM2-135M int4 · {args.tokens} tokens/stream greedy · "
            f"emulated = every worker slowed {args.slowdown}x (EMULATION: a decode call lasts f x its CPU time, so "
            f"sharing 2 cores is not multiplied) · loopback")
    lines = [head, "", "| mode | workers | " + " | ".join(f"{n} streams" for n in levels) + f" | best / 1 stream |",
             "|---|---|" + "---|" * len(levels) + "---|"]
    for (mode, workers), row in results.items():
        cells = " | ".join(f"{row[n]:.1f} ({row[n] / row[levels[0]]:.2f}x)" for n in levels)
        lines.append(f"| {mode} | {workers} | {cells} | {max(row.values()) / row[levels[0]]:.2f}x |")
    lines.append("")
    lines.append("Aggregate tokens/s (ratio to 1 stream on the same server). Decode steps travel in micro-batches (one lane per "
                 "stage); each stage runs a lane's frame as one batch.")
    text = "\n".join(lines)
    print(text)
    write_results("concurrency", {"conditions": head, **run.as_dict(),
                                  "results": {f"{m}-{w}": {str(k): v for k, v in r.items()} for (m, w), r in results.items()}}, text)


if __name__ == "__main__":
    main()
