"""Hold under load: 64 concurrent streaming clients for 60 s against 3 budgeted workers.

Every stream is greedy with a known prompt and length, so its text must equal the text the
single-process reference produces: any lost or repeated token shows as a mismatch. The only
acceptable error is 429 (admission control). Worker memory (RSS) is checked against the
declared budget (EMULATION: --memory is a hard budget for weights + KV).

    python benchmarks/soak.py [--clients 64] [--seconds 60] [--memory 700MB]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time

import httpx
import psutil

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.emulate.slowdown import parse_bytes
from edgepipe.model.store import resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

PROMPTS = ["Name a bird.", "What is rain?", "Say something kind.", "Count to five.", "What is a cat?", "Describe the sun."]
LENGTHS = [16, 32, 48]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--memory", default="700MB")
    ap.add_argument("--max-active", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=24)
    args = ap.parse_args()
    home = bench_home()
    pkg = resolve("smollm2", "int4", home)
    tok = pkg.tokenizer
    reference = {}
    for p in PROMPTS:
        ids = tok.encode(tok.format_chat([{"role": "user", "content": p}]))
        full = generate(pkg.pipeline(batch_invariant=True), ids, GenerationParams(max_tokens=max(LENGTHS), ignore_eos=True), tok.decode, ()).tokens
        for n in LENGTHS:
            reference[(p, n)] = tok.decode(full[:n])
    counts = {"ok": 0, "429": 0, "error": 0, "mismatch": 0, "tokens": 0}
    errors: list[str] = []
    lock = threading.Lock()
    budget = parse_bytes(args.memory)
    run = Conditions.start()
    with Server(home, workers=3, args=("--precision", "int4", "--placement", "memory", "--worker-threads", "1", "--max-active", str(args.max_active),
                                       "--max-queue", str(args.max_queue), "--worker-args", f"--memory {args.memory}", "--batch-invariant")) as server:
        pids = [w["pid"] for w in server.status()["workers"]]
        peak_rss = {pid: 0 for pid in pids}
        deadline = time.monotonic() + args.seconds

        def client(i: int) -> None:
            rng = random.Random(i)
            with httpx.Client(base_url=server.url, timeout=300) as c:
                while time.monotonic() < deadline:
                    p, n = rng.choice(PROMPTS), rng.choice(LENGTHS)
                    body = {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
                    try:
                        with c.stream("POST", "/v1/chat/completions", json=body) as r:
                            if r.status_code == 429:
                                with lock:
                                    counts["429"] += 1
                                time.sleep(float(r.headers.get("retry-after", "1")) * rng.random())
                                continue
                            text, bad = [], None
                            for line in r.iter_lines():
                                if line.startswith("data: {"):
                                    chunk = json.loads(line[6:])
                                    if "error" in chunk:
                                        bad = chunk["error"]["message"]
                                    for ch in chunk.get("choices", []):
                                        text.append(ch["delta"].get("content") or "")
                        with lock:
                            if r.status_code != 200 or bad:
                                counts["error"] += 1
                                errors.append(bad or f"HTTP {r.status_code}")
                            elif "".join(text) != reference[(p, n)]:
                                counts["mismatch"] += 1
                            else:
                                counts["ok"] += 1
                                counts["tokens"] += n
                    except httpx.HTTPError as exc:
                        with lock:
                            counts["error"] += 1
                            errors.append(repr(exc))

        def watch() -> None:
            while time.monotonic() < deadline + 30:
                for pid in pids:
                    try:
                        peak_rss[pid] = max(peak_rss[pid], psutil.Process(pid).memory_info().rss)
                    except psutil.Error:
                        pass
                time.sleep(0.5)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        status = server.status()
    row = {**counts, "clients": args.clients, "seconds": round(wall, 1), "tokens_per_s": counts["tokens"] / wall,
           "peak_worker_rss_mb": {str(k): round(v / 1e6, 1) for k, v in peak_rss.items()}, "budget_mb": budget / 1e6,
           "kv_after_mb": [round((w["stats"] or {}).get("kv_bytes", 0) / 1e6, 1) for w in status["workers"]],
           "errors_sample": errors[:5]}
    head = (f"{run.finish().line()} · SmolLM2-135M int4 · 3 workers, --memory {args.memory} each (EMULATION: "
            f"hard budget) · max-active {args.max_active}, queue {args.max_queue} · {args.clients} streaming clients for {args.seconds:.0f} s")
    text = "\n".join([head, "", "| completed | 429 | other errors | lost/repeated (mismatch) | tokens/s | peak worker RSS MB (budget) |",
                      "|---|---|---|---|---|---|",
                      f"| {counts['ok']} | {counts['429']} | {counts['error']} | {counts['mismatch']} | {row['tokens_per_s']:.1f} | "
                      f"{', '.join(f'{v:.0f}' for v in row['peak_worker_rss_mb'].values())} ({budget / 1e6:.0f}) |"])
    print(text)
    write_results("soak", {"conditions": head, **run.as_dict(), **row}, text)
    if counts["error"] or counts["mismatch"] or max(peak_rss.values()) > budget:
        sys.exit(1)


if __name__ == "__main__":
    main()
