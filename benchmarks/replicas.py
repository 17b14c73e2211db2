"""Replicated stages vs the best plan without replicas: aggregate tokens/s at 16 concurrent streams.

One EMULATED heterogeneous cluster (SmolLM2-135M, three workers on this machine): a faster
device ``fast`` (slowdown F) with room for the whole model, and two slower ones ``slow1`` and
``slow2`` (slowdown 2F) with a hard memory budget. The planner is asked, from the profiles the
coordinator measured, for its throughput plan for 16 sequences twice: with replicas (the plan
the coordinator now runs) and with ``replicas=False`` (the best plan without). Both are deployed
in turn on the same cluster (``/v1/cluster/rebalance``, pinned) and measured alternately; every
stream's tokens are checked against its solo single-process reference (``--batch-invariant``).
The slowdowns keep the two real cores from being the bottleneck: most of a stage's time is
emulated waiting.

    python benchmarks/replicas.py [--tokens 32] [--streams 16] [--rounds 2] [--slowdown 4] [--slow-memory 120MB]
                                  [--profiles measured|declared] [--no-prefix-cache]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx

from edgepipe.bench.cluster import Cluster, Device, bench_home
from edgepipe.bench.emulated import header, measured_profiles, prewarm
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.model.store import prepare_local_form, resolve
from edgepipe.plan import Objective, PlanRequest, plan
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

TOPICS = ["rivers", "stars", "gravity", "a forest", "music", "the ocean", "a city at night", "clouds", "volcanoes", "bees",
          "winter", "bridges", "the moon", "deserts", "trains", "coffee"]


def prompt(i: int) -> str:
    return f"Tell me about {TOPICS[i % len(TOPICS)]}."


def solo_references(streams: int, tokens: int) -> list[list[int]]:
    """Each stream's tokens decoded alone in this process (the batch-invariant graphs)."""
    pkg = resolve(home=bench_home())
    form, _ = prepare_local_form(pkg)  # the form `serve` sends these workers, added here first if the package lacks it
    pipe, tok = pkg.pipeline(batch_invariant=True, precision=form), pkg.tokenizer
    out = []
    for i in range(streams):
        ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt(i)}]))
        out.append(generate(pipe, ids, GenerationParams(max_tokens=tokens, ignore_eos=True), tok.decode, pkg.manifest.eos_ids).tokens)
    return out


def one_stream(url: str, i: int, tokens: int) -> list[int]:
    body = {"messages": [{"role": "user", "content": prompt(i)}], "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with httpx.Client(base_url=url, timeout=900) as c:
        r = c.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]


def aggregate(url: str, streams: int, tokens: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(lambda i: one_stream(url, i, tokens), range(streams)))
    return sum(map(len, got)) / (time.perf_counter() - t0), got


def profiles_for(cluster: Cluster, devices: list[Device], source: str):
    """(model, devices, network) for the planner: as the coordinator measured each device, or
    ("declared") one base speed and overhead for this box (the median over the devices of what
    was measured, undone of each device's slowdown) scaled by each device's declared slowdown."""
    model, measured, network = measured_profiles(cluster)
    if source == "measured":
        return model, measured, network
    factor = {w["id"]: next(d.slowdown for d in devices if d.name == w["name"]) for w in cluster.status()["workers"]}
    speed = statistics.median(d.speed * factor[d.id] for d in measured)
    overhead = statistics.median(d.overhead_s / factor[d.id] for d in measured)
    return model, [replace(d, speed=speed / factor[d.id], overhead_s=overhead * factor[d.id]) for d in measured], network


def planned(profiles, streams: int, replicas: bool) -> tuple[list[dict], float]:
    """The planner's throughput plan for ``streams`` sequences, as rebalance stages (a
    replicated stage: one entry per replica)."""
    model, devices, network = profiles
    best = plan(model, devices, network, PlanRequest(objective=Objective.THROUGHPUT, sequences=streams, replicas=replicas)).best
    if not best.complete:
        raise SystemExit(f"no complete plan (replicas={replicas}): {best.reason}")
    return [{"worker": d, "start": s.start, "end": s.end} for s in best.stages for d in s.device_ids], best.predicted.throughput_tok_s


