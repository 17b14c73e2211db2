"""Placement benchmark: the planner's placement vs an equal layer split and vs a split in
proportion to memory (how exo and llama.cpp place layers), measured side by side.

    python benchmarks/placement.py [--quick] [--rounds 5] [--tokens 64] [--only 3,5,link]

Everything here is EMULATED on one 2-core machine: every device is an ``edgepipe worker``
process on loopback with ``--slowdown F`` (it waits (F-1) x its compute time after each call)
and ``--memory`` (a hard budget); the slow link of the link test is a kernel ``tbf`` in a
network namespace (both directions capped, MTU 576 so that a 2.3 KB activation is paced at
the link rate instead of passing in one burst), and for comparison the worker's user-space
``--link-rate`` shaper.

Scenarios:

- ``3`` and ``5``: clusters of 3 and 5 emulated devices, no single one able to hold the model
  (so the planner must pipeline), the slowest one declaring the most memory (so the memory
  rule is misled). Three servers run at once: ``--placement planner``; an equal layer split
  (workers declaring equal memory under ``--placement memory``, joined in the device order the
  cost model likes best for an equal split, as seed 000 did); and ``--placement memory`` with
  the devices' memory, joined largest memory first (exo's ring order). Requests alternate
  between them (rotating A B C / B C A / ...); medians and ratios are reported.
- ``link``: a fast device behind a 128 KB/s link among slow ones. The planner's placement,
  the placement the pure planner picks from the same measured profiles with every bandwidth
  replaced by 1e12 B/s ("bandwidth-blind", forced on a ``--placement memory`` server by
  declaring memory in proportion to its stage sizes), and that same blind placement with the
  slow link made by the worker's user-space shaper instead of the kernel.

Writes ``benchmarks/results/placement.json`` and ``.md``. The launcher (``Device``, ``Cluster``) is
``edgepipe.bench.cluster``; the helpers shared with ``predict.py`` and ``energy.py``
(``measured_profiles``, ``interleave``...) are ``edgepipe.bench.emulated``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from edgepipe.bench.cluster import Cluster, Device
from edgepipe.bench.emulated import (
    blind,
    best_equal_order,
    calibrations,
    fmt_stages,
    forced_memory,
    header,
    interleave,
    manifest,
    measured_profiles,
    paired_ratio,
    predict,
    prewarm,
    relaxed,
    sample_rtts,
    summary,
)
from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import write_results
from edgepipe.plan import LinkProfile, NetworkProfile, PlanRequest, plan


# -- scenarios ---------------------------------------------------------------------------------
SCENARIOS = {
    "3": [Device("fast", 1.0, "220MB"), Device("mid", 3.0, "180MB"), Device("slow", 6.0, "400MB")],
    "5": [Device("a", 1.0, "200MB"), Device("b", 1.5, "150MB"), Device("c", 2.5, "150MB"),
          Device("d", 4.0, "300MB"), Device("e", 6.0, "500MB")],
}
TARGETS = {"3": 1.46, "5": 1.41}  # seed 000: dynamic vs equal split, 3 and 5 workers


def ids_to_names(stages, names):
    return [(names[w], s, e) for w, s, e in stages]


def run_cluster_scenario(key: str, rounds: int, tokens: int, logdir: Path) -> dict:
    devices = SCENARIOS[key]
    by_name = {d.name: d for d in devices}
    clusters: dict[str, Cluster] = {}
    try:
        planned = clusters["planner"] = Cluster(f"s{key}-planner", devices, ("--placement", "planner"), logdir)
        st = planned.wait_up()
        names = planned.names()
        model, devs, net = measured_profiles(planned, sample_rtts(planned))
        # The baseline's order comes from the true (emulated) slowdowns, not from calibrations.
        nominal = [replace(d, speed=1.0 / by_name[names[d.id]].slowdown) for d in devs]
        order, _ = best_equal_order(model, nominal, net)
        equal_devices = [replace(by_name[names[w]], memory="1GB") for w in order]
        clusters["equal"] = Cluster(f"s{key}-equal", equal_devices, ("--placement", "memory"), logdir)
        clusters["equal"].wait_up()
        mem_devices = sorted(devices, key=lambda d: (-int(d.memory.rstrip("MB")), d.name))  # exo: largest memory first
        clusters["memory"] = Cluster(f"s{key}-memory", mem_devices, ("--placement", "memory"), logdir)
        clusters["memory"].wait_up()
        plans_before = {k: c.stages() for k, c in clusters.items()}
        names_of = {k: c.names() for k, c in clusters.items()}
        # The cost model's view of every placement, on the planner server's calibrations.
        id_of = {n: w for w, n in names.items()}
        predicted = {"planner": st["plan"]["predicted"]["tpot_s"]}
        for k in ("equal", "memory"):
            stages = [(id_of[n], s, e) for n, s, e in plans_before[k]]
            predicted[k] = predict(stages, model, relaxed(devs), net).tpot_s
        samples = interleave(clusters, rounds, tokens)
        plans_after = {k: c.stages() for k, c in clusters.items()}
        replans = sum(1 for e in planned.events() if e["kind"] == "up") - 1
        cal = {names[w]: {"speed": e["speed"], "overhead_ms": e["overhead_ms"], "uplink_mb_s": e["uplink_mb_s"]}
               for w, e in calibrations(planned).items()}
    finally:
        for c in clusters.values():
            c.close()
    rows = {k: {**summary(v, names_of[k]), "stages_before": plans_before[k], "stages_after": plans_after[k],
                "predicted_tpot_ms": 1e3 * predicted[k]} for k, v in samples.items()}
    for k in rows:
        rows[k]["vs_equal_paired"] = paired_ratio(samples[k], samples["equal"])
        rows[k]["vs_equal_medians"] = rows[k]["decode_tok_s_median"] / rows["equal"]["decode_tok_s_median"]
        rows[k]["vs_memory_paired"] = paired_ratio(samples[k], samples["memory"])
    # Speed each device really had (cost of its range / median measured stage compute), per server.
    costs = lambda s, e: sum(u.cost_s for u in manifest().units[s:e])  # noqa: E731
    implied = {k: {n: round(costs(s, e) / (rows[k]["stage_compute_ms_median"][n] / 1e3), 3)
                   for n, s, e in rows[k]["stages_after"] if n in rows[k]["stage_compute_ms_median"]} for k in rows}
    ratio = rows["planner"]["vs_equal_paired"]
    return {"devices": [{"name": d.name, "label": d.label()} for d in devices], "calibrated": cal, "implied_speed": implied,
            "rows": rows, "planner_replans_during_run": replans, "target_vs_equal": TARGETS[key],
            "met": ratio >= TARGETS[key], "rounds": rounds, "tokens": tokens,
            "predicted_ratio_vs_equal": predicted["equal"] / predicted["planner"]}


# fastL is fast but sits behind a 128 KB/s link and has room for 3 layers only (neither the
# embedding nor the head fits), so any stage on it sends a 2.3 KB activation per token.
LINK_DEVICES = [Device("A", 1.0, "220MB"), Device("S", 8.0, "400MB"),
                Device("fastL", 1.0, "85MB", kernel_rate="128KB/s")]


def with_uplink(network: NetworkProfile, worker_id: str, bandwidth: float) -> NetworkProfile:
    """``network`` with every link that touches ``worker_id`` capped at ``bandwidth`` (star model)."""
    links = tuple(LinkProfile(x.src, x.dst, x.rtt_s, min(x.bandwidth_bytes_per_s, bandwidth))
                  if worker_id in (x.src, x.dst) else x for x in network.links)
    return NetworkProfile(links, network.default)


def run_link_scenario(rounds: int, tokens: int, logdir: Path) -> dict:
    """A fast device behind a 128 KB/s link: avoided by the planner, chosen when bandwidth is ignored."""
    clusters: dict[str, Cluster] = {}
    by_name = {d.name: d for d in LINK_DEVICES}
    try:
        planned = clusters["planner-server"] = Cluster("link-planner", LINK_DEVICES, ("--placement", "planner"), logdir)
        st = planned.wait_up()
        names = planned.names()
        id_of = {n: w for w, n in names.items()}
        fast_id = id_of["fastL"]
        rtts = sample_rtts(planned)
        model, devs, net = measured_profiles(planned, rtts)
        uplink = planned.links[0].measure_uplink()
        fixed = with_uplink(net, fast_id, uplink)  # the coordinator's profile with fastL's uplink as measured here
        server_stages = [(w["worker"], w["start"], w["end"]) for w in st["plan"]["stages"]]
        aware = plan(model, devs, fixed, PlanRequest()).best
        ignoring = plan(model, devs, blind(net), PlanRequest()).best
        aware_stages = [(s.device_ids[0], s.start, s.end) for s in aware.stages]
        blind_stages = [(s.device_ids[0], s.start, s.end) for s in ignoring.stages]
        uses = lambda stages: fast_id in {w for w, _, _ in stages}  # noqa: E731
        result = {
            "devices": [{"name": d.name, "label": d.label()} for d in LINK_DEVICES],
            "calibrated": {names[w]: {"speed": e["speed"], "overhead_ms": e["overhead_ms"], "uplink_mb_s": e["uplink_mb_s"]}
                           for w, e in calibrations(planned).items()},
            "rtt_ms": {names[w]: round(v * 1e3, 2) for w, v in rtts.items()},
            "fastL_uplink_measured_by_benchmark_kb_s": round(uplink / 1e3, 1),
            "server_plan": ids_to_names(server_stages, names),
            "server_uses_fastL": uses(server_stages),
            "pure_plan_product_profiles": ids_to_names([(s.device_ids[0], s.start, s.end)
                                                        for s in plan(model, devs, net, PlanRequest()).best.stages], names),
            "pure_plan_bandwidth_aware": ids_to_names(aware_stages, names),
            "aware_uses_fastL": uses(aware_stages),
            "pure_plan_bandwidth_blind": ids_to_names(blind_stages, names),
            "blind_uses_fastL": uses(blind_stages),
            "predicted_ms": {
                "aware placement, bandwidth as measured here": 1e3 * aware.predicted.tpot_s,
                "blind placement, bandwidth as measured here": 1e3 * predict(blind_stages, model, devs, fixed).tpot_s,
                "blind placement, bandwidth ignored": 1e3 * ignoring.predicted.tpot_s,
                "aware placement, bandwidth ignored": 1e3 * predict(aware_stages, model, devs, blind(net)).tpot_s,
            },
        }

        def forced(tag: str, stages, **change) -> Cluster:
            """A ``--placement memory`` server that cuts exactly ``stages`` (memory in proportion)."""
            order = [names[w] for w, _, _ in stages]
            devices = [replace(by_name[n], memory=m) for n, m in zip(order, forced_memory([e - s for _, s, e in stages]))]
            devices = [replace(d, **change) if d.kernel_rate else d for d in devices] if change else devices
            c = Cluster(tag, devices, ("--placement", "memory"), logdir)
            c.wait_up()
            if c.stages() != ids_to_names(stages, names):
                raise RuntimeError(f"{tag}: forced placement came out as {c.stages()}, wanted {ids_to_names(stages, names)}")
            return c
        clusters["aware"] = forced("link-aware", aware_stages)
        if result["blind_uses_fastL"]:
            clusters["blind-tbf"] = forced("link-blind-tbf", blind_stages)
            clusters["blind-userspace"] = forced("link-blind-us", blind_stages, kernel_rate=None, link_rate="128KB/s")
        samples = interleave(clusters, rounds, tokens)
        measured = {k: summary(v, clusters[k].names()) for k, v in samples.items()}
        for k in measured:
            measured[k]["aware_vs_this_paired"] = paired_ratio(samples["aware"], samples[k])
        result["measured"] = measured
        result["server_plan_after"] = planned.stages()
        result["server_uses_fastL_after"] = "fastL" in {n for n, _, _ in result["server_plan_after"]}
        result["met"] = (not result["aware_uses_fastL"]) and result["blind_uses_fastL"] and \
            "blind-tbf" in measured and measured["blind-tbf"]["aware_vs_this_paired"] > 1.0
        # The server's avoidance counts only if its own profile would avoid fastL too (its uplink probe
        # can be off by orders of magnitude; then avoiding fastL is luck of RTTs and calibration).
        result["server_met"] = not result["server_uses_fastL"] and not result["server_uses_fastL_after"] and \
            "fastL" not in {n for n, _, _ in result["pure_plan_product_profiles"]}
        return result
    finally:
        for c in clusters.values():
            c.close()


# -- report ------------------------------------------------------------------------------------
def report(out: dict) -> str:
    lines = header("Placement: planner vs equal split vs memory-proportional (emulated clusters)", Conditions.from_dict(out),
                   f"{out['tokens']} tokens per request, greedy, `ignore_eos`, {out['rounds']} rounds interleaved "
                   f"(order rotated), 1 thread per worker")
    for key in ("3", "5"):
        sc = out["scenarios"].get(key)
        if not sc:
            continue
        lines += [f"## {key} devices", "", "| device | emulation | calibrated speed | overhead ms |", "|---|---|---|---|"]
        for d in sc["devices"]:
            c = sc["calibrated"].get(d["name"], {})
            lines.append(f"| {d['name']} | {d['label']} | {c.get('speed', '')} | {c.get('overhead_ms', '')} |")
        lines += ["", "Speed implied by measured stage compute (cost of the range / median compute per call), per server: " +
                  "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in sc["implied_speed"][k].items()) for k in sc["implied_speed"])]
        lines += ["", "| placement | stages (units [start,end)) | predicted TPOT ms | measured TPOT ms (median) | decode tok/s (median) | "
                  "vs equal (paired median) | vs memory (paired median) |", "|---|---|---|---|---|---|---|"]
        labels = {"planner": "planner", "equal": "equal layer split (best order)", "memory": "memory-proportional (exo order)"}
        for k in ("planner", "equal", "memory"):
            r = sc["rows"][k]
            moved = "" if r["stages_before"] == r["stages_after"] else f" → {fmt_stages(r['stages_after'])}"
            lines.append(f"| {labels[k]} | {fmt_stages(r['stages_before'])}{moved} | {r['predicted_tpot_ms']:.1f} | "
                         f"{r['tpot_ms_median']:.1f} | {r['decode_tok_s_median']:.1f} | {r['vs_equal_paired']:.2f}x | "
                         f"{r['vs_memory_paired']:.2f}x |")
        lines += ["", f"Goal: planner ≥ {sc['target_vs_equal']}x the equal split → **{'met' if sc['met'] else 'NOT met'}** "
                  f"({sc['rows']['planner']['vs_equal_paired']:.2f}x measured; cost model predicted "
                  f"{sc['predicted_ratio_vs_equal']:.2f}x). Planner re-plans during the run: {sc['planner_replans_during_run']}.", ""]
    lk = out["scenarios"].get("link")
    if lk:
        lines += ["## A fast device behind a 128 KB/s link", "",
                  "| device | emulation | calibrated speed | calibrated uplink MB/s | heartbeat RTT ms |", "|---|---|---|---|---|"]
        for d in lk["devices"]:
            c = lk["calibrated"].get(d["name"], {})
            lines.append(f"| {d['name']} | {d['label']} | {c.get('speed', '')} | {c.get('uplink_mb_s', '')} | "
                         f"{lk['rtt_ms'].get(d['name'], '')} |")
        lines += ["", f"fastL's uplink timed by this benchmark through the same namespace link: "
                  f"{lk['fastL_uplink_measured_by_benchmark_kb_s']} KB/s.", "",
                  f"- server (`--placement planner`), first plan: {fmt_stages(lk['server_plan'])}; after the measurement: "
                  f"{fmt_stages(lk['server_plan_after'])} — uses fastL: **{lk['server_uses_fastL']} / {lk['server_uses_fastL_after']}**",
                  f"- pure planner on the coordinator's measured profiles: {fmt_stages(lk['pure_plan_product_profiles'])}",
                  f"- pure planner, same profiles with fastL's uplink as measured here (**aware**): "
                  f"{fmt_stages(lk['pure_plan_bandwidth_aware'])} — uses fastL: **{lk['aware_uses_fastL']}**",
                  f"- pure planner, bandwidth ignored (1e12 B/s, RTTs kept) (**blind**): {fmt_stages(lk['pure_plan_bandwidth_blind'])}"
                  f" — uses fastL: **{lk['blind_uses_fastL']}**", "", "| prediction | TPOT ms |", "|---|---|"]
        for k, v in lk["predicted_ms"].items():
            lines.append(f"| {k} | {v:.1f} |")
        if lk.get("measured"):
            lines += ["", "| placement (measured, interleaved) | TPOT ms (median) | decode tok/s (median) | stage compute ms | aware vs it (paired) |",
                      "|---|---|---|---|---|"]
            for k, r in lk["measured"].items():
                comp = ", ".join(f"{n} {v}" for n, v in r["stage_compute_ms_median"].items())
                lines.append(f"| {k} | {r['tpot_ms_median']:.1f} | {r['decode_tok_s_median']:.1f} | {comp} | {r['aware_vs_this_paired']:.2f}x |")
        lines += ["", f"Goal (planner logic: the 128 KB/s device is avoided, chosen when bandwidth is ignored, and avoiding it is "
                  f"measurably faster) → **{'met' if lk['met'] else 'NOT met'}**. Same goal for the running server as is → "
                  f"**{'met' if lk['server_met'] else 'NOT met'}** (counted only if the pure planner on the coordinator's own profiles avoids "
                  "fastL too; see the calibrated uplinks). "
                  "`aware`, `blind-tbf` and `blind-userspace` are forced placements (`--placement memory`, memory declared in "
                  "proportion to the stage sizes); `blind-userspace` makes the slow link with the worker's `--link-rate 128KB/s` "
                  "instead of the kernel.", ""]
    lines += ["## Notes", ""] + [f"- {n}" for n in out["notes"]]
    return "\n".join(lines) + "\n"


NOTES = [
    "Equal split = 32 units cut 11/10/11-style by `proportional_split` with equal weights (embedding with the first "
    "range, head with the last), devices in the order the cost model predicts best for that split given the devices' "
    "true (emulated) slowdowns (seed 000 also picked the best order; using true speeds keeps calibration noise out of "
    "the baseline).",
    "Memory-proportional = `--placement memory`: unit counts in proportion to declared memory, devices ordered by "
    "memory, largest first (exo's ring order); the slowest device declares the most memory on purpose.",
    "Measured TPOT = the coordinator's decode-step wall time (metrics histogram sum/count); tok/s = client-side "
    "streaming, (chunks - 1) / (last - first chunk). Ratios are medians of per-round ratios (each round runs every "
    "placement back to back).",
    "Predicted TPOT of the baselines is the cost model (`edgepipe.plan.evaluate`) on the planner server's calibrations.",
    "Bandwidth-blind placement is forced on a `--placement memory` server by declaring memory in proportion to its "
    "stage sizes (40 MB per unit) and joining in its order.",
    "Before the run every unit file is linked into the workers' shared cache (`$EDGEPIPE_HOME/worker-cache`), as if "
    "each device had fetched it earlier, so that the 128 KB/s device does not spend minutes downloading.",
    "Servers use a join token: `edgepipe serve` always advertises itself by mDNS, and workers of other jobs on this "
    "host that look for a coordinator joined an unprotected benchmark server during development.",
    "The coordinator's uplink probe (`calibrated` events, column 'calibrated uplink MB/s') reported 7-64 MB/s for the "
    "128 KB/s device and 262144 MB/s (the 1e-6 s floor) for some loopback devices; see the report to the lead.",
    "The kernel link uses MTU 576 and a 600-byte tbf burst so that an activation frame (2.3 KB) is paced at the rate; "
    "the worker's user-space shaper (and `netns.tbf_burst_bytes`) allow a burst of ≥ 15-16 KB, in which a 2.3 KB "
    "frame per token passes without waiting at these token rates.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 24 tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", default="3,5,link", help="comma list of scenarios: 3, 5, link")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens = 2, 24
    logdir = Path(tempfile.mkdtemp(prefix="edgepipe-placement-"))
    run = Conditions.start()
    out = {**run.as_dict(), "rounds": args.rounds, "tokens": args.tokens, "quick": args.quick, "scenarios": {},
           "notes": NOTES, "logs": str(logdir)}
    out["prewarmed_files"] = prewarm()
    t0 = time.monotonic()
    for key in args.only.split(","):
        ts = time.monotonic()
        if key in SCENARIOS:
            out["scenarios"][key] = run_cluster_scenario(key, args.rounds, args.tokens, logdir)
        elif key == "link":
            out["scenarios"]["link"] = run_link_scenario(args.rounds, max(16, args.tokens // 2), logdir)
        else:
            raise SystemExit(f"unknown scenario {key!r}")
        out["scenarios"][key]["wall_s"] = round(time.monotonic() - ts, 1)
        print(f"[{key}] done in {time.monotonic() - ts:.0f} s", file=sys.stderr)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out.update(run.finish().as_dict())
    text = report(out)
    print(text)
    write_results("placement-quick" if args.quick else "placement", out, text)


if __name__ == "__main__":
    main()
