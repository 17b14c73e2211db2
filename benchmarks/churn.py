"""Availability under worker churn: a replay of seed 003's fault-tolerance experiment (section 6.5, table 6.8).

Per scenario: a coordinator (``edgepipe serve --workers 0 --min-workers 5``, planner placement)
and 5 workers that this script starts itself (``edgepipe worker --memory M --threads 1``, same
flags on every restart). The memory budget (EMULATION) decides how many workers the model needs:

- ``one``:   500MB per worker — any single worker holds the whole model (seed: Qwen3-0.6B, 1 of 10);
- ``three``: 170MB per worker — no worker holds it, the planner needs 3 stages (seed: Qwen3-1.7B, 3 of 10).

A churn driver SIGKILLs worker processes: each life is exponential with a hazard that ramps
linearly from 0 (never fails) at the start to 1 / ``--mttf-end`` (10 s) at the end of the run
(seed: "increasing the churn rate from 0 up to a target mean time to failure of 10 seconds").
With ``--fault freeze`` a worker is SIGSTOPped instead (a laptop whose lid closed, a device that
swaps) and SIGCONTed after the delay: the same process finds its channel gone and rejoins by
itself, with its blob cache and calibration. ``--hogs N`` runs N CPU-bound processes throughout.
A killed worker is restarted after a uniform 1-10 s reconnect delay with the same flags; its
next life is drawn from the moment it is started (seeded RNG). Starting a Python worker costs
~1-2 s of CPU on this 2-core machine, shared with the coordinator, the other workers and the
client: that cost is part of what is measured.

Meanwhile ``--concurrency`` client threads issue greedy non-streaming completions back to back
(a few prompts, 32-64 tokens, ``return_token_ids``) and compare every answer with the tokens of
the single-process reference (``edgepipe.runtime.local.generate``), counting mismatches, errors
and timeouts. Time in Down / Preparing / Committing / Up comes from ``/v1/cluster/status``
``state_seconds`` diffed over the run; availability = Up / total (seed table 6.8: 93.87% with one
worker needed, 28.17% with three; goal here >= 97% and >= 80%). After ``--duration`` no more
workers are killed, the dead ones are restarted and the requests in flight are drained (bounded).

    python benchmarks/churn.py [--duration 600] [--scenarios one,three] [--seed 1]
    python benchmarks/churn.py --smoke          # 60 s per scenario
    python benchmarks/churn.py --scenarios one --out churn-one; ... --scenarios three --out churn-three
    python benchmarks/churn.py --report-from churn-one,churn-three    # -> churn.md / churn.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from edgepipe.bench.cluster import Server, bench_home
from edgepipe.bench.machine import Conditions, load_average, load_text, machine_line
from edgepipe.bench.results import RESULTS, write_results

SCENARIOS = {"one": {"memory": "500MB", "needed": 1, "seed_availability": 93.87, "goal": 97.0},
             "three": {"memory": "170MB", "needed": 3, "seed_availability": 28.17, "goal": 80.0}}
SEED_TABLE = {"one": {"down": 0.77, "preparing": 1.18, "committing": 34.81, "up": 563.23},
              "three": {"down": 55.69, "preparing": 170.87, "committing": 204.45, "up": 169.00}}
PROMPTS = ["Once upon a time in a small village,", "The three most important things about distributed systems are",
           "Here is a recipe for a simple tomato soup:", "In the year 2150, the first city on Mars"]
TOKENS = (32, 48, 64)
WORKERS = 5
STATES = ("down", "preparing", "committing", "up")


def references(pkg) -> dict[tuple[str, int], list[int]]:
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    tok, pipe, out = pkg.tokenizer, pkg.pipeline(batch_invariant=True), {}  # concurrent clients: an invariant cluster
    for prompt in PROMPTS:
        for n in TOKENS:
            out[(prompt, n)] = generate(pipe, tok.encode(prompt), GenerationParams(max_tokens=n, ignore_eos=True), tok.decode,
                                        pkg.manifest.eos_ids).tokens
    return out


class Churn:
    """Five worker slots; kills with a ramping hazard, restarts after a uniform delay."""

    def __init__(self, url: str, memory: str, duration: float, mttf_end: float, reconnect: tuple[float, float], seed: int, logdir: Path,
                 fault: str = "kill"):
        self.url, self.memory, self.duration, self.mttf_end, self.reconnect = url, memory, duration, mttf_end, reconnect
        self.fault = fault  # kill: SIGKILL, restarted by this script | freeze: SIGSTOP, SIGCONT later, the worker reconnects itself
        self.frozen: list[bool] = [False] * WORKERS
        self.rng = random.Random(seed)
        self.logdir = logdir
        self.procs: list[subprocess.Popen | None] = [None] * WORKERS
        self.death: list[float] = [math.inf] * WORKERS  # run-relative seconds
        self.restart_at: list[float] = [math.inf] * WORKERS
        self.t0 = 0.0
        self.kills = self.restarts = self.unexpected_exits = 0
        self.kill_times: list[float] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.killing = True

    def spawn(self, i: int) -> None:
        env = {**os.environ}
        env.pop("EDGEPIPE_JOIN_TOKEN", None)
        log = open(self.logdir / f"worker{i + 1}.log", "ab")
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", self.url, "--name", f"churn{i + 1}",
                                          "--memory", self.memory, "--threads", "1"], env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def next_death(self, born: float) -> float:
        """Inverse of the cumulative hazard L(t) = t^2 / (2 T m) (rate t / (T m)) from ``born``."""
        e = self.rng.expovariate(1.0)
        return math.sqrt(born * born + 2 * self.duration * self.mttf_end * e)

    def start_all(self) -> None:
        for i in range(WORKERS):
            self.spawn(i)

    def begin(self, t0: float) -> None:
        self.t0 = t0
        for i in range(WORKERS):
            self.death[i] = self.next_death(0.0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        while not self.stop.is_set():
            now = self.now()
            with self.lock:
                for i, p in enumerate(self.procs):
                    if p is not None and p.poll() is not None:  # exited without being killed by us
                        self.unexpected_exits += 1
                        self.procs[i] = None
                        self.restart_at[i] = now + self.rng.uniform(*self.reconnect)
                    elif p is not None and self.frozen[i] and now >= self.restart_at[i]:
                        p.send_signal(signal.SIGCONT)  # the same process finds its channel gone and rejoins by itself
                        self.frozen[i] = False
                        self.restarts += 1
                        self.restart_at[i] = math.inf
                        self.death[i] = self.next_death(now)
                    elif p is not None and not self.frozen[i] and self.killing and now >= self.death[i]:
                        if self.fault == "freeze":
                            p.send_signal(signal.SIGSTOP)
                            self.frozen[i] = True
                        else:
                            p.kill()
                            p.wait(timeout=10)
                            self.procs[i] = None
                        self.kills += 1
                        self.kill_times.append(now)
                        self.restart_at[i] = now + self.rng.uniform(*self.reconnect)
                    elif p is None and now >= self.restart_at[i]:
                        self.spawn(i)
                        self.restarts += 1
                        self.restart_at[i] = math.inf
                        self.death[i] = self.next_death(now)
            self.stop.wait(0.05)

    def stop_killing(self) -> None:
        """End of the measured window: no more kills; dead workers come back now."""
        with self.lock:
            self.killing = False
            now = self.now()
            for i, p in enumerate(self.procs):
                if p is None or self.frozen[i]:
                    self.restart_at[i] = now

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is None:
                    if self.frozen[i]:
                        p.send_signal(signal.SIGCONT)
                    p.terminate()
            for i, p in enumerate(self.procs):
                if p is not None:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait(timeout=10)
                    self.procs[i] = None


class Watcher:
    """Status every second, events merged across polls (the coordinator keeps only the last 500)."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=5)
        self.samples: list[dict] = []
        self.events: dict[tuple, dict] = {}
        self.stop = threading.Event()
        self.errors = 0
        self.failing_since: float | None = None  # first failed poll of the current streak
        self.frozen_at: float | None = None  # coordinator stopped answering for >= 30 s from here

    def poll(self) -> dict | None:
        now = time.monotonic()
        try:
            s = self.client.get("/v1/cluster/status").json()
            sample = {"t": time.monotonic(), "state": s["state"], "state_seconds": s["state_seconds"], "workers": len(s["workers"]),
                      "plan_workers": len(s["plan"]["stages"]) if s["plan"] else 0, "tokens_per_s": s.get("tokens_per_s")}
            self.samples.append(sample)
            for e in self.client.get("/v1/cluster/events").json()["events"]:
                self.events[(e["t"], e["kind"], json.dumps(e, sort_keys=True))] = e
            self.failing_since = None
            return sample
        except (httpx.HTTPError, ValueError, KeyError):
            self.errors += 1
            self.failing_since = self.failing_since or now
            if self.frozen_at is None and now - self.failing_since >= 30:
                self.frozen_at = self.failing_since
            return None

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(1.0)

    def tokens_total(self) -> float:
        try:
            text = self.client.get("/metrics").text
        except httpx.HTTPError:
            return math.nan
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("edgepipe_tokens_generated_total") and not line.startswith("#"))