def deploy(cluster: Cluster, stages: list[dict]) -> int:
    r = httpx.post(cluster.url + "/v1/cluster/rebalance", timeout=600, json={"stages": stages, "pin_s": 3600})
    r.raise_for_status()
    return r.json()["plan"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slowdown", type=float, default=4.0, help="the fast device's slowdown; the slow ones get twice it")
    ap.add_argument("--slow-memory", default="120MB", help="the slow devices' memory budget")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="serve without the prefix cache (it stays off on a plan with replicated stages anyway)")
    ap.add_argument("--profiles", choices=("measured", "declared"), default="measured",
                    help="what the planner is given: the coordinator's measured profiles, or one base figure scaled by the "
                         "declared slowdowns (a loaded box calibrates noisily)")
    args = ap.parse_args()
    run = Conditions.start()
    expected = solo_references(args.streams, args.tokens)
    prewarm()  # after the references: the worker cache gets the form they added
    devices = [Device("fast", slowdown=args.slowdown), Device("slow1", slowdown=2 * args.slowdown, memory=args.slow_memory),
               Device("slow2", slowdown=2 * args.slowdown, memory=args.slow_memory)]
    cluster = Cluster("replicas", devices, args=("--batch-invariant", "--max-active", str(args.streams), "--max-queue", "64",
                                                 *(() if args.prefix_cache else ("--no-prefix-cache",))))
    try:
        cluster.wait_up()
        names = cluster.names()
        given = profiles_for(cluster, devices, args.profiles)
        plans = {kind: planned(given, args.streams, kind == "replicated") for kind in ("replicated", "no replicas")}
        profiles = {w["name"]: w.get("profile") for w in cluster.status()["workers"]}
        print(profiles, plans, flush=True)
        measured: dict[str, list[float]] = {k: [] for k in plans}
        exact = {k: True for k in plans}
        busy: dict[str, list[dict]] = {k: [] for k in plans}
        for r in range(args.rounds):
            for kind in (list(plans) if r % 2 == 0 else list(plans)[::-1]):
                deploy(cluster, plans[kind][0])
                aggregate(cluster.url, args.streams, 8)  # warm-up on the new plan, every stream
                before, t0 = cluster.metrics(), time.perf_counter()
                tps, got = aggregate(cluster.url, args.streams, args.tokens)
                busy[kind].append(busy_share(before, cluster.metrics(), time.perf_counter() - t0, names))
                measured[kind].append(tps)
                exact[kind] &= got == expected
                wrong = [(i, len(g), len(e), next((k for k, (x, y) in enumerate(zip(g, e)) if x != y), None))
                         for i, (g, e) in enumerate(zip(got, expected)) if g != e]
                print(kind, round(tps, 2), "exact" if not wrong else f"MISMATCH (stream, got, expected, first differing) {wrong}",
                      busy[kind][-1], flush=True)
    finally:
        cluster.close()
    report(args, run.finish(), devices, names, profiles, plans, measured, exact, busy)


def busy_share(before: dict, after: dict, wall_s: float, names: dict) -> dict[str, float]:
    """Per device: the share of the wall time its stage computed (emulated waiting included)."""
    out = {}
    for key, value in after.items():
        if key.startswith("edgepipe_stage_compute_seconds_sum|"):
            worker = key.split("|", 1)[1]
            out[names.get(worker, worker)] = round((value - before.get(key, 0.0)) / wall_s, 2)
    return out


def report(args, run: Conditions, devices, names, profiles, plans, measured, exact, busy) -> None:
    def fmt(stages):
        groups: dict[tuple, list[str]] = {}
        for s in stages:
            groups.setdefault((s["start"], s["end"]), []).append(names.get(s["worker"], s["worker"]))
        return " · ".join(f"{'+'.join(ws)}[{a},{b})" for (a, b), ws in groups.items())

    med = {k: statistics.median(v) for k, v in measured.items()}
    ratio = med["replicated"] / med["no replicas"]
    lines = header("Replicated stages vs the best plan without replicas", run,
                   f"{args.streams} concurrent greedy streams x {args.tokens} tokens, `--batch-invariant`"
                   + ("" if args.prefix_cache else ", `--no-prefix-cache`"))
    lines += [f"Planner input: **{args.profiles}** profiles"
              + (" (one base speed and overhead for this box, the median of what the coordinator measured undone of each "
                 "device's slowdown, scaled by each device's declared slowdown)" if args.profiles == "declared" else
                 " (as the coordinator measured each device)") + ".", "",
              "Devices: " + "; ".join(f"`{d.name}` {d.label()}" for d in devices) + ". As the coordinator measured them: "
              + "; ".join(f"`{n}` speed {p['speed']:g}, overhead {p['overhead_ms']:g} ms" for n, p in profiles.items() if p), "",
              "| plan (planner, throughput objective, 16 sequences) | stages | predicted tok/s | measured tok/s (each round) | "
              "median | busy share per device (last round) | tokens = solo reference |", "|---|---|---|---|---|---|---|"]
    for kind, (stages, predicted) in plans.items():
        lines.append(f"| {kind} | {fmt(stages)} | {predicted:.1f} | {', '.join(f'{x:.1f}' for x in measured[kind])} | "
                     f"{med[kind]:.1f} | {', '.join(f'{n} {v:.0%}' for n, v in sorted(busy[kind][-1].items()))} | "
                     f"{'yes, every stream' if exact[kind] else 'NO'} |")
    lines += ["", f"**Replicated / no replicas: {ratio:.2f}x** (median aggregate tokens/s; goal >= 1.3x). Rounds alternate the "
                  "order of the two plans; each plan is deployed with `/v1/cluster/rebalance` (pinned) on the same cluster.",
              "", f"Rerun: `python benchmarks/replicas.py --tokens {args.tokens} --streams {args.streams} --rounds {args.rounds} "
                  f"--slowdown {args.slowdown:g} --slow-memory {args.slow_memory} --profiles {args.profiles}"
                  + ("" if args.prefix_cache else " --no-prefix-cache") + "`"]
    text = "\n".join(lines)
    print(text)
    write_results("replicas", {**run.as_dict(), "args": vars(args), "profiles": profiles, "plans": {k: v[0] for k, v in plans.items()},
                               "predicted_tok_s": {k: v[1] for k, v in plans.items()}, "measured_tok_s": measured, "busy_share": busy,
                               "exact": exact, "ratio": ratio}, text)


if __name__ == "__main__":
    main()
