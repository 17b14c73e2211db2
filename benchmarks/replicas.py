"""Replicated stages vs the best plan without replicas: aggregate tokens/s at 16 concurrent streams.

One EMULATED heterogeneous cluster on this machine, every device a roofline (``--roofline``,
``edgepipe.emulate.roofline``: each call lasts overhead + max(weight bytes / bandwidth, rows x
FLOPs per row / FLOP rate), so a device is memory-bound at one row and compute-bound at 8-16
as phones and SBCs are): a low-power ``laptop`` with room for the whole model and ``--phones``
phone/SBC-class devices with a small memory budget. The coordinator calibrates each device
(steps at 1 and at 8 rows: speed, overhead, cost per further row) and the planner is asked,
from those measured profiles, for its throughput plan for 16 sequences twice: with replicas
and with ``replicas=False`` (the best plan without). Both are deployed in turn on the same
cluster (``/v1/cluster/rebalance``, pinned) and measured in alternating rounds; every
stream's tokens are checked against its solo single-process reference (``--batch-invariant``).
Busy shares (emulated) and CPU shares (real compute) per device show that the emulated time,
not the two real cores, limits each device.

    python -m benchmarks.replicas [--tokens 64] [--streams 16] [--rounds 2] [--phones 4]
                                  [--laptop 5.4e9,1.7GB,1] [--phone 1.7e9,0.85GB,2] [--laptop-memory 4GB] [--phone-memory 250MB]
                                  [--model GGUF --precision native] [--predict]

``--predict`` starts no cluster: it works out what the join calibration would measure of these
rooflines and prints the planner's two plans and their predicted ratio (seconds, to choose a family).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import httpx

from edgepipe.bench.cluster import Cluster, Device, bench_home
from edgepipe.bench.emulated import header, measured_profiles, prewarm
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.emulate.roofline import RooflinePolicy
from edgepipe.emulate.slowdown import parse_bytes
from edgepipe.model.store import prepare_local_form, resolve
from edgepipe.plan import DeviceProfile, LinkProfile, NetworkProfile, Objective, PlanRequest, evaluate, fit_speed_overhead, plan
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

RESULTS = Path(__file__).parent / "results" / "replicas.md"
EARLIER = "## Earlier runs"

TOPICS = ["rivers", "stars", "gravity", "a forest", "music", "the ocean", "a city at night", "clouds", "volcanoes", "bees",
          "winter", "bridges", "the moon", "deserts", "trains", "coffee"]


def prompt(i: int) -> str:
    return f"Tell me about {TOPICS[i % len(TOPICS)]}."


def package_of(args):
    """The package the cluster serves: the bundled model, or ``--model`` (a GGUF) at ``--precision``."""
    return resolve(args.model, args.precision, home=bench_home()) if args.model else resolve("smollm2", home=bench_home())


def serve_model_args(args) -> tuple[str, ...]:
    return ("--model", args.model, "--precision", args.precision) if args.model else ()


def solo_references(pkg, streams: int, tokens: int) -> list[list[int]]:
    """Each stream's tokens decoded alone in this process (the batch-invariant graphs)."""
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phones", type=int, default=4)
    ap.add_argument("--laptop", default="5.4e9,1.7GB,1", help="the laptop's roofline: FLOP/s, bytes/s, ms per call")
    ap.add_argument("--phone", default="1.7e9,0.85GB,2", help="each phone's roofline: FLOP/s, bytes/s, ms per call")
    ap.add_argument("--laptop-memory", default="4GB")
    ap.add_argument("--phone-memory", default="250MB")
    ap.add_argument("--real", type=int, default=0, metavar="N",
                    help="no emulation: N plain workers of this machine; print the two plans the planner makes from their "
                         "measured profiles and stop (on this memory-bound box it should not replicate)")
    ap.add_argument("--model", default=None, help="a GGUF path to serve instead of the bundled SmolLM2-135M")
    ap.add_argument("--precision", default="native", help="serve --precision with --model")
    ap.add_argument("--predict", action="store_true", help="no cluster: the planner's two plans for these rooflines, from the "
                                                            "profiles their join calibration would measure")
    args = ap.parse_args()
    if args.real:
        real_plans(args)
        return
    if args.predict:
        predict_plans(args)
        return
    run = Conditions.start()
    pkg = package_of(args)
    expected = solo_references(pkg, args.streams, args.tokens)
    prewarm(pkg)  # after the references: the worker cache gets the form they added
    devices = emulated_devices(args)
    cluster = Cluster("replicas", devices, args=(*serve_model_args(args), "--batch-invariant", "--max-active", str(args.streams), "--max-queue", "64",
                                                 "--no-prefix-cache"))
    try:
        cluster.wait_up()
        names = cluster.names()
        given = measured_profiles(cluster, package=pkg)
        plans = {kind: planned(given, args.streams, kind == "replicated") for kind in ("replicated", "no replicas")}
        profiles = {w["name"]: w.get("profile") for w in cluster.status()["workers"]}
        print(profiles, plans, flush=True)
        pids = {d.name: p.pid for d, p in zip(devices, cluster.workers)}
        measured: dict[str, list[float]] = {k: [] for k in plans}
        exact = {k: True for k in plans}
        busy: dict[str, list[dict]] = {k: [] for k in plans}
        cpu: dict[str, list[dict]] = {k: [] for k in plans}
        for r in range(args.rounds):
            for kind in (list(plans) if r % 2 == 0 else list(plans)[::-1]):
                deploy(cluster, plans[kind][0])
                aggregate(cluster.url, args.streams, 8)  # warm-up on the new plan, every stream
                before, cpu0, t0 = cluster.metrics(), {n: cpu_seconds(p) for n, p in pids.items()}, time.perf_counter()
                tps, got = aggregate(cluster.url, args.streams, args.tokens)
                wall = time.perf_counter() - t0
                busy[kind].append(busy_share(before, cluster.metrics(), wall, names))
                cpu[kind].append({n: round((cpu_seconds(p) - cpu0[n]) / wall, 2) for n, p in pids.items()})
                measured[kind].append(tps)
                exact[kind] &= got == expected
                wrong = [(i, len(g), len(e), next((k for k, (x, y) in enumerate(zip(g, e)) if x != y), None))
                         for i, (g, e) in enumerate(zip(got, expected)) if g != e]
                print(kind, round(tps, 2), "exact" if not wrong else f"MISMATCH (stream, got, expected, first differing) {wrong}",
                      busy[kind][-1], cpu[kind][-1], flush=True)
    finally:
        cluster.close()
    report(args, run.finish(), devices, names, profiles, plans, measured, exact, busy, cpu)


