"""Speculative decoding through a pipeline: one stream, 3 local workers, user-space link delay per hop.

Qwen2.5-Coder-1.5B-Instruct Q4_K_M as the target, Qwen2.5-Coder-0.5B-Instruct drafting for it in
the coordinator's process (``draft``) or on a drafter worker that holds no stage
(``draft-remote``: ``edgepipe worker --role drafter``, its frames delayed like the stages'), n-gram
self-drafting (prompt lookup), and both (``hybrid``: the lookup where it matches, the model
elsewhere), against the same cluster decoding one token per step; on a chat and a code-editing
workload, at 2 ms and 10 ms per hop. Draft lengths are timed (from the measured costs of a pass,
none where plain decoding is faster); ``draft-fixed`` and ``ngram-fixed`` are the same drafters
with lengths from the acceptance rate alone (``--draft-length acceptance``, as before the timed ones).
The delay is EMULATED (``--link-delay-ms``: every frame a worker sends waits that long in user
space; the coordinator's frame to the first stage is not delayed, so 3 of the 4 hops of a step
are). Each request is greedy; a mode's text must equal the baseline's (the verify form's decode
steps are the baseline's bits, see ``graphs.verify_form``), else the row says so.

    python benchmarks/speculative.py [--tokens 64] [--rounds 3] [--delays 2 10]
        [--modes plain draft draft-fixed draft-remote ngram ngram-fixed hybrid]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from edgepipe.bench.cluster import Server
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import home_dir

TARGET = "qwen2-5-coder-1-5b-instruct-q4_k_m-gguf"
DRAFT = "qwen2-5-coder-0-5b-instruct-gguf"

CODE = '''def summarize(orders):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if customer not in totals:
            totals[customer] = 0
        totals[customer] += amount
    best = None
    for customer, amount in totals.items():
        if best is None or amount > totals[best]:
            best = customer
    return totals, best


def report(orders):
    totals, best = summarize(orders)
    lines = []
    for customer in sorted(totals):
        lines.append(f"{customer}: {totals[customer]:.2f}")
    lines.append(f"best customer: {best}")
    return "\\n".join(lines)
'''
WORKLOADS = {
    "chat": "Explain in a few paragraphs how a hash table works and when it is a poor choice.",
    "code-edit": "Rename the variable `totals` to `spent_by_customer` everywhere in this Python code. "
                 f"Reply with the whole updated code only.\n\n```python\n{CODE}```",
}


def stream(url: str, prompt: str, tokens: int, sampling: dict | None = None) -> dict:
    """One chat stream (greedy, or ``sampling``: temperature, top_p, seed): time to first token,
    decode tokens/s (first to last token), text."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0, "stream": True, **(sampling or {})}
    pieces, times = [], []
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=900) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        pieces.append(text)
                        times.append(time.perf_counter())
    n = len(times)
    return {"ttft_s": times[0] - t0, "tokens": n, "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0,
            "wall_s": times[-1] - t0, "text": "".join(pieces)}


MODES = ["plain", "draft", "draft-fixed", "draft-remote", "ngram", "ngram-fixed", "hybrid"]


def start(home: Path, mode: str, delay_ms: float, args) -> Server:
    """The mode's cluster; ``draft-remote`` with a drafter worker, once it drafts (``server.drafter``: its process)."""
    base = mode.removesuffix("-fixed").removesuffix("-remote")
    drafter = {"ngram": "ngram", "draft": args.draft, "hybrid": f"ngram+{args.draft}"}.get(base)
    extra = () if mode == "plain" else ("--speculative", drafter, "--draft-k", str(args.draft_k), "--draft-threads", "1",
                                        "--draft-length", "acceptance" if mode.endswith("-fixed") else "timed",
                                        "--draft-on", "workers" if mode.endswith("-remote") else "coordinator")
    worker_args = f"--link-delay-ms {delay_ms:g} --threads {args.threads}"
    server = Server(home, workers=args.workers, timeout=900,
                    args=("--model", args.target, "--placement", "memory", "--worker-args", worker_args, *extra))
    server.drafter = None
    if mode.endswith("-remote"):
        server.drafter = server.worker("--role", "drafter", "--name", "drafter", "--threads", "1", "--link-delay-ms", f"{delay_ms:g}",
                                       log=Path(str(server.log) + ".drafter") if server.log else None)
        server.wait_for(lambda s: (s.get("speculation") or {}).get("site", "coordinator") != "coordinator", timeout=900)
    return server


def stop(server: Server) -> None:
    if getattr(server, "drafter", None) is not None and server.drafter.poll() is None:
        server.drafter.terminate()
        server.drafter.wait(timeout=30)
    server.close()


def one(server: Server, prompt: str, tokens: int, sampling: dict | None = None) -> dict:
    before = server.status().get("speculation") or {}
    result = stream(server.url, prompt, tokens, sampling)
    after = server.status().get("speculation") or {}
    result.update({key: after.get(key, 0) - before.get(key, 0) for key in ("passes", "drafted", "kept", "drafted_ahead", "by_rule")})
    result.update(costs_ms=after.get("costs_ms"), site=after.get("site"))  # what the timed draft length decided from, where it drafted
    return result


