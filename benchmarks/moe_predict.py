"""The planner on MoE packages: predicted against measured decode step times at 1 to 8 rows.

    python benchmarks/moe_predict.py            # upcycled SmolLM2 (4 experts, top 2) and a 4-layer Qwen3-30B-A3B shape (128, top 8)
    python benchmarks/moe_predict.py --quick    # fewer timed steps

Writes `benchmarks/results/moe_predict.json` and `.md` (`moe_predict-quick.*` for `--quick`).

Per package, in this one process (its kernel form, the form a CPU worker here is sent):

1. **Calibration, as a joining worker's** (``cluster/shells/calibration.py``): decode steps of a 1-layer
   and a 4-layer range after a 32-position prefill of random inputs (``PROBE_REPS`` each, the first
   two dropped) give speed and per-call overhead (``ClusterProfile.calibrated``); the 4-layer range
   at 1 row and at ``ROW_PROBE`` rows stepped together gives the price of a further row
   (``ClusterProfile.rows_timed``, which takes off the further experts those rows read).
2. **Prediction, as the planner's** (``DeviceProfile.token_share`` on the whole model as one
   stage): ``overhead + cost / speed + (S - 1) * cost / row_speed + extra(S) / speed`` for a step of S
   rows, ``extra`` the further experts a batch reads (``plan.moe``: ``E * (1 - (1 - k/E)^S)`` experts
   in all). Beside it the same with the MoE terms dropped (every unit priced as a dense one:
   what the planner predicted before it knew MoE).
3. **Measured**: the whole model as one stage, S of 8 chat prompts prefilled, then greedy decode
   steps of those S sequences stepped together; the median step.

Errors are (predicted - measured) / measured. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from edgepipe.bench.machine import Conditions, package_version as version
from edgepipe.bench.results import write_results
from edgepipe.cluster.rules.calibration_rules import PROBE_REPS, ROW_PROBE, ROW_REPS
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.model.store import bundled_gguf, local_form, resolve
from edgepipe.plan import DeviceProfile
from edgepipe.plan.moe import experts_touched, range_extra_cost
from edgepipe.runtime.stage_runner import SamplingBatch

PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Write one line about the sea.", "Say hi.", "List two planets.",
           "Who wrote Hamlet?", "Describe snow in five words.", "Give me a colour."]
ROWS = (1, 2, 4, 8)


def probe(runner, rows: int, reps: int, hidden: int, rng) -> list[float]:
    """The worker's timing probe (``worker/runners.py``): ``rows`` sequences after a 32-position
    prefill of random inputs, then ``reps`` steps of them together; every step's seconds."""
    make = (lambda b, n: rng.integers(0, 1000, (b, n))) if runner.takes_token_ids else (
        lambda b, n: rng.standard_normal((b, n, hidden)).astype(np.float32))
    seqs = [f"probe-{i}" for i in range(rows)]
    for s in seqs:
        runner.run(s, make(1, 32), SamplingBatch.greedy(1) if runner.emits_tokens else None)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.run_batch(seqs, make(rows, 1), SamplingBatch.greedy(rows) if runner.emits_tokens else None)
        times.append(time.perf_counter() - t0)
    for s in seqs:
        runner.drop(s)
    return times


def calibrate(pkg, precision: str, threads: int, rng) -> ClusterProfile:
    m = pkg.manifest
    layers = [u.index for u in m.units if u.kind == "layer"]
    start, end = layers[0], layers[min(3, len(layers) - 1)] + 1
    profile = ClusterProfile(m)
    hidden = int(m.config["hidden_size"])
    samples = []
    for a, b in ((start, start + 1), (start, end)):
        runner = pkg.runner(a, b, precision, threads=threads)
        samples += [(profile.unit_cost(a, b), t) for t in probe(runner, 1, PROBE_REPS, hidden, rng)[2:]]
    profile.calibrated("w", samples)
    runner = pkg.runner(start, end, precision, threads=threads)
    single, batched = (statistics.median(probe(runner, r, ROW_REPS, hidden, rng)[2:]) for r in (1, ROW_PROBE))
    profile.rows_timed("w", start, end, ROW_PROBE, single, batched)
    return profile


def dense_priced(pkg) -> ClusterProfile:
    """A profile of the same package with its MoE marks removed: every unit priced as a dense one."""
    units = tuple(dataclasses.replace(u, experts=0, experts_used=0) for u in pkg.manifest.units)
    return ClusterProfile(dataclasses.replace(pkg.manifest, units=units))


def predictions(profile: ClusterProfile, speed: float, overhead_s: float, row_speed: float) -> dict[int, float]:
    model = profile.model_profile()
    n = len(model.units)
    cost = profile.unit_cost(0, n)
    device = DeviceProfile("w", memory_bytes=10**12, speed=speed, overhead_s=overhead_s, row_speed=row_speed)
    return {s: device.token_share(cost, s, 1, lambda rows: range_extra_cost(model, 0, n, rows)) * s for s in ROWS}


def measured(pkg, precision: str, threads: int, steps: int) -> dict[int, dict]:
    tok = pkg.tokenizer
    runner = pkg.runner(0, len(pkg.manifest.units), precision, threads=threads)
    out = {}
    for s in ROWS:
        seqs = [f"m{s}-{i}" for i in range(s)]
        last = [int(runner.run(q, np.array([tok.encode(tok.format_chat([{"role": "user", "content": p}]))]), SamplingBatch.greedy(1))[0])
                for q, p in zip(seqs, PROMPTS)]
        times = []
        for _ in range(steps + 2):
            t0 = time.perf_counter()
            last = [int(t) for t in runner.run_batch(seqs, np.array(last)[:, None], SamplingBatch.greedy(s))]
            times.append(time.perf_counter() - t0)
        for q in seqs:
            runner.drop(q)
        out[s] = {"median_s": statistics.median(times[2:]), "steps": steps}
    return out