class Clients:
    def __init__(self, url: str, refs: dict, concurrency: int, timeout: float, seed: int):
        self.url, self.refs, self.concurrency, self.timeout = url, refs, concurrency, timeout
        self.rng = random.Random(seed + 1000)
        self.results: list[dict] = []
        self.lock = threading.Lock()
        self.deadline = math.inf  # no new request after this (monotonic)
        self.threads: list[threading.Thread] = []
        self.max_requests = 100_000

    def one(self, client: httpx.Client) -> dict:
        with self.lock:
            prompt, n = self.rng.choice(PROMPTS), self.rng.choice(TOKENS)
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        t0 = time.monotonic()
        row = {"start": t0, "tokens": n, "prompt": PROMPTS.index(prompt)}
        try:
            r = client.post("/v1/completions", json=body, timeout=self.timeout)
            row["end"] = time.monotonic()
            if r.status_code != 200:
                row["outcome"] = "error"
                row["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                ids = r.json()["choices"][0].get("token_ids")
                row["outcome"] = "ok" if ids == self.refs[(prompt, n)] else "mismatch"
                if row["outcome"] == "mismatch":
                    row["got"], row["expected"] = ids, self.refs[(prompt, n)]
        except httpx.TimeoutException:
            row["end"], row["outcome"] = time.monotonic(), "timeout"
        except httpx.HTTPError as exc:
            row["end"], row["outcome"], row["error"] = time.monotonic(), "error", f"{type(exc).__name__}: {exc}"
        return row

    def loop(self) -> None:
        with httpx.Client(base_url=self.url) as client:
            for _ in range(self.max_requests):
                if time.monotonic() >= self.deadline:
                    return
                row = self.one(client)
                with self.lock:
                    self.results.append(row)

    def start(self) -> None:
        for _ in range(self.concurrency):
            t = threading.Thread(target=self.loop, daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


def state_at(samples: list[dict], t: float) -> dict:
    """state_seconds of the sample closest to monotonic time ``t``."""
    return min(samples, key=lambda s: abs(s["t"] - t))["state_seconds"]


def run_scenario(name: str, home: Path, args, refs: dict) -> dict:
    spec = SCENARIOS[name]
    logdir = Path(tempfile.mkdtemp(prefix=f"edgepipe-churn-{name}-"))
    # the coordinator's own output goes to a log file beside the workers' (a stalled coordinator can log a lot)
    server = Server(home, workers=0, args=("--precision", "int4", "--min-workers", str(WORKERS), "--placement", "planner", "--batch-invariant"), wait_up=False,
                    timeout=120, log=logdir / "coordinator.log")
    churn = Churn(server.url, spec["memory"], args.duration, args.mttf_end, tuple(args.reconnect), args.seed, logdir, args.fault)
    watcher = Watcher(server.url)
    clients = Clients(server.url, refs, args.concurrency, args.request_timeout, args.seed)
    threads: list[threading.Thread] = []
    try:
        churn.start_all()
        first = server.wait_for(lambda s: s["state"] == "up" and len(s["workers"]) >= WORKERS, timeout=300)
        first_plan = [[s["worker"], s["start"], s["end"]] for s in first["plan"]["stages"]]
        # warm-up: one request per prompt length so the first measured steps are not first-run steps
        with httpx.Client(base_url=server.url, timeout=120) as c:
            c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}).raise_for_status()
        start = watcher.poll()
        tokens0 = watcher.tokens_total()
        t0 = start["t"]
        churn.begin(t0)
        clients.deadline = t0 + args.duration
        threads = [threading.Thread(target=churn.run, daemon=True), threading.Thread(target=watcher.run, daemon=True)]
        for t in threads:
            t.start()
        clients.start()
        while time.monotonic() < t0 + args.duration:
            time.sleep(min(1.0, max(0.0, t0 + args.duration - time.monotonic())))
        end = watcher.poll() or watcher.samples[-1]  # the last answered poll if the coordinator stopped answering
        tokens1 = watcher.tokens_total()
        t1 = t0 + args.duration
        churn.stop_killing()
        frozen = watcher.frozen_at is not None or time.monotonic() - end["t"] > 30
        drained = clients.join(5 if frozen else args.request_timeout + 30)
        watcher.stop.set()
        final = watcher.poll()
    finally:
        watcher.stop.set()
        churn.close()
        for t in threads:
            t.join(timeout=5)
        server.close()
        watcher.client.close()

    (logdir / "events.json").write_text(json.dumps(sorted(watcher.events.values(), key=lambda e: e["t"]), indent=0))
    wall = t1 - t0
    states = {k: end["state_seconds"][k] - start["state_seconds"][k] for k in STATES}
    # a coordinator that stopped answering serves nothing: the rest of the window counts as unavailable
    unresponsive = max(0.0, t1 - end["t"]) if frozen else 0.0
    total = sum(states.values()) + unresponsive
    evs = sorted(watcher.events.values(), key=lambda e: e["t"])
    # events inside the measured window: map wall clock to monotonic through the sample taken at t0
    offset = time.time() - time.monotonic()  # approx; events carry time.time()
    in_window = [e for e in evs if t0 + offset - 1 <= e["t"] <= t1 + offset + 1]
    recovered = [e["seconds"] for e in in_window if e["kind"] == "recovered"]
    ups = [e for e in in_window if e["kind"] == "up"]
    plan_sizes = [len(e["stages"]) for e in in_window if e["kind"] == "prepare"]
    done = [r for r in clients.results if r.get("end") is not None]
    in_win = [r for r in done if r["end"] <= t1]
    outcome = {k: sum(r["outcome"] == k for r in clients.results) for k in ("ok", "mismatch", "error", "timeout")}
    ok_tokens = sum(r["tokens"] for r in in_win if r["outcome"] == "ok")
    windows = []
    step = args.duration / 5
    for i in range(5):
        a, b = state_at(watcher.samples, t0 + i * step), state_at(watcher.samples, t0 + (i + 1) * step)
        d = {k: b[k] - a[k] for k in STATES}
        lo, hi, last = t0 + i * step, t0 + (i + 1) * step, end["t"]
        tot = sum(d.values()) + ((max(0.0, hi - last) - max(0.0, lo - last)) if frozen else 0.0)
        rate_mid = (i + 0.5) * step / args.duration / args.mttf_end
        windows.append({"from_s": round(i * step), "to_s": round((i + 1) * step), "mttf_mid_s": round(1 / rate_mid, 1),
                        "availability": 100 * d["up"] / tot if tot else None, "kills": sum(i * step <= k < (i + 1) * step for k in churn.kill_times)})
    result = {
        "scenario": name, "memory_per_worker": spec["memory"], "workers": WORKERS, "needed": spec["needed"], "first_plan": first_plan,
        "duration_s": round(wall, 1), "state_seconds": {k: round(v, 2) for k, v in states.items()},
        "coordinator_unresponsive_s": round(unresponsive, 1), "coordinator_frozen_at_s": round(end["t"] - t0, 1) if frozen else None,
        "availability": 100 * states["up"] / total if total else None, "seed_availability": spec["seed_availability"], "goal": spec["goal"],
        "requests": {**outcome, "in_flight_at_end_drained": drained, "completed_in_window_ok": sum(r["outcome"] == "ok" for r in in_win),
                     "max_latency_s": max((r["end"] - r["start"] for r in done), default=None),
                     "median_latency_s": statistics.median([r["end"] - r["start"] for r in done]) if done else None},
        "tokens_per_s_ok_requests": ok_tokens / wall if wall else None,
        "server_tokens_per_s": (tokens1 - tokens0) / wall if wall and not math.isnan(tokens1) else None,
        "kills": churn.kills, "restarts": churn.restarts, "unexpected_worker_exits": churn.unexpected_exits,
        "leaves": sum(e["kind"] == "leave" for e in in_window), "joins": sum(e["kind"] == "join" for e in in_window),
        "recoveries": len(recovered), "recovered_s_median": statistics.median(recovered) if recovered else None,
        "recovered_s_max": max(recovered) if recovered else None, "pauses": sum(e["kind"] == "pause" for e in in_window),
        "plans_up": len(ups), "plans_prepared": len(plan_sizes), "plan_failed": sum(e["kind"] == "plan_failed" for e in in_window),
        "plan_failed_examples": list({e.get("error", "")[:160] for e in in_window if e["kind"] == "plan_failed"})[:5],
        "stages_per_prepared_plan": {str(k): plan_sizes.count(k) for k in sorted(set(plan_sizes))},
        "state_changes": sum(e["kind"] == "state" for e in in_window),
        "availability_by_fifth": windows, "watch_errors": watcher.errors, "logs": str(logdir),
        "bad_requests": [r for r in clients.results if r["outcome"] != "ok"][:10],
        "final_state": final["state"] if final else end["state"],
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("bad_requests",)}), flush=True)
    return result


