"""Stalls on a 2-core machine: does failure detection survive them, does the cluster stay Up?

Two measurements, both with the real Qwen2.5-Coder 0.5B (import it first, the package goes
under $EDGEPIPE_HOME: ``edgepipe import $(scripts/fetch_qwen05.sh)``):

1. ``pong``: one real worker process (2 ORT threads) joins a minimal coordinator written here
   that pings it every 20 ms, while two CPU hogs keep both cores busy. The worker builds the
   whole model as one session (LOAD) and then runs a 512-token prefill (FORWARD); every
   PING -> PONG round trip is recorded, so the worst delay seen during the build, the prefill
   and idle is what a coordinator would have seen.
2. ``serve``: ``edgepipe serve --workers 3 --worker-threads 2`` with that model, then steady
   requests for ``--minutes`` (default 5) from 2 clients; records requests completed, errors,
   the cluster's events (workers suspected / lost / rejoined / restarted, plans), whether it was
   Up at the end, and the load average.

    python benchmarks/stall.py [--minutes 5] [--model NAME] [--only pong|serve]
    # results to benchmarks/results/stall.md|json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from edgepipe.bench.cluster import Server, free_port
from edgepipe.bench.machine import Conditions, load_average, load_text
from edgepipe.bench.results import read_results, write_results
from edgepipe.model.store import list_packages
from edgepipe.net.protocol import Message, MessageType as T, decode, encode

PING_EVERY_S = 0.02


def find_package(name: str | None):
    pkgs = [p for p in list_packages(None) if (name or "qwen2-5-coder-0-5b") in p.manifest.name]
    if not pkgs:
        sys.exit(f"no imported package matching {name or 'qwen2-5-coder-0-5b'} under $EDGEPIPE_HOME; run edgepipe import first")
    return pkgs[0]


def hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


# -- 1. PONG delay while a session builds and a prefill runs ---------------------------------------
async def pong_under_build(pkg, threads: int, busy: int, home: Path) -> dict:
    import websockets

    cache = home / "worker-cache"
    cache.mkdir(parents=True, exist_ok=True)
    n = len(pkg.manifest.units)
    graph = pkg.stage_graph(0, n)
    files = list(pkg.manifest.stage_files(0, n))
    for sha in [graph, *files]:  # the files are already on the device: only the build is timed
        if not (cache / sha).exists():
            os.link(pkg.blob(sha), cache / sha)
    rtts: list[tuple[float, float]] = []  # (sent at, round trip)
    phases: dict[str, float] = {}
    done = asyncio.Event()

    async def handler(ws):
        hello = decode(await ws.recv())
        assert hello.type is T.HELLO
        await ws.send(encode(Message(T.WELCOME, {"worker_id": "w1-bench"})))
        t0 = time.monotonic()

        async def pinger():
            while not done.is_set():
                await ws.send(encode(Message(T.PING, {"t": time.monotonic()})))
                await asyncio.sleep(PING_EVERY_S)

        async def script():
            await asyncio.sleep(3.0)
            phases["build_start"] = time.monotonic()
            await ws.send(encode(Message(T.LOAD, {
                "plan": 1, "start": 0, "end": n, "keep": [1], "graph": graph, "files": files, "next": {"kind": "coordinator"},
                "max_context": pkg.manifest.max_context, "kv_bytes_per_token": sum(u.kv_bytes_per_token for u in pkg.manifest.units)})))
            await loaded.wait()
            phases["build_end"] = phases["prefill_start"] = time.monotonic()
            ids = np.random.default_rng(0).integers(0, 1000, (1, 512)).astype(np.int64)
            sampling = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0}
            await ws.send(encode(Message(T.FORWARD, {"plan": 1, "batch": [{"seq": "s", "step": 0, "rid": "r", "sampling": sampling}]},
                                         {"x": ids})))
            await token.wait()
            phases["prefill_end"] = time.monotonic()
            await asyncio.sleep(2.0)
            done.set()

        loaded, token = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(pinger()), asyncio.create_task(script())]
        while not done.is_set():
            try:
                msg = decode(await asyncio.wait_for(ws.recv(), timeout=0.5))
            except asyncio.TimeoutError:
                continue
            now = time.monotonic()
            if msg.type is T.PONG:
                rtts.append((msg["t"] - t0, now - msg["t"]))
            elif msg.type is T.LOADED:
                phases["load_reply"] = dict(msg.fields)
                loaded.set()
            elif msg.type is T.TOKEN:
                token.set()
            elif msg.type is T.ERROR:
                raise RuntimeError(msg.get("message"))
        for t in tasks:
            t.cancel()
        phases["t0"] = t0
        await ws.send(encode(Message(T.BYE, {"final": True})))

    port = free_port()
    server = await websockets.serve(handler, "127.0.0.1", port, max_size=None, ping_interval=None)
    # the route the worker connects to is /v1/worker: websockets.serve accepts any path
    busy_procs = hogs(busy)
    env = {**os.environ, "EDGEPIPE_HOME": str(home)}
    worker = subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", f"http://127.0.0.1:{port}", "--name", "bench",
                               "--threads", str(threads)], env=env, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await asyncio.wait_for(done.wait(), timeout=600)
        await asyncio.sleep(0.5)
    finally:
        stop([worker, *busy_procs])
        server.close()
    t0 = phases["t0"]

    def window(a: float, b: float) -> dict:
        xs = [rtt for sent, rtt in rtts if a - t0 <= sent < b - t0]
        return {"pongs": len(xs), "max_ms": round(max(xs) * 1e3, 1) if xs else None,
                "p99_ms": round(float(np.percentile(xs, 99)) * 1e3, 1) if xs else None,
                "median_ms": round(statistics.median(xs) * 1e3, 1) if xs else None, "seconds": round(b - a, 2)}

    return {"threads": threads, "busy_hogs": busy, "ping_every_ms": PING_EVERY_S * 1e3, "model": pkg.manifest.name, "units": n,
            "idle": window(t0 + 0.5, phases["build_start"]), "build": window(phases["build_start"], phases["build_end"]),
            "prefill_512": window(phases["prefill_start"], phases["prefill_end"]),
            "load_reply": {k: v for k, v in phases["load_reply"].items() if k in ("ok", "load_s", "error")}}


# -- 2. serve --workers 3 --worker-threads 2 under steady requests ---------------------------------
def serve_stress(pkg, minutes: float, clients: int, max_tokens: int, home: Path) -> dict:
    t_start = time.monotonic()
    server = Server(home, workers=3, args=("--model", str(pkg.root), "--worker-threads", "2"), wait_up=False, timeout=600,
                    log=Path(os.environ.get("TMPDIR", "/tmp")) / "edgepipe-stall-serve.log")  # not in the repo: it grows
    url = server.url
    try:
        server.wait_for(lambda s: s["state"] == "up", 600)
        up_after = time.monotonic() - t_start
        stats = {"ok": 0, "errors": [], "latencies": [], "tokens": 0}
        lock = threading.Lock()
        states: list[tuple[float, str]] = []
        loads: list[list[float]] = []
        end = time.monotonic() + minutes * 60

        def client(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"Write a Python function number {i} that adds two numbers."}],
                    "max_tokens": max_tokens, "temperature": 0}
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=180)
                    with lock:
                        if r.status_code == 200:
                            stats["ok"] += 1
                            stats["tokens"] += r.json()["usage"]["completion_tokens"]
                            stats["latencies"].append(time.monotonic() - t0)
                        else:
                            stats["errors"].append(f"{r.status_code}: {r.text[:160]}")
                except httpx.HTTPError as exc:
                    with lock:
                        stats["errors"].append(f"{type(exc).__name__}: {exc}"[:160])
                    time.sleep(1.0)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        while time.monotonic() < end:
            try:
                states.append((round(time.monotonic() - t_start, 1), httpx.get(url + "/v1/cluster/status", timeout=10).json()["state"]))
            except (httpx.HTTPError, ValueError) as exc:
                states.append((round(time.monotonic() - t_start, 1), f"unreachable: {type(exc).__name__}"))
            loads.append(load_average())
            time.sleep(5)
        for t in threads:
            t.join(timeout=200)
        events = httpx.get(url + "/v1/cluster/events", timeout=10).json()["events"]
        final = httpx.get(url + "/v1/cluster/status", timeout=10).json()
    finally:
        server.close()
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    notable = [{k: v for k, v in e.items() if k in ("t", "kind", "worker", "why", "silent_s", "plan", "name", "error", "old_pid", "seconds")}
               for e in events if e["kind"] in ("suspect", "unsuspect", "leave", "join", "worker_restarted", "plan_failed", "up",
                                                "calibration_failed")]
    lat = stats["latencies"]
    return {"minutes": minutes, "clients": clients, "max_tokens": max_tokens, "up_after_s": round(up_after, 1),
            "requests_ok": stats["ok"], "errors": len(stats["errors"]), "error_samples": stats["errors"][:5],
            "completion_tokens": stats["tokens"], "latency_median_s": round(statistics.median(lat), 2) if lat else None,
            "latency_max_s": round(max(lat), 2) if lat else None,
            "up_share": round(sum(1 for _, s in states if s == "up") / max(1, len(states)), 3), "state_samples": len(states),
            "not_up": [s for s in states if s[1] != "up"][:20], "final_state": final["state"], "final_workers": len(final["workers"]),
            "event_counts": kinds, "notable_events": notable[-40:],
            "loadavg_max_1min": max((l[0] for l in loads), default=None), "loadavg_mean_1min": round(statistics.mean(l[0] for l in loads), 2) if loads else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--model", default=None, help="package name (substring); default the imported Qwen2.5-Coder 0.5B")
    ap.add_argument("--only", choices=["pong", "serve"], default=None)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    pkg = find_package(args.model)
    home = Path(os.environ.get("EDGEPIPE_HOME", "/tmp/edgepipe-stall"))
    run = Conditions.start()
    out = {**run.as_dict(), "model": pkg.manifest.name}
    previous = read_results("stall")
    if args.only and previous:
        out = {**previous, **out}
    if args.only in (None, "pong"):
        out["pong"] = asyncio.run(pong_under_build(pkg, threads=2, busy=2, home=Path(f"/tmp/edgepipe-stall-{os.getpid()}")))
        out["loadavg_after_pong"] = load_text(load_average())
    if args.only in (None, "serve"):
        out["serve"] = serve_stress(pkg, args.minutes, args.clients, args.max_tokens, home)
        out["loadavg_after_serve"] = load_text(load_average())
    out.update(run.finish().as_dict())
    write_results("stall", out, render(out))
    print(render(out))


def render(r: dict) -> str:
    lines = [f"# Stalls ({r['model']})", "", Conditions.from_dict(r).line(), ""]
    if "pong" in r:
        p = r["pong"]
        lines += ["## PING -> PONG while a worker builds the whole model and runs a prefill", "",
                  f"One worker process, {p['threads']} ORT threads, {p['busy_hogs']} CPU hogs busy on the same cores, a PING every "
                  f"{p['ping_every_ms']:.0f} ms; session build {p['load_reply']}.", "",
                  "| phase | seconds | pongs | median ms | p99 ms | worst ms |", "|---|---|---|---|---|---|"]
        for phase in ("idle", "build", "prefill_512"):
            w = p[phase]
            lines.append(f"| {phase} | {w['seconds']} | {w['pongs']} | {w['median_ms']} | {w['p99_ms']} | {w['max_ms']} |")
        lines += ["", f"load average after: {r.get('loadavg_after_pong')}", ""]
    if "serve" in r:
        s = r["serve"]
        lines += ["## serve --workers 3 --worker-threads 2 under steady requests", "",
                  f"{s['minutes']} min, {s['clients']} clients x {s['max_tokens']} tokens (greedy), Up after {s['up_after_s']} s.", "",
                  f"- requests completed: {s['requests_ok']} ({s['completion_tokens']} tokens), errors: {s['errors']} {s['error_samples']}",
                  f"- latency median {s['latency_median_s']} s, worst {s['latency_max_s']} s",
                  f"- status sampled every 5 s: Up in {s['up_share'] * 100:.1f}% of {s['state_samples']} samples; not Up: {s['not_up']}",
                  f"- at the end: {s['final_state']} with {s['final_workers']} workers",
                  f"- events: {s['event_counts']}",
                  f"- load average (1 min) mean {s['loadavg_mean_1min']}, max {s['loadavg_max_1min']}; after: {r.get('loadavg_after_serve')}",
                  "", "Notable events (last 40):", "", "```"]
        lines += [json.dumps(e) for e in s["notable_events"]]
        lines += ["```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