def emulated_devices(args) -> list[Device]:
    return [Device("laptop", roofline=args.laptop, memory=args.laptop_memory),
            *(Device(f"phone{i}", roofline=args.phone, memory=args.phone_memory) for i in range(1, args.phones + 1))]


def roofline_profiles(manifest, devices: list[Device], priced_as_roofline: bool = False):
    """(model, devices, network) as the coordinator would measure these rooflines, with no cluster:
    the join calibration worked out (1-row steps on the 1- and 4-layer ranges fitted to speed and
    overhead; the 4-layer range at 1 and 8 rows gives ``row_speed``), loopback links. Unit costs
    are the import's (this box's seconds per unit), as the coordinator's; ``priced_as_roofline``
    makes each unit cost its matrix-product bytes instead (what the emulated devices charge), so
    a plan can be priced as the devices will run it."""
    profile = ClusterProfile(manifest)
    model = profile.model_profile()
    if priced_as_roofline:
        units = tuple(replace(u, cost=0.0 if manifest.units[u.index].kind == "embedding" else u.weight_bytes * 1e-9) for u in model.units)
        model = replace(model, units=units)
    layers = [u.index for u in manifest.units if u.kind == "layer"]
    short, long = (layers[0], layers[0] + 1), (layers[0], layers[3] + 1)
    matmul_bytes = lambda a, b: sum(u.weight_bytes for u in model.units[a:b])  # no embedding in a layer range
    cost = lambda a, b: sum(u.cost for u in model.units[a:b])
    out = []
    for d in devices:
        roofline = RooflinePolicy.parse(d.roofline)
        fit = fit_speed_overhead([(cost(*r), roofline.step_s(matmul_bytes(*r), 1)) for r in (short, long) for _ in range(4)], warmup=0)
        one, eight = roofline.step_s(matmul_bytes(*long), 1), roofline.step_s(matmul_bytes(*long), 8)
        out.append(DeviceProfile(id=d.name, memory_bytes=parse_bytes(d.memory), speed=fit.speed, overhead_s=fit.overhead_s, emulated=True,
                                 row_speed=cost(*long) / ((eight - one) / 7) if eight > one else None))
    return model, out, NetworkProfile((), LinkProfile("*", "*", 2e-4, 1e9))


