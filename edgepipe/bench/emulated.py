"""Measuring emulated clusters (``cluster.Cluster``) side by side: what a coordinator measured,
read back as planner profiles; the cost model's view of any placement; requests interleaved
between clusters and their medians; the header every emulated-cluster report starts with.

Used by ``benchmarks/placement.py``, ``predict.py`` and ``energy.py``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

from ..cluster.state.placement import proportional_split
from ..cluster.rules.profiling import ClusterProfile
from ..net.messages import Hello
from ..plan import DeviceProfile, LinkProfile, NetworkProfile, PlanRequest, Stage, evaluate
from .cluster import Cluster, bench_home
from .machine import Conditions

BLIND_BANDWIDTH = 1e12  # bytes/s: "bandwidth ignored"


BUNDLED_MODEL_LINE = "SmolLM2-135M-Instruct, the file's own Q4_1 (`serve`'s default)"


def header(title: str, run: Conditions, conditions: str, model_line: str = BUNDLED_MODEL_LINE) -> list[str]:
    """The title, the machine line and the EMULATION notice of an emulated-cluster report."""
    return [f"# {title}", "", f"{run.line()} · {model_line} · {conditions}", "",
            "**All devices are EMULATED** on this one machine: worker processes on loopback; `slowdown F` = the worker "
            "waits (F-1) x its measured compute time after each call; `roofline R GFLOP/s, B/s, o ms` = each call lasts "
            "o + max(stage weight bytes / B, rows x 2 x stage parameters / R) (the worker waits out the rest after its real "
            "compute); `memory` = a hard budget the worker refuses to "
            "exceed; links as labelled (`tbf` = kernel token bucket in a network namespace; `user-space` = the "
            "worker's own send shaper).", ""]


# -- what the coordinator measured, as planner profiles ---------------------------------------
_MANIFEST = None


def manifest(package=None):
    """``package``'s manifest, else the bundled package's in the bench home (loaded once)."""
    global _MANIFEST
    if package is not None:
        return package.manifest
    if _MANIFEST is None:
        from ..model.store import resolve

        _MANIFEST = resolve(home=bench_home()).manifest
    return _MANIFEST


def sample_rtts(cluster: Cluster, samples: int = 6, gap_s: float = 0.55) -> dict[str, float]:
    """Median of the heartbeat RTTs the status page shows (one new sample per 0.5 s heartbeat)."""
    seen: dict[str, list[float]] = {}
    for _ in range(samples):
        for w in cluster.status()["workers"]:
            if w.get("rtt_ms") is not None:
                seen.setdefault(w["id"], []).append(w["rtt_ms"] / 1e3)
        time.sleep(gap_s)
    return {k: statistics.median(v) for k, v in seen.items()}


def calibrations(cluster: Cluster) -> dict[str, dict]:
    return {e["worker"]: e for e in cluster.events() if e["kind"] == "calibrated"}


def measured_profiles(cluster: Cluster, rtts: dict[str, float] | None = None, speeds: dict[str, float] | None = None,
                      power: dict[str, tuple[float, float]] | None = None, memory: dict[str, int] | None = None, package=None):
    """(model, devices, network) as the coordinator's ``ClusterProfile`` builds them, from the
    ``calibrated`` events (speed, overhead, uplink), the status page (memory, RTT) and optional
    overrides (refined ``speeds``, declared ``power`` by device name, ``memory`` by name)."""
    status = cluster.status()
    prof = ClusterProfile(manifest(package))
    cal = calibrations(cluster)
    rtts = rtts if rtts is not None else sample_rtts(cluster, 3)
    workers = []
    for w in status["workers"]:
        m = prof.of(w["id"])
        c = cal.get(w["id"], {})
        # the coordinator's current figures (refined by its stage timings and steps), else the join calibration
        live = w.get("profile") or {}
        m.speed = (speeds or {}).get(w["id"], live.get("speed") or c.get("speed", 1.0))
        m.overhead_s = (live.get("overhead_ms") if live.get("speed") else c.get("overhead_ms", 0.0)) / 1e3
        m.row_speed = live.get("row_speed")
        m.bandwidth_bytes_per_s = (c.get("uplink_mb_s") or 0) * 1e6 or None
        if w["id"] in rtts:
            m.rtt = m.rtt.push(rtts[w["id"]])
        busy, idle = (power or {}).get(w["name"], (None, None))
        mem = (memory or {}).get(w["name"], w["memory_bytes"])
        hello = Hello.from_fields({"name": w["name"], "kind": w.get("kind", "native"), "memory_bytes": mem,
                                   # the status lists the budget apart from the emulation (a --memory budget is no emulation)
                                   "emulation": {**(w.get("emulation") or {}), **({"memory_budget": w["memory_budget"]} if w.get("memory_budget") else {})} or None,
                                   "device": w.get("device"), "adapter": w.get("adapter"), "power_busy_w": busy, "power_idle_w": idle})
        workers.append(SimpleNamespace(id=w["id"], hello=hello, memory_bytes=mem, relay=hello.relay))
    return prof.model_profile(), prof.device_profiles(workers), prof.network_profile(workers)


def blind(network: NetworkProfile) -> NetworkProfile:
    """The same network with bandwidth ignored (every link 1e12 B/s, RTTs kept)."""
    links = tuple(LinkProfile(x.src, x.dst, x.rtt_s, BLIND_BANDWIDTH) for x in network.links)
    return NetworkProfile(links, LinkProfile("*", "*", network.default.rtt_s, BLIND_BANDWIDTH))


def predict(stages: list[tuple[str, int, int]], model, devices, network, request: PlanRequest | None = None):
    """The cost model's prediction for stages given as (worker id, start, end)."""
    return evaluate([Stage((w,), s, e) for w, s, e in stages], model, devices, network, request or PlanRequest())


