"""Planner benchmark: planning time and plan quality on synthetic heterogeneous pools.

Run `python benchmarks/planner.py`. It prints a table and writes
`benchmarks/results/planner.json` and `benchmarks/results/planner.md`.

Cases (goals from the planner brief):
- 5 devices x 32 units, latency, exact: < 10 ms;
- 10 devices x 64 units, latency, exact subset DP (checked against the MILP optimum): < 100 ms;
- 64 devices x 100 units, latency, annealing: < 1 s, within 2% of the best lower bound
  (the planner's own Lagrangian bound, or the MILP's dual bound within 30 s) or of a long
  annealing search (3 seeds x 20,000 steps).

`planner_bound_ms` is `PlanResult.lower_bound`: the optimum itself for exact searches, the
Lagrangian / relaxed-DP bound for annealing.

`--new-only` (add `--energy-only` to keep the brute-force rows) runs just the issue-16 sections (appended to the same files): every objective
against the independent brute force (`edgepipe.plan.brute`) on 7 devices x 8 units, and the
energy plan's gap to its proven bound on the 64-device pools. Run it under `nice -n 10`.

Devices and links are drawn from a seeded RNG; times are wall-clock (`time.perf_counter`),
median of several runs, on whatever machine runs this.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from edgepipe.bench.machine import Conditions
from edgepipe.bench.results import RESULTS, read_results, write_results
from edgepipe.plan import (
    COORDINATOR,
    DeviceProfile,
    LinkProfile,
    NetworkProfile,
    PlanRequest,
    milp_latency,
    plan,
    transformer_profile,
)

GIB = 1024**3
MIB = 1024**2


def synthetic_model(units: int):
    """A chain of `units` units (embedding, identical layers, a heavier head), ~12 GiB in all,
    so that no single synthetic device holds it and plans need several stages."""
    return transformer_profile(
        f"synthetic-{units}",
        units - 2,
        layer_cost=0.4 / units,
        layer_bytes=(12 * GIB - 500 * MIB) // (units - 2),
        kv_bytes_per_token=16 * 1024,
        hidden_bytes=8192,
        embed_cost=0.0005,
        embed_bytes=250 * MIB,
        head_cost=0.006,
        head_bytes=250 * MIB,
        context_tokens=2048,
    )


def synthetic_pool(devices: int, seed: int):
    """Heterogeneous devices (phones to GPU boxes) and a full mesh of links."""
    rng = random.Random(seed)
    kinds = [
        # name, speed range, memory GiB range, overhead ms, busy W, idle W, relay
        ("phone", (0.2, 0.6), (1, 3), (2, 6), (4, 8), (0.5, 1.5), False),
        ("browser", (0.3, 1.0), (1, 4), (3, 8), (15, 30), (3, 6), True),
        ("laptop", (0.8, 2.0), (4, 10), (1, 3), (15, 45), (2, 6), False),
        ("desktop", (1.5, 4.0), (6, 14), (0.5, 2), (65, 150), (15, 40), False),
        ("gpu", (5.0, 15.0), (4, 12), (0.3, 1), (150, 350), (20, 60), False),
    ]
    pool, access = [], {}
    for index in range(devices):
        name, speed, mem, over, busy, idle, relay = kinds[rng.randrange(len(kinds))]
        device_id = f"{name}{index:02d}"
        pool.append(
            DeviceProfile(
                device_id,
                memory_bytes=int(rng.uniform(*mem) * GIB),
                speed=rng.uniform(*speed),
                overhead_s=rng.uniform(*over) / 1e3,
                power_busy_w=rng.uniform(*busy),
                power_idle_w=rng.uniform(*idle),
                relay=relay,
            )
        )
        access[device_id] = (rng.uniform(0.5, 20) / 1e3, rng.choice([2e6, 12.5e6, 60e6, 125e6]))
    links = []
    for device_id, (rtt, bandwidth) in access.items():
        links.append(LinkProfile(device_id, COORDINATOR, rtt, bandwidth))
    ids = sorted(access)
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            rtt = access[a][0] / 2 + access[b][0] / 2 + rng.uniform(0, 2) / 1e3
            links.append(LinkProfile(a, b, rtt, min(access[a][1], access[b][1])))
    return pool, NetworkProfile(tuple(links))


def timed(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def case(
    name: str, devices: int, units: int, seed: int, request: PlanRequest, goal_s: float, repeats: int, milp: dict
):
    model = synthetic_model(units)
    pool, network = synthetic_pool(devices, seed)
    plan(model, pool, network, request)  # warm imports and caches out of the timing
    result, seconds = timed(lambda: plan(model, pool, network, request), repeats)
    best = result.best.predicted.ring_s
    row = {
        "case": name,
        "devices": devices,
        "units": units,
        "search": result.searched,
        "plan_ms": round(seconds * 1e3, 2),
        "goal_ms": goal_s * 1e3,
        "meets_goal": seconds < goal_s,
        "ring_ms": round(best * 1e3, 4),
        "stages": len(result.best.stages),
        "planner_bound_ms": round(result.lower_bound * 1e3, 4),
        "proven_optimal": result.optimal,
    }
    bounds = [result.lower_bound]
    if milp:
        start = time.perf_counter()
        answer = milp_latency(model, pool, network, request, **milp)
        row["milp_s"] = round(time.perf_counter() - start, 2)
        row["milp_model"] = "exact (pair flow)" if answer.pair_hops else "separable hop bound"
        row["milp_status"] = answer.status
        row["milp_bound_ms"] = round(answer.lower_bound * 1e3, 4)
        if answer.value is not None:
            row["milp_value_ms"] = round(answer.value * 1e3, 4)
        bounds.append(answer.lower_bound)
    bound = max(bounds)
    row["gap_to_bound_pct"] = round((best / bound - 1) * 100, 3) + 0.0  # no "-0.0" from float noise
    return row, model, pool, network, result


def brute_force_cases(count: int = 3) -> list[dict]:
    """7 devices x 8 units: every objective against edgepipe.plan.brute (own arithmetic).

    Throughput is planned and brute-forced without replicas here; `replica_cases` checks
    replica groups on 7 devices x 6 units (x 8 is beyond an exhaustive search in minutes).
    Energy with 4 sequences is compared with the best plan without replicas (energy plans
    have none)."""
    from edgepipe.plan import objective_value
    from edgepipe.plan.brute import best_values

    rows = []
    for seed in range(count):
        model = synthetic_model(8)
        pool, network = synthetic_pool(7, 100 + seed)
        fast = best_values(model, pool, network, 1)
        target = fast["fastest_tpot"] * 1.5 if fast["latency"] < float("inf") else None
        for objective, sequences, tpot in (
            ("latency", 1, None), ("throughput", 2, None), ("energy", 1, None), ("energy", 1, target),
            ("energy", 4, None), ("energy", 4, "x1.3"),
        ):
            start = time.perf_counter()
            if (sequences, tpot) == (4, None):
                fast4 = best_values(model, pool, network, 4)
            if tpot == "x1.3":  # a target 30% above the fastest time per token with 4 sequences
                tpot = fast4["fastest_tpot"] * 1.3
            request = PlanRequest(objective=objective, sequences=sequences, tpot_target_s=tpot, replicas=False)
            if (sequences, tpot) == (1, None):
                brute = fast
            elif (sequences, tpot) == (4, None):
                brute = fast4
            else:
                brute = best_values(model, pool, network, sequences, tpot)
            brute_s = time.perf_counter() - start
            result, seconds = timed(lambda: plan(model, pool, network, request), 1)
            key = "energy" if objective == "energy" else objective
            if not result.best.complete:
                rows.append({"case": f"7x8 pool {seed}", "objective": objective, "complete": False,
                             "brute_force_finite": brute[key] < float("inf")})
                continue
            got = objective_value(result.best.predicted, request)
            rows.append({
                "case": f"7x8 pool {seed}", "objective": objective + (" +target" if tpot else ""),
                "sequences": sequences, "planner": got, "brute_force": brute[key],
                "gap_pct": round((got / brute[key] - 1) * 100, 6) + 0.0, "proven_optimal": result.optimal,
                "planner_ms": round(seconds * 1e3, 1), "brute_force_s": round(brute_s, 1),
            })
    return rows


def replica_cases(count: int = 2) -> list[dict]:
    """7 devices x 6 units, throughput with replicas of any group (up to S devices), S = 2, 3:
    the planner (exact replica DP up to 7 devices) against edgepipe.plan.brute."""
    from edgepipe.plan import objective_value
    from edgepipe.plan.brute import best_values

    rows = []
    for seed in range(count):
        model = synthetic_model(6)
        pool, network = synthetic_pool(7, 100 + seed)
        for sequences in (2, 3):
            request = PlanRequest(objective="throughput", sequences=sequences)
            start = time.perf_counter()
            brute = best_values(model, pool, network, sequences, max_group=sequences)
            brute_s = time.perf_counter() - start
            result, seconds = timed(lambda: plan(model, pool, network, request), 1)
            got = objective_value(result.best.predicted, request)
            rows.append({
                "case": f"7x6 pool {seed}", "objective": "throughput +replicas", "sequences": sequences,
                "planner": got, "brute_force": brute["throughput"],
                "gap_pct": round((got / brute["throughput"] - 1) * 100, 6) + 0.0, "proven_optimal": result.optimal,
                "replicated_stages": sum(len(s.device_ids) > 1 for s in result.best.stages),
                "planner_ms": round(seconds * 1e3, 1), "brute_force_s": round(brute_s, 1),
            })
    return rows


def energy_64_cases(pools=(3, 4, 5, 6, 7), milp_s: float = 45.0) -> list[dict]:
    """64 devices x 100 units, energy with one sequence: the plan against the planner's own
    proven bound and the energy MILP's dual bound (separable hops, HiGHS, `milp_s` seconds)."""
    from edgepipe.plan import milp_energy

    rows = []
    model = synthetic_model(100)
    for pool_seed in pools:
        pool, network = synthetic_pool(64, pool_seed)
        for tpot in (None, 0.08):
            request = PlanRequest(objective="energy", tpot_target_s=tpot)
            result, seconds = timed(lambda: plan(model, pool, network, request), 1)
            best = result.best
            energy = best.predicted.energy_j_per_token
            start = time.perf_counter()
            answer = milp_energy(model, pool, network, request, pair_hops=False, time_limit_s=milp_s)
            bound = max(b for b in (result.bound, answer.lower_bound) if b is not None)
            rows.append({
                "case": f"64x100 pool {pool_seed}", "target_ms": tpot and tpot * 1e3,
                "j_per_token": round(energy, 5), "meets_target": best.meets_target,
                "planner_bound": None if result.bound is None else round(result.bound, 5),
                "planner_gap_pct": None if result.gap is None else round(result.gap * 100, 3),
                "milp_bound": round(answer.lower_bound, 5), "milp_status": answer.status,
                "milp_s": round(time.perf_counter() - start, 1),
                "milp_plan_j": None if answer.value is None else round(answer.value, 5),
                "gap_pct": round((energy / bound - 1) * 100, 3) + 0.0,
                "plan_ms": round(seconds * 1e3, 1),
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-only", action="store_true", help="only the brute-force and energy sections, appended to the last results")
    ap.add_argument("--energy-only", action="store_true", help="with --new-only: keep the brute-force rows as last measured")
    args = ap.parse_args()
    run = Conditions.start()
    if args.new_only:
        # Only the brute-force and energy sections; the latency table is kept as last measured.
        previous = read_results("planner")
        if previous is None:
            ap.error("--new-only needs an earlier benchmarks/results/planner.json")
        # --energy-only: keep the brute-force rows as last measured (7-device pools are searched
        # exactly, so changes to the annealing energy search do not move them).
        brute = previous["brute_force_7x8"] if args.energy_only else brute_force_cases() + replica_cases()
        energy = energy_64_cases()
        brute_date = previous.get("brute_force_date", previous.get("date")) if args.energy_only else None
        previous.update({"date": run.date, "machine_load": run.finish().line(), "brute_force_7x8": brute, "energy_64x100": energy})
        text = (RESULTS / "planner.md").read_text().split("\n## ")[0].rstrip() + "\n"
        text += f"\n## Every objective vs brute force, 7 devices x 8 units (throughput with replicas: 7 x 6) ({previous['date']}; {previous['machine_load']})\n\n"
        previous["brute_force_date"] = brute_date or previous["date"]
        if brute_date:
            text += f"Brute-force rows as measured {brute_date}; the energy section below re-run {previous['date']}.\n\n"
        text += _md(brute) + "\n"
        worst = max((r["gap_pct"] for r in brute if "gap_pct" in r), default=None)
        text += f"\nWorst gap to the brute force: {worst}%.\n"
        text += ("\n## Energy, 64 devices x 100 units: plan vs proven lower bounds (one sequence)\n\n"
                 "`gap_pct` is against the larger of the planner's own bound and the energy MILP's dual bound "
                 "(separable hops; stopped at its time limit, so a bound, not an optimum).\n\n" + _md(energy) + "\n")
        worst = max((r["gap_pct"] for r in energy if r["gap_pct"] is not None), default=None)
        text += f"\nWorst energy gap to the bound: {worst}%.\n"
        write_results("planner", previous, text)
        print(text)
        return
    rows = []
    row, *_ = case("5x32", 5, 32, 1, PlanRequest(), 0.010, 21, {})
    rows.append(row)
    row, *_ = case(
        "10x64 optimal", 10, 64, 2, PlanRequest(max_exact_devices=10), 0.100, 7, {"pair_hops": True}
    )
    rows.append(row)
    for pool_seed in (3, 4, 5, 6, 7):  # several pools: annealing quality varies with the pool
        milp = {"pair_hops": False, "time_limit_s": 30.0} if pool_seed == 3 else {}
        row, model, pool, network, result = case(
            f"64x100 pool {pool_seed}", 64, 100, pool_seed, PlanRequest(seed=0), 1.0, 5, milp
        )
        # A long annealing search from several seeds, as a second yardstick.
        long_best = min(
            plan(model, pool, network, PlanRequest(seed=s, anneal_steps=20_000, search="annealing"))
            .best.predicted.ring_s
            for s in range(3)
        )
        row["long_annealing_ms"] = round(long_best * 1e3, 4)
        gap = (result.best.predicted.ring_s / long_best - 1) * 100
        row["gap_to_long_annealing_pct"] = round(gap, 3) + 0.0
        rows.append(row)

    run.finish()
    columns = list(dict.fromkeys(key for r in rows for key in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    table = "\n".join(lines)
    write_results("planner", {**run.as_dict(), "cases": rows},
        "# Planner benchmark\n\n"
        f"{run.line()} · Python {run.machine['python']}; median wall time of `plan()`.\n"
        "Gaps are the plan's ring time over the best lower bound (planner's bound, MILP dual bound).\n"
        "The machine is shared with other work, so wall times are noisy.\n\n"
        + table
        + "\n"
    )
    print(table)


def _md(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for r in rows for key in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