def run_delay(home: Path, delay_ms: float, args) -> dict:
    """All modes' clusters up at once; each round streams every workload on each in turn (each
    round starting with another mode), so a change in the machine's load falls on every mode
    alike. Medians over the rounds."""
    servers: dict[str, Server] = {}
    try:
        with ThreadPoolExecutor(len(args.modes)) as pool:  # the clusters start side by side
            for mode, server in zip(args.modes, pool.map(lambda m: start(home, m, delay_ms, args), args.modes)):
                servers[mode] = server
        for server in servers.values():
            stream(server.url, "Say hello.", 8)  # warm-up: sessions built, first frames sent
        runs: dict[str, dict[str, list[dict]]] = {mode: {name: [] for name in WORKLOADS} for mode in servers}
        for r in range(args.rounds):
            for name, prompt in WORKLOADS.items():
                order = list(servers)[r % len(servers):] + list(servers)[:r % len(servers)]
                for mode in order:
                    sampling = None if not args.temperature else {"temperature": args.temperature, "top_p": args.top_p, "seed": r}
                    result = one(servers[mode], prompt, args.tokens, sampling)
                    runs[mode][name].append(result)
                    print(f"{delay_ms:g} ms round {r} {mode:6s} {name:9s} {result['decode_tok_s']:6.2f} tok/s  tokens {result['tokens']}  "
                          f"kept {result['kept']}/{result['drafted']}  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for server in servers.values():
            stop(server)
    out = {}
    for mode, by_name in runs.items():
        out[mode] = {}
        for name, results in by_name.items():
            drafted, kept, passes, ahead = (sum(r[key] for r in results) for key in ("drafted", "kept", "passes", "drafted_ahead"))
            out[mode][name] = {"decode_tok_s": statistics.median(r["decode_tok_s"] for r in results),
                               "decode_tok_s_all": [round(r["decode_tok_s"], 3) for r in results],
                               "ttft_s": statistics.median(r["ttft_s"] for r in results), "tokens": results[0]["tokens"],
                               "passes": passes, "drafted": drafted, "kept": kept, "acceptance": kept / drafted if drafted else None,
                               "passes_drafted_ahead": ahead, "costs_ms": results[-1].get("costs_ms"),
                               "sites": sorted({r.get("site") or "-" for r in results}),
                               "texts": [r["text"] for r in results]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delays", type=float, nargs="+", default=[2.0, 10.0])
    p.add_argument("--modes", nargs="+", default=["plain", "draft", "draft-fixed", "ngram"], choices=MODES,
                   help="hybrid: prompt lookup where it matches, the draft model elsewhere (--speculative ngram+DRAFT); -fixed: draft "
                        "lengths from the acceptance rate alone; draft-remote: the draft model on a drafter worker (--role drafter)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads per worker")
    p.add_argument("--draft-k", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0, help="sampled streams (seed = round): by the speculative-sampling rule")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", default="speculative")
    args = p.parse_args()
    home = home_dir()
    run = Conditions.start()
    results = {delay: run_delay(home, delay, args) for delay in args.delays}
    run.finish()
    data = {**run.as_dict(), "args": vars(args), "results": {f"{d:g}": r for d, r in results.items()}}
    lines = [f"# Speculative decoding through {args.workers} stages", "",
             f"{run.line()}. Target {args.target}, draft {args.draft} (1 thread, in the coordinator's process or, draft-remote, "
             "on a drafter worker whose frames are delayed as the stages'), "
             f"{args.workers} local workers x {args.threads} thread, {args.tokens} tokens "
             f"{'greedy' if not args.temperature else f'sampled (temperature {args.temperature:g}, top-p {args.top_p:g}, seed = round)'}"
             ", one stream at a time; the modes' "
             f"clusters up side by side, {args.rounds} rounds each measuring every mode in turn, medians. Link delay per hop is "
             "EMULATED (user-space, worker-sent frames).", "",
             "| hop delay | workload | mode | decode tok/s (median) | x plain | acceptance | tokens/pass | TTFT s | text = plain | "
             "pass costs ms (step / position / draft step / draft call) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for delay, modes in results.items():
        for name in WORKLOADS:
            base = modes.get("plain", {}).get(name)
            for mode, out in modes.items():
                r = out[name]
                speedup = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base and base["decode_tok_s"] else "-"
                per_pass = f"{1 + r['kept'] / r['passes']:.2f}" if r["passes"] else "-"
                acceptance = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
                same = "-" if base is None or mode == "plain" or args.temperature else ("yes" if r["texts"] == base["texts"] else "NO")
                costs = r.get("costs_ms")
                costs = " / ".join(f"{costs[k]:.1f}" for k in ("step", "position", "draft_step", "draft_call")) if costs else "-"
                lines.append(f"| {delay:g} ms | {name} | {mode} | {r['decode_tok_s']:.2f} | {speedup} | {acceptance} | {per_pass} | "
                             f"{r['ttft_s']:.2f} | {same} | {costs} |")
    write_results(args.out, data, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