def relaxed(devices: list[DeviceProfile]) -> list[DeviceProfile]:
    """Devices with memory no object (a baseline's servers declare whatever its split needs)."""
    return [replace(d, memory_bytes=1 << 40) for d in devices]


def best_equal_order(model, devices, network) -> tuple[list[str], float]:
    """The device order for which the cost model likes an equal layer split best (seed 000
    "reuse the partitioning algorithm to evaluate worker orderings")."""
    best = None
    ids = [d.id for d in devices]
    for perm in itertools.permutations(ids):
        st = [(a.worker_id, a.start, a.end) for a in proportional_split(model.n_units, [(w, 1.0) for w in perm])]
        t = predict(st, model, relaxed(devices), network).tpot_s
        if best is None or t < best[1] - 1e-12:
            best = (list(perm), t)
    return best


def prewarm(package=None) -> int:
    """Put every unit file of the package in the workers' shared cache (as if each emulated
    device had fetched it before), so that a device behind a slow link does not spend minutes
    downloading; returns the number of files added."""
    from ..model.store import resolve

    home = bench_home()
    pkg = package or resolve(home=home)
    cache = home / "worker-cache"
    cache.mkdir(parents=True, exist_ok=True)
    added = 0
    for src in pkg.blobs.iterdir():
        dst = cache / src.name
        if len(src.name) == 64 and not dst.exists():
            try:
                os.link(src, dst)
            except OSError:
                dst.write_bytes(src.read_bytes())
            added += 1
    return added


def forced_memory(counts: list[int], per_unit_mb: int = 40) -> list[str]:
    """Declared memory that makes ``--placement memory`` cut exactly these unit counts."""
    return [f"{c * per_unit_mb}MB" for c in counts]


# -- measuring side by side -------------------------------------------------------------------
def interleave(clusters: dict[str, Cluster], rounds: int, tokens: int, warmup: int = 16) -> dict[str, list[dict]]:
    """``rounds`` requests per cluster, alternating clusters (order rotated every round)."""
    for c in clusters.values():
        c.request(warmup)
    out: dict[str, list[dict]] = {k: [] for k in clusters}
    keys = list(clusters)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[: r % len(keys)]:
            out[k].append(clusters[k].request(tokens))
    return out


def summary(samples: list[dict], names: dict[str, str] | None = None) -> dict:
    """Medians (and every sample) of decode tok/s, TPOT and per-device stage compute."""
    tps = [s["decode_tok_s"] for s in samples]
    compute: dict[str, list[float]] = {}
    for s in samples:
        for w, v in s["stage_compute_s"].items():
            compute.setdefault((names or {}).get(w, w), []).append(v)
    return {"stage_compute_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in compute.items()},
            "decode_tok_s_median": statistics.median(tps), "decode_tok_s_all": [round(x, 2) for x in tps],
            "tpot_ms_median": 1e3 * statistics.median(s["tpot_s"] for s in samples),
            "tpot_ms_all": [round(1e3 * s["tpot_s"], 2) for s in samples]}


def paired_ratio(a: list[dict], b: list[dict]) -> float:
    """Median over rounds of tok/s(a) / tok/s(b) (each round measured a and b back to back)."""
    return statistics.median(x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(a, b))


def fmt_stages(stages) -> str:
    return " · ".join(f"{n}[{s},{e})" for n, s, e in stages)