def predict_plans(args) -> None:
    """The planner's two plans for the ``--laptop``/``--phone`` rooflines (``roofline_profiles``),
    and both plans priced as the emulated devices run them (unit costs in matmul bytes)."""
    manifest = package_of(args).manifest
    devices = emulated_devices(args)
    as_measured, as_run = roofline_profiles(manifest, devices), roofline_profiles(manifest, devices, priced_as_roofline=True)
    found = {}
    for profiles, label in ((as_measured, "unit costs as imported (the coordinator's)"), (as_run, "unit costs = matmul bytes (the roofline's)")):
        for replicas in (True, False):
            best = plan(*profiles, PlanRequest(objective=Objective.THROUGHPUT, sequences=args.streams, replicas=replicas)).best
            if not best.complete:
                raise SystemExit(f"no complete plan (replicas={replicas}): {best.reason}")
            found[(label, replicas)] = best
            priced = evaluate(best.stages, *as_run, PlanRequest(objective=Objective.THROUGHPUT, sequences=args.streams, replicas=replicas))
            shown = " · ".join(f"{'+'.join(s.device_ids)}[{s.start},{s.end})" for s in best.stages)
            print(f"{label}, {'replicated' if replicas else 'no replicas'}: {shown}: predicted {best.predicted.throughput_tok_s:.2f} tok/s, "
                  f"as the rooflines run it {priced.throughput_tok_s:.2f}")
        ratio = found[(label, True)].predicted.throughput_tok_s / found[(label, False)].predicted.throughput_tok_s
        print(f"  replicated / no replicas, {label}: {ratio:.2f}x")


def real_plans(args) -> None:
    """The planner's throughput plans, with and without replicas, for ``args.real`` un-emulated workers."""
    pkg = package_of(args)
    prewarm(pkg)
    cluster = Cluster("replicas-real", [Device(f"box{i}") for i in range(1, args.real + 1)],
                      args=(*serve_model_args(args), "--batch-invariant", "--max-active", str(args.streams), "--no-prefix-cache"))
    try:
        cluster.wait_up()
        names = cluster.names()
        given = measured_profiles(cluster, package=pkg)
        for kind in ("replicated", "no replicas"):
            stages, predicted = planned(given, args.streams, kind == "replicated")
            shown = " · ".join(f"{names.get(s['worker'], s['worker'])}[{s['start']},{s['end']})" for s in stages)
            print(f"{kind}: {shown} (predicted {predicted:.1f} tok/s)")
        print({w["name"]: w.get("profile") for w in cluster.status()["workers"]})
    finally:
        cluster.close()


def busy_share(before: dict, after: dict, wall_s: float, names: dict) -> dict[str, float]:
    """Per device: the share of the wall time its stage computed (emulated waiting included)."""
    out = {}
    for key, value in after.items():
        if key.startswith("edgepipe_stage_compute_seconds_sum|"):
            worker = key.split("|", 1)[1]
            out[names.get(worker, worker)] = round((value - before.get(key, 0.0)) / wall_s, 2)
    return out