def run_package(name: str, path: Path, home: Path, threads: int, steps: int, rng) -> dict:
    pkg = resolve(str(path), "gguf", home)
    precision = local_form(pkg)
    m = pkg.manifest
    moe_units = [u for u in m.units if u.experts]
    print(f"\n== {name}: {len(m.units)} units, {len(moe_units)} MoE layers ({moe_units[0].experts} experts, top {moe_units[0].experts_used}); "
          f"form {precision}", flush=True)
    t0 = time.perf_counter()
    profile = calibrate(pkg, precision, threads, rng)
    d = profile.of("w")
    print(f"  calibrated in {time.perf_counter() - t0:.0f} s: speed {d.speed:.4g}, overhead {d.overhead_s * 1e3:.2f} ms, row_speed {d.row_speed:.4g}", flush=True)
    moe_pred = predictions(profile, d.speed, d.overhead_s, d.row_speed)
    # the dense pricing: the same probes, the row price fitted with nothing taken off
    dense = dense_priced(pkg)
    dense.of("w").speed, dense.of("w").overhead_s = d.speed, d.overhead_s
    layers = [u.index for u in m.units if u.kind == "layer"]
    start, end = layers[0], layers[min(3, len(layers) - 1)] + 1
    experts_s = range_extra_cost(profile.model_profile(), start, end, ROW_PROBE) / d.speed
    per_row = profile.unit_cost(start, end) / d.row_speed
    dense_row_speed = dense.unit_cost(start, end) / (per_row + experts_s / (ROW_PROBE - 1))
    dense_pred = predictions(dense, d.speed, d.overhead_s, dense_row_speed)
    meas = measured(pkg, precision, threads, steps)
    u = moe_units[0]
    rows = []
    for s in ROWS:
        got = meas[s]["median_s"]
        rows.append({"rows": s, "measured_ms": round(got * 1e3, 2), "predicted_ms": round(moe_pred[s] * 1e3, 2),
                     "error": round((moe_pred[s] - got) / got, 3), "dense_priced_ms": round(dense_pred[s] * 1e3, 2),
                     "dense_priced_error": round((dense_pred[s] - got) / got, 3),
                     "experts_read_per_layer": round(experts_touched(u.experts, u.experts_used, s), 2)})
        print(f"  {s} row(s): measured {got * 1e3:.2f} ms, predicted {moe_pred[s] * 1e3:.2f} ms ({rows[-1]['error']:+.1%}), "
              f"dense-priced {dense_pred[s] * 1e3:.2f} ms ({rows[-1]['dense_priced_error']:+.1%})", flush=True)
    return {"package": name, "units": len(m.units), "moe_layers": len(moe_units), "experts": u.experts, "experts_used": u.experts_used,
            "form": precision, "threads": threads, "speed": d.speed, "overhead_ms": round(d.overhead_s * 1e3, 3), "row_speed": d.row_speed,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 timed steps per row count (default 24)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--qwen-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (default 4; 0: skip it)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    from edgepipe.bench.arch_files import write_arch_gguf
    from edgepipe.bench.moe_files import upcycle

    run, started = Conditions.start(), time.time()
    rng = np.random.default_rng(0)
    steps = 8 if args.quick else 24
    with tempfile.TemporaryDirectory(prefix="edgepipe-moe-predict-") as tmp:
        work = Path(tmp)
        files = {"smollm2-upcycled (4 experts, top 2, random router)": upcycle(bundled_gguf(), work / "smollm2-moe.gguf", seed=1)}
        if args.qwen_layers:
            path = work / "qwen3-30b-a3b-shape.gguf"
            write_arch_gguf(path, "qwen3-30b-a3b", bundled_gguf(), args.qwen_layers)
            files[f"qwen3-30b-a3b shape, {args.qwen_layers} layers (128 experts, top 8)"] = path
        results = [run_package(name, path, work / "home", args.threads, steps, rng) for name, path in files.items()]
    report = {"quick": args.quick, **run.finish().as_dict(), "elapsed_s": round(time.time() - started),
              "versions": {d: version(d) for d in ("edgepipe", "onnxruntime", "numpy")}, "packages": results,
              "command": "python benchmarks/moe_predict.py" + (" --quick" if args.quick else "")}
    written = write_results("moe_predict-quick" if args.quick else "moe_predict", report, markdown(report), args.out)
    print("\n" + markdown(report))
    print(f"wrote {' and '.join(map(str, written))}")


def markdown(report: dict) -> str:
    lines = ["# The planner on MoE packages: predicted vs measured decode steps", "",
             f"- date: {report['date']}; produced by `{report['command']}` in {report['elapsed_s']} s",
             f"- {Conditions.from_dict(report).line()} (timings: valid on a quiet machine only)",
             "- calibration as a joining worker's (1- and 4-layer probes, 8 rows stepped together); prediction `DeviceProfile.token_share` "
             "on the whole model as one stage; measured: the median decode step of S real chat sequences stepped together", ""]
    for p in report["packages"]:
        lines += [f"## {p['package']}", "", f"{p['units']} units, {p['moe_layers']} MoE layers, form `{p['form']}`, {p['threads']} threads; "
                  f"calibrated overhead {p['overhead_ms']} ms/call.", "",
                  "| rows | experts read per layer (formula) | measured ms | predicted ms | error | dense-priced ms | dense-priced error |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['rows']} | {r['experts_read_per_layer']} | {r['measured_ms']} | {r['predicted_ms']} | {r['error']:+.1%} | "
                  f"{r['dense_priced_ms']} | {r['dense_priced_error']:+.1%} |" for r in p["rows"]]
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
