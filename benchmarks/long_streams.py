"""Long streams while plans switch: every client gets exactly its solo tokens (issue 11).

``edgepipe serve --workers 3 --batch-invariant`` with the bundled model; ``--clients`` streaming clients (default
16, the default ``--max-active``) each ask for ``--tokens`` new tokens (default 1,800, EOS
ignored, greedy) over a few prompts. Meanwhile a switcher moves the layer boundaries every
``--switch-every`` seconds through ``/v1/cluster/rebalance`` (loopback: no admin token needed),
so every stream lives through several plan changes with its KV moved or rebuilt under it. Each
client's streamed text is compared with the single-process reference
(``edgepipe.runtime.local.generate``, same prompt, same length). Records completions, errors,
mismatches, plan switches (and how KV followed: moved / recomputed), workers lost, the time
taken and the load average.

    python benchmarks/long_streams.py [--clients 16] [--tokens 1800] [--switch-every 20]
    # results to benchmarks/results/long_streams.md|json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time

import httpx

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how a compiler works, step by step.",
           "Write a travel guide to the Alps.", "Describe the history of mathematics."]


def references(pkg, tokens: int) -> dict[str, str]:
    """Each prompt's single-process text, kept beside the package (keyed by its manifest: a
    re-import with another graph version computes them again)."""
    key = hashlib.sha256((pkg.root / "manifest.json").read_bytes()).hexdigest()[:16]
    cache = pkg.root / f"long_streams-references-{key}-{tokens}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    tok, out = pkg.tokenizer, {}
    for prompt in PROMPTS:
        ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
        t0 = time.monotonic()
        result = generate(pkg.pipeline(batch_invariant=True), ids, GenerationParams(max_tokens=tokens, ignore_eos=True), tok.decode, pkg.manifest.eos_ids)
        out[prompt] = tok.decode(result.tokens)
        print(f"reference {prompt[:30]!r}: {len(result.tokens)} tokens in {time.monotonic() - t0:.0f} s", flush=True)
    cache.write_text(json.dumps(out))
    return out


def stream(url: str, prompt: str, tokens: int) -> tuple[str, str | None, float]:
    t0 = time.monotonic()
    text, error = [], None
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(600, connect=30)) as c:
            with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                                                                "temperature": 0, "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    return "", f"HTTP {r.status_code}: {r.read()[:200]!r}", time.monotonic() - t0
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"].get("message", "error")
                        break
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return "".join(text), error, time.monotonic() - t0


def layouts(n_units: int, workers: list[str]) -> list[list[dict]]:
    """Two contiguous 3-stage layouts whose boundaries differ (every switch moves layers)."""
    third = n_units // 3
    out = []
    for shift in (-2, 2):
        a, b = third + shift, 2 * third - shift
        out.append([{"worker": workers[0], "start": 0, "end": a}, {"worker": workers[1], "start": a, "end": b},
                    {"worker": workers[2], "start": b, "end": n_units}])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1800)
    ap.add_argument("--switch-every", type=float, default=20.0)
    ap.add_argument("--out", default="long_streams")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: the server and workers end too
    home = bench_home()
    os.environ["EDGEPIPE_HOME"] = str(home)
    pkg = resolve("smollm2", "int4", home)
    run = Conditions.start()
    refs = references(pkg, args.tokens)
    results: list[dict] = []
    switches: list[dict] = []
    with Server(home, workers=3, args=("--precision", "int4", "--placement", "planner", "--max-active", str(args.clients), "--batch-invariant"), timeout=300) as server:
        status = server.status()
        workers = [s["worker"] for s in status["plan"]["stages"]]
        if len(workers) < 3:
            workers = [w["id"] for w in status["workers"]][:3]
        plans = layouts(status["n_units"], workers)
        done = threading.Event()

        def switcher() -> None:
            i = 0
            with httpx.Client(base_url=server.url, timeout=300) as c:
                while not done.wait(args.switch_every):
                    t0 = time.monotonic()
                    r = c.post("/v1/cluster/rebalance", json={"stages": plans[i % 2]})
                    switches.append({"status": r.status_code, "seconds": round(time.monotonic() - t0, 2),
                                     "body": r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text[:200]})
                    i += 1

        def client(k: int) -> None:
            prompt = PROMPTS[k % len(PROMPTS)]
            text, error, took = stream(server.url, prompt, args.tokens)
            results.append({"client": k, "prompt": prompt[:30], "ok": error is None, "error": error, "seconds": round(took, 1),
                            "chars": len(text), "equal": error is None and text == refs[prompt],
                            "first_difference": next((i for i, (x, y) in enumerate(zip(text, refs[prompt])) if x != y), None)})

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
        sw = threading.Thread(target=switcher, daemon=True)
        for t in threads:
            t.start()
        sw.start()
        for t in threads:
            t.join()
        done.set()
        wall = time.monotonic() - t0
        events = server.events()
        final = server.status()
    kinds = [e["kind"] for e in events]
    summary = {
        **run.finish().as_dict(), "model": pkg.manifest.name,
        "clients": args.clients, "tokens": args.tokens, "switch_every_s": args.switch_every,
        "wall_s": round(wall, 1), "completed": sum(r["ok"] for r in results), "equal_to_solo": sum(r["equal"] for r in results),
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "aggregate_tokens_per_s": round(sum(r["ok"] for r in results) * args.tokens / wall, 1),
        "switches_requested": len(switches), "switches_ok": sum(s["status"] == 200 for s in switches),
        "switch_seconds": [s["seconds"] for s in switches],
        "plans_up": kinds.count("up"),
        "kv_moved": sum(e.get("kv_moved") or 0 for e in events if e["kind"] == "up"),
        "kv_moved_mb": round(sum(e.get("kv_moved_bytes") or 0 for e in events if e["kind"] == "up") / 1e6, 1),
        "kv_recomputed": sum(e.get("kv_recomputed") or 0 for e in events if e["kind"] == "up"),
        "workers_lost": kinds.count("leave"), "suspected": kinds.count("suspect"), "final_state": final["state"],
        "event_kinds": {k: kinds.count(k) for k in sorted(set(kinds))},
        "clients_detail": sorted(results, key=lambda r: r["client"]),
    }
    lines = [f"# {args.clients} streams x {args.tokens} tokens through 3 workers while plans switch", "",
             f"{run.line()} · {summary['model']} · `serve --workers 3 --max-active {args.clients} --batch-invariant` · "
             f"greedy, EOS ignored · a layer-boundary switch requested every {args.switch_every:g} s",
             "", "| clients | completed | equal to solo (text) | errors | switches ok / requested | plans up | KV moved (sequences, MB) / rebuilt | workers lost | suspected | wall s | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| {args.clients} | {summary['completed']} | {summary['equal_to_solo']} | {len(results) - summary['completed']} | "
             f"{summary['switches_ok']} / {summary['switches_requested']} | {summary['plans_up']} | "
             f"{summary['kv_moved']}, {summary['kv_moved_mb']} / {summary['kv_recomputed']} | {summary['workers_lost']} | {summary['suspected']} | "
             f"{summary['wall_s']} | {summary['aggregate_tokens_per_s']} |", "",
             f"Events seen: {summary['event_kinds']}. Errors: {summary['errors'] or 'none'}."]
    write_results(args.out, {**summary, "switches": switches}, "\n".join(lines))
    print(json.dumps({k: v for k, v in summary.items() if k != "clients_detail"}, indent=1))


if __name__ == "__main__":
    main()