def report(args, run: Conditions, devices, names, profiles, plans, measured, exact, busy, cpu) -> None:
    def fmt(stages):
        groups: dict[tuple, list[str]] = {}
        for s in stages:
            groups.setdefault((s["start"], s["end"]), []).append(names.get(s["worker"], s["worker"]))
        return " · ".join(f"{'+'.join(ws)}[{a},{b})" for (a, b), ws in groups.items())

    def shares(d: dict) -> str:
        return ", ".join(f"{n} {v:.0%}" for n, v in sorted(d.items()) if v >= 0.005)

    med = {k: statistics.median(v) for k, v in measured.items()}
    ratio = med["replicated"] / med["no replicas"]
    command = (f"python -m benchmarks.replicas --tokens {args.tokens} --streams {args.streams} --rounds {args.rounds} "
               f"--phones {args.phones} --laptop {args.laptop} --phone {args.phone} --laptop-memory {args.laptop_memory} "
               f"--phone-memory {args.phone_memory}" + (f" --model {args.model} --precision {args.precision}" if args.model else ""))
    stem = f"replicas-{Path(args.model).stem}" if args.model else "replicas"
    lines = header("Replicated stages vs the best plan without replicas (roofline-emulated devices)", run,
                   f"{args.streams} concurrent greedy streams x {args.tokens} tokens, `--batch-invariant`, `--no-prefix-cache`",
                   *([f"`{Path(args.model).name}` at `--precision {args.precision}`"] if args.model else []))
    lines += ["Planner input: the profiles **the coordinator measured** (its join calibration: steps at 1 row on a 1- and a "
              "4-layer range, and at 8 rows on the 4-layer one, which gives each device's cost per further row, `row_speed`).", "",
              "Devices: " + "; ".join(f"`{d.name}` {d.label()}" for d in devices) + ". As the coordinator measured them: "
              + "; ".join(f"`{n}` speed {p['speed']:g}, overhead {p['overhead_ms']:g} ms, row speed {p.get('row_speed')}"
                          for n, p in profiles.items() if p), "",
              "| plan (planner, throughput objective, 16 sequences) | stages | predicted tok/s | measured tok/s (each round) | "
              "median | busy share, emulated (last round) | CPU share, real compute (last round) | tokens = solo reference |",
              "|---|---|---|---|---|---|---|---|"]
    for kind, (stages, predicted) in plans.items():
        lines.append(f"| {kind} | {fmt(stages)} | {predicted:.1f} | {', '.join(f'{x:.1f}' for x in measured[kind])} | "
                     f"{med[kind]:.1f} | {shares(busy[kind][-1])} | {shares(cpu[kind][-1])} | "
                     f"{'yes, every stream' if exact[kind] else 'NO'} |")
    lines += ["", f"**Replicated / no replicas: {ratio:.2f}x** (median aggregate tokens/s, prompts' prefill included; goal >= 1.3x). "
                  "Rounds alternate the order of the two plans; each plan is deployed with `/v1/cluster/rebalance` (pinned) on the "
                  "same cluster.", "", f"Rerun: `{command}`"]
    text = "\n".join(lines)
    print(text)
    results = RESULTS.with_name(f"{stem}.md")
    earlier = results.read_text().partition(EARLIER)[2] if results.exists() else ""  # older runs stay below the new one
    if earlier:
        text += "\n\n" + EARLIER + earlier
    write_results(stem, {**run.as_dict(), "args": vars(args), "profiles": profiles, "plans": {k: v[0] for k, v in plans.items()},
                               "predicted_tok_s": {k: v[1] for k, v in plans.items()}, "measured_tok_s": measured, "busy_share": busy,
                               "cpu_share": cpu, "exact": exact, "ratio": ratio}, text)


if __name__ == "__main__":
    main()