def report(results: list[dict], args, run: Conditions, started: str | None = None) -> None:
    """Write the report; ``started``: the start dates of scenarios run separately (``--report-from``)."""
    def f(x, d=1):
        return "–" if x is None else f"{x:.{d}f}"

    where = f"{started} · {machine_line(run.machine)}" if started else run.line()
    conditions = (f"{where} · SmolLM2-135M int4 · coordinator + {WORKERS} workers (1 thread each) on loopback, planner "
                  f"placement · EMULATED memory budgets per worker · churn: "
                  f"{'SIGSTOP (frozen; SIGCONT later and the same process reconnects by itself)' if getattr(args, 'fault', 'kill') == 'freeze' else 'SIGKILL'} "
                  f"with exponential lives, hazard ramping linearly "
                  f"from 0 to 1/{args.mttf_end:g} s over {args.duration:g} s, restart after U({args.reconnect[0]:g}, {args.reconnect[1]:g}) s, "
                  f"seed {args.seed} · {args.concurrency} client threads back to back, greedy, {'/'.join(map(str, TOKENS))} tokens · "
                  f"{getattr(args, 'hogs', 0)} CPU hog process(es) running throughout · "
                  f"load average after each scenario: {'; '.join(r.get('loadavg_after', '?') for r in results)} · "
                  f"shared noisy 2-core machine: worker restarts (Python start ~1-2 s CPU), calibration and the client share the CPU")
    lines = ["# Availability under worker churn (seed 003 §6.5, table 6.8)", "", conditions, "",
             "| scenario | memory budget/worker | needed | Down s | Preparing s | Committing s | Up s | coordinator not answering s | availability | seed 003 | goal | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["state_seconds"]
        lines.append(f"| {r['scenario']} | {r['memory_per_worker']} | {r['needed']} (first plan: {len(r['first_plan'])} stage(s)) | "
                     f"{f(s['down'])} | {f(s['preparing'])} | {f(s['committing'])} | {f(s['up'])} | {f(r['coordinator_unresponsive_s'])} | **{f(r['availability'], 2)}%** | "
                     f"{r['seed_availability']}% | ≥ {r['goal']:g}% | {'yes' if r['availability'] is not None and r['availability'] >= r['goal'] else 'no'} |")
    for r in results:
        seed = SEED_TABLE[r["scenario"]]
        lines.append(f"| seed 003 ({'Qwen3-0.6B' if r['scenario'] == 'one' else 'Qwen3-1.7B'}, chat) | | {r['needed']} | {seed['down']} | "
                     f"{seed['preparing']} | {seed['committing']} | {seed['up']} | | {r['seed_availability']}% | | | |")
    lines += ["", "| scenario | requests ok | wrong tokens | errors | timeouts | ok tokens/s | server tokens/s | latency median / max s | kills | "
              "restarts | recoveries | recovered s median / max | plans up | plan failed | state changes |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        q = r["requests"]
        lines.append(f"| {r['scenario']} | {q['ok']} | {q['mismatch']} | {q['error']} | {q['timeout']} | {f(r['tokens_per_s_ok_requests'])} | "
                     f"{f(r['server_tokens_per_s'])} | {f(q['median_latency_s'], 2)} / {f(q['max_latency_s'], 2)} | {r['kills']} | {r['restarts']} | "
                     f"{r['recoveries']} | {f(r['recovered_s_median'], 2)} / {f(r['recovered_s_max'], 2)} | {r['plans_up']} | {r['plan_failed']} | "
                     f"{r['state_changes']} |")
    lines += ["", "Availability by fifth of the run (churn ramps up):", "", "| scenario | " + " | ".join(
        f"{w['from_s']}-{w['to_s']} s (MTTF ~{w['mttf_mid_s']} s)" for w in results[0]["availability_by_fifth"]) + " |",
              "|---|" + "---|" * len(results[0]["availability_by_fifth"])]
    for r in results:
        lines.append(f"| {r['scenario']} | " + " | ".join(f"{f(w['availability'], 1)}% ({w['kills']} kills)" for w in r["availability_by_fifth"]) + " |")
    lines.append("")
    for r in results:
        sizes = ", ".join(f"{n} stage(s): {c}" for n, c in r["stages_per_prepared_plan"].items())
        lines.append(f"- {r['scenario']}: plans prepared by number of stages — {sizes}; plan_failed examples: "
                     + ("; ".join(e[:110] for e in r["plan_failed_examples"][:2]) or "none"))
    for r in results:
        if r["coordinator_frozen_at_s"] is not None:
            lines.append(f"\n**{r['scenario']}: the coordinator stopped answering HTTP at {r['coordinator_frozen_at_s']} s into the run** "
                         f"(last state {r['final_state']}); the rest of the window counts as unavailable. Worker logs: {r['logs']}")
    lines += ["", "Requests are counted over the whole run including the drain after the window (no new request after it; "
              "killing stops and dead workers are restarted). Tokens/s counts only correct answers finished inside the window. "
              "Seed 003 ran 10 workers on separate machines; here 5 processes share 2 cores, so a restart's CPU slows everyone."]
    text = "\n".join(lines)
    print(text)
    write_results(args.out or ("churn-smoke" if args.smoke else "churn"), {"conditions": conditions, **run.as_dict(), "scenarios": results},
                  text, args.results_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--smoke", action="store_true", help="60 s per scenario")
    ap.add_argument("--scenarios", default="one,three")
    ap.add_argument("--mttf-end", type=float, default=10.0)
    ap.add_argument("--reconnect", type=float, nargs=2, default=(1.0, 10.0))
    ap.add_argument("--fault", choices=("kill", "freeze"), default="kill",
                    help="kill: SIGKILL and restart the process | freeze: SIGSTOP, then SIGCONT after the delay (the worker reconnects itself)")
    ap.add_argument("--hogs", type=int, default=0, help="CPU-bound processes competing for the cores during the run")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="results name (default churn, or churn-smoke with --smoke)")
    ap.add_argument("--results-dir", default=str(RESULTS), help="where the .md/.json go (tests use a temporary one)")
    ap.add_argument("--report-from", default=None,
                    help="no run: combine the scenarios of these results (e.g. churn-one,churn-three) into one report")
    args = ap.parse_args()
    if args.smoke:
        args.duration = 60.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: every process we started ends
    home = bench_home()
    os.environ["EDGEPIPE_HOME"] = str(home)
    from edgepipe.model.store import resolve

    if args.report_from:  # scenarios run separately (same flags), reported together
        results, starts = [], []
        for name in args.report_from.split(","):
            data = json.loads((Path(args.results_dir) / f"{name}.json").read_text())
            starts.append(data["conditions"].split(" · ")[0])
            results += data["scenarios"]
        report(results, args, Conditions.from_dict(data) if "machine" in data else Conditions.start(), " / ".join(starts))
        return
    run = Conditions.start()
    refs = references(resolve("smollm2", "int4", home))
    results = []
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        for name in args.scenarios.split(","):
            results.append(run_scenario(name, home, args, refs))
            results[-1]["loadavg_after"] = load_text(load_average())
            report(results, args, run.finish())  # after each scenario, so a partial run leaves its results
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
