"""A browser tab's stage next to a native worker's, on the same units, in one run.

Part 1 (probe): an in-process coordinator serves ``/worker`` to a headless-chromium tab
(onnxruntime-web, WebAssembly) and also accepts a native worker process (onnxruntime, CPU).
Both load the same unit ranges and time decode steps with the protocol's ``probe`` (what
calibration uses: one prefill of ``--context`` positions, then single-position steps, each
timed inside the worker). Ranges: 1 layer and 8 layers (giving per-layer time and the fixed
per-call overhead, fitted as ``t = overhead + n * per_layer``) and the 8-unit tail (7 layers +
head with in-graph sampling) that the tests put in the tab. Precisions: the tab runs fp32 (what
the coordinator gives browsers); its int4 (MatMulNBits) time is shown for contrast; the native
worker runs int4 (the package default) and fp32; a second tab runs fp32 with two WebAssembly
threads (the page is cross-origin isolated, so onnxruntime-web may use them). Rounds alternate
between the configurations so the machine's noise hits each alike.

Part 2 (pipeline): ``edgepipe serve`` with a native worker on units [0, 24) and either the tab
(fp32) or a second native worker (int4) on [24, 32): greedy decode tokens/s, time per output
token, and the part of it not spent computing (hops, relay through the coordinator, framing).

    python benchmarks/browser_stage.py [--rounds 3] [--reps 20] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from edgepipe.api import browser_routes
from edgepipe.api.app import create_app
from edgepipe.bench.browser import browser_context
from edgepipe.bench.client import stream_once
from edgepipe.bench.cluster import Server
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.cluster.shells.coordinator import Coordinator, CoordinatorSettings
from edgepipe.model.importer import add_variant
from edgepipe.model.store import resolve
from edgepipe.net.protocol import Message, MessageType as T
from edgepipe.serve import bind_socket

ORT_WEB = "1.30.0"  # scripts/vendor_js.sh
RANGES = {"1 layer": (1, 2), "8 layers": (1, 9), "tail: 7 layers + head": (24, 32)}
CONFIGS = [  # (device, precision, ranges)
    ("native", "int4", list(RANGES)),
    ("native", "fp32", list(RANGES)),
    ("browser", "fp32", list(RANGES)),
    ("browser", "int4", ["1 layer", "8 layers"]),  # MatMulNBits in WebAssembly: why browsers get fp32
    ("browser-2t", "fp32", list(RANGES)),  # a second tab with two WebAssembly threads
]
TABS = {"browser": ("tab", 1), "browser-2t": ("tab2", 2)}  # device -> (worker name, onnxruntime-web threads)


# -- part 1: probes through an in-process coordinator ----------------------------------------------
class ProbeHost:
    """A coordinator that never plans: it only loads unit ranges on workers and probes them."""

    def __init__(self, pkg):
        self.pkg = pkg
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.coord = Coordinator(pkg, CoordinatorSettings(min_workers=1_000_000, calibrate=False, load_timeout_s=600))
        app = create_app(self.coord, pkg)
        if not any(getattr(r, "path", None) == "/worker" for r in app.routes):  # until create_app mounts them itself
            app.router.routes.extend(e.route() for e in browser_routes.routes)
        import uvicorn

        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=1 << 30, ws_ping_interval=None))
        self.call(self.coord.start())
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[sock]), self.loop)
        self.ids = itertools.count(1)

    def call(self, coro, timeout: float = 900):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def worker(self, name: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [w for w in list(self.coord.workers.values()) if w.hello.get("name") == name]
            if found:
                return found[0]
            time.sleep(0.2)
        raise TimeoutError(f"no worker {name!r} joined")

    async def _load(self, w, plan: int, start: int, end: int, precision: str) -> dict:
        m = self.coord.manifest
        fut = w.loads[plan] = asyncio.get_running_loop().create_future()
        await w.send(Message(T.LOAD, {
            "plan": plan, "start": start, "end": end, "keep": [], "next": {"kind": "coordinator"}, "max_context": m.max_context,
            "graph": self.pkg.stage_graph(start, end, precision), "files": list(m.stage_files(start, end, precision)),
            "kv_bytes_per_token": sum(u.kv_bytes_per_token for u in m.units[start:end])}))
        return await asyncio.wait_for(fut, 600)

    async def _probe(self, w, plan: int, reps: int, context: int) -> list[float]:
        probe = next(self.ids)
        fut = w.probes[probe] = asyncio.get_running_loop().create_future()
        await w.send(Message(T.PROBE, {"probe": probe, "plan": plan, "reps": reps, "context": context}))
        reply = await asyncio.wait_for(fut, 600)
        if not reply.get("ok"):
            raise RuntimeError(f"probe of plan {plan} on {w.id} failed: {reply.get('error')}")
        return list(reply["times"])

    def load(self, w, plan, start, end, precision) -> dict:
        result = self.call(self._load(w, plan, start, end, precision))
        if not result.get("ok"):
            raise RuntimeError(f"{w.id} could not load [{start}, {end}) {precision}: {result.get('error')}")
        return result

    def probe(self, w, plan, reps, context) -> list[float]:
        return self.call(self._probe(w, plan, reps, context))

    def close(self) -> None:
        self.call(self.coord.stop())
        self.server.should_exit = True
        try:
            self.serving.result(10)
        except Exception:  # noqa: BLE001 - shutting down
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_probes(pkg, home: Path, args) -> dict:
    host = ProbeHost(pkg)
    env = {**os.environ, "EDGEPIPE_HOME": str(home)}
    native = subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", host.url, "--name", "native",
                               "--threads", str(args.threads)], env=env, stdin=subprocess.DEVNULL)
    try:
        with browser_context() as context:
            for name, threads in TABS.values():
                page = context.new_page()
                page.goto(f"{host.url}/worker?name={name}&threads={threads}")
                page.wait_for_selector("body[data-state='joined']", timeout=60000)
            browser_version = context.browser.version if context.browser else page.evaluate("navigator.userAgent")
            isolated = page.evaluate("crossOriginIsolated")
            workers = {"native": host.worker("native"), **{device: host.worker(name) for device, (name, _) in TABS.items()}}
            plans, loads = {}, {}
            for device, precision, ranges in CONFIGS:
                for name in ranges:
                    plan = next(host.ids)
                    start, end = RANGES[name]
                    loads[(device, precision, name)] = host.load(workers[device], plan, start, end, precision)
                    plans[(device, precision, name)] = plan
            samples = {key: [] for key in plans}
            for _ in range(args.rounds):
                for key, plan in plans.items():
                    reps = args.reps if not (key[0] == "browser" and key[1] == "int4") else max(4, args.reps // 4)
                    samples[key] += host.probe(workers[key[0]], plan, reps + 2, args.context)[2:]  # drop warm-up steps
    finally:
        native.terminate()
        native.wait(timeout=15)
        host.close()
    rows = []
    for device, precision, ranges in CONFIGS:
        med = {n: statistics.median(samples[(device, precision, n)]) for n in ranges}
        per_layer = (med["8 layers"] - med["1 layer"]) / 7
        row = {"device": "browser" if device in TABS else device, "engine": f"onnxruntime-web {ORT_WEB} wasm" if device in TABS else "onnxruntime (CPU)",
               "precision": precision, "threads": TABS[device][1] if device in TABS else args.threads,
               "per_layer_ms": round(per_layer * 1e3, 3), "overhead_ms": round((med["1 layer"] - per_layer) * 1e3, 3)}
        for n in ranges:
            row[f"{n} median_ms"] = round(med[n] * 1e3, 3)
            row[f"{n} min_ms"] = round(min(samples[(device, precision, n)]) * 1e3, 3)
            row[f"{n} load_s"] = round(loads[(device, precision, n)].get("load_s", 0.0), 3)
        if "tail: 7 layers + head" in ranges:
            row["tail steps/s"] = round(1 / med["tail: 7 layers + head"], 1)
        rows.append(row)
    return {"rows": rows, "browser": browser_version, "cross_origin_isolated": isolated,
            "samples_per_cell": {f"{k[0]} {k[1]} {k[2]}": len(v) for k, v in samples.items()}}


# -- part 2: the tab in a real pipeline --------------------------------------------------------------


def stage_compute(metrics: str) -> dict[str, tuple[float, float]]:
    """worker -> (sum of compute seconds, calls) from /metrics."""
    out: dict[str, list[float]] = {}
    for line in metrics.splitlines():
        m = re.match(r'edgepipe_stage_compute_seconds_(sum|count)\{worker="([^"]+)"\} (\S+)', line)
        if m:
            out.setdefault(m.group(2), [0.0, 0.0])[0 if m.group(1) == "sum" else 1] = float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


def start_pipeline(home: Path, tail: str, context, args):
    server = Server(home, workers=0, args=("--precision", "int4", "--placement", "memory", "--min-workers", "2", "--max-active", "1"), wait_up=False)
    procs = [server.worker("--name", "head", "--memory", "3GB", "--threads", str(args.threads))]
    server.wait_for(lambda s: len(s["workers"]) == 1, 60)
    page = None
    if tail == "browser":
        page = context.new_page()
        page.goto(f"{server.url}/worker?memory=1GB&name=tab&threads={args.browser_threads}")
    else:
        procs.append(server.worker("--name", "tail", "--memory", "1GB", "--threads", str(args.threads)))
    status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2, 300)
    stages = [(s["start"], s["end"]) for s in status["plan"]["stages"]]
    if stages != [(0, 24), (24, 32)]:
        raise RuntimeError(f"unexpected split {stages}")
    return server, procs, page


def run_pipelines(home: Path, args) -> list[dict]:
    setups = {"native int4 [0,24) + tab fp32 [24,32)": "browser", "native int4 [0,24) + native int4 [24,32)": "native"}
    running = {}
    with browser_context() as context:
        try:
            for label, tail in setups.items():
                running[label] = start_pipeline(home, tail, context, args)
            clients = {label: httpx.Client(base_url=r[0].url, timeout=300) for label, r in running.items()}
            for label in setups:
                stream_once(clients[label], 8)  # warm-up
            before = {label: stage_compute(clients[label].get("/metrics").text) for label in setups}
            samples = {label: [] for label in setups}
            for _ in range(args.rounds):
                for label in setups:
                    samples[label].append(stream_once(clients[label], args.tokens))
            after = {label: stage_compute(clients[label].get("/metrics").text) for label in setups}
            rows = []
            for label in setups:
                ttft = statistics.median(s[0] for s in samples[label])
                tpot = statistics.median(s[1] / max(s[2] - 1, 1) for s in samples[label])
                compute = {w: (after[label][w][0] - before[label].get(w, (0, 0))[0]) / max(after[label][w][1] - before[label].get(w, (0, 0))[1], 1)
                           for w in after[label]}
                rows.append({"pipeline": label, "decode_tok_s": round(1 / tpot, 2), "tpot_ms": round(tpot * 1e3, 2), "ttft_ms": round(ttft * 1e3, 1),
                             "stage_compute_ms": {w: round(v * 1e3, 2) for w, v in sorted(compute.items())},
                             "not_compute_ms": round((tpot - sum(compute.values())) * 1e3, 2)})
            return rows
        finally:
            for server, procs, page in running.values():
                for p in procs:
                    p.terminate()
                server.close()
                for p in procs:
                    try:
                        p.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        p.kill()


# -- report ---------------------------------------------------------------------------------------------
def write(result: dict) -> None:
    a = result["args"]
    lines = [f"{Conditions.from_dict(result).line()} · SmolLM2-135M · {result['browser']} headless · "
             f"cross-origin isolated: {result['cross_origin_isolated']}", "",
             "## Per decode step, same units (protocol `probe`: compute inside the worker, context "
             f"{a['context']}, {a['rounds']} interleaved rounds)", "",
             "| device | engine | weights | threads | 1 layer ms | 8 layers ms | tail (7 layers + head) ms | per layer ms | per-call overhead ms | tail steps/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["probe"]["rows"]:
        tail = r.get("tail: 7 layers + head median_ms")
        lines.append(f"| {r['device']} | {r['engine']} | {r['precision']} | {r['threads']} | {r['1 layer median_ms']} | {r['8 layers median_ms']} | "
                     f"{tail if tail is not None else '–'} | {r['per_layer_ms']} | {r['overhead_ms']} | {r.get('tail steps/s', '–')} |")
    lines += ["", f"## In a pipeline (`edgepipe serve`, greedy, {a['tokens']} tokens, {a['rounds']} interleaved rounds, medians; "
              f"native workers {a['threads']} thread(s), tab {a['browser_threads']})", "",
              "| pipeline | decode tok/s | TPOT ms | TTFT ms | stage compute ms/call | not compute ms/token |", "|---|---|---|---|---|---|"]
    for r in result["pipeline"]:
        compute = ", ".join(f"{w} {v}" for w, v in r["stage_compute_ms"].items())
        lines.append(f"| {r['pipeline']} | {r['decode_tok_s']} | {r['tpot_ms']} | {r['ttft_ms']} | {compute} | {r['not_compute_ms']} |")
    lines += ["", "Medians; the machine's 2 cores are shared by the browser, the workers and the coordinator (and whatever else runs: "
              "see the load average), so absolute numbers move between runs: compare rows of one run. Per layer and per-call overhead "
              "come from the 1- and 8-layer medians (`t = overhead + n * per_layer`); one fp32 layer's 14 MB of weights stay in the CPU "
              "cache from step to step while eight layers' do not, so the fit can put the overhead below zero. "
              "`not compute` = TPOT minus the mean compute per call of each stage (prefill calls included): hops, the coordinator relay "
              "a tab needs, and framing. Minimums and sample counts are in browser_stage.json.", ""]
    write_results("browser_stage", result, "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="timed decode steps per probe")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="native worker threads")
    ap.add_argument("--browser-threads", type=int, default=1, help="onnxruntime-web threads of the tab in the pipeline part")
    ap.add_argument("--skip-pipeline", action="store_true")
    args = ap.parse_args()
    home = Path(os.environ.get("EDGEPIPE_HOME") or tempfile.mkdtemp(prefix="edgepipe-bench-"))
    os.environ["EDGEPIPE_HOME"] = str(home)  # worker processes keep their unit cache there
    pkg = resolve("smollm2", "int4", home)
    add_variant(pkg.root, "fp32")
    pkg.reload()
    run = Conditions.start()
    probe = run_probes(pkg, home, args)
    pipeline = [] if args.skip_pipeline else run_pipelines(home, args)
    write({**run.finish().as_dict(),
           "browser": f"chromium {probe['browser']}", "cross_origin_isolated": probe["cross_origin_isolated"],
           "onnxruntime_web": ORT_WEB, "args": vars(args), "probe": probe, "pipeline": pipeline})


if __name__ == "__main__":
    main()
