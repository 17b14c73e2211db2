"""MILPs for the latency and energy objectives, to measure the heuristic searches against.

This module owns the assignment model of seed 004 (eq. 5: compute time plus transfer time,
with a binary x[u, d] per unit and device and a memory cap per device), extended with the
contiguity the pipeline needs (each device runs at most one range) and a per-stage overhead.
HiGHS (highspy) solves it; its dual bound is read even when a time limit stops it first.

Hops are priced one of two ways:
- `pair_hops=True`: a flow variable per (boundary, sender, receiver) makes the model exact, so
  its optimum equals the best plan's ring time (O(n m^2) variables: small pools);
- `pair_hops=False`: each stage end pays half the cheapest hop out of its device and each
  stage start half the cheapest hop in; since a hop a->b costs at least both, this is a valid
  lower bound with O(n m) variables (large pools).

`milp_energy` adds the energy objective for one sequence (busy-minus-idle energy per device,
plus the plan's idle power times its ring time, linearised with big-M and tightened by valid
cuts). The throughput objective (replica groups, period max(T / S, B)) has no MILP here: the
planner's exact replica DP covers pools of up to 7 devices.

The planner never calls this: a time limit makes it depend on the clock. It is a yardstick
for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import highspy
from scipy.sparse import coo_array, csr_array

from .plan import PlanError, PlanRequest, Stage, device_map, evaluate
from .profiles import DeviceProfile, ModelProfile, NetworkProfile
from .split import build_pricing, cost_tables, relaxed_split


@dataclass(frozen=True)
class MilpResult:
    """Lower bound on the objective (ring seconds, or joules per token), the solver's plan
    (if any) and its true objective value under `evaluate`."""

    lower_bound: float
    value: float | None
    stages: tuple[Stage, ...] | None
    status: str
    pair_hops: bool


def milp_latency(
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest = PlanRequest(),
    *,
    pair_hops: bool | None = None,
    time_limit_s: float | None = None,
    node_limit: int | None = None,
    mip_rel_gap: float = 1e-9,
) -> MilpResult:
    """Solve (or bound) the latency objective without replicas; see the module docstring.

    `pair_hops` defaults to exact hops for pools of up to 16 devices. `value` is the ring
    time `evaluate` gives the solver's assignment, so it is an achievable upper bound.
    """
    return _milp(model, devices, network, request, "latency", pair_hops, time_limit_s, node_limit, mip_rel_gap)


def milp_energy(
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest = PlanRequest(objective="energy"),
    *,
    pair_hops: bool | None = None,
    time_limit_s: float | None = None,
    node_limit: int | None = None,
    mip_rel_gap: float = 1e-9,
) -> MilpResult:
    """Solve (or bound) the energy objective for one sequence without replicas.

    Energy per token is sum_d (busy_d - idle_d) t_d + P_U T (module docstring of `energy`):
    the first part is linear in the assignment; the product of the plan's idle power and its
    ring time T is linearised with v_d >= T - T_max (1 - y_d), v_d >= 0 (y_d: device d runs a
    stage; T_max bounds the ring time of any plan), exact for binary y. The request's
    `tpot_target_s` becomes T <= target. `lower_bound` and `value` are joules per token.
    """
    if request.sequences != 1:
        raise PlanError("milp_energy models one sequence (the period is the ring time)")
    return _milp(model, devices, network, request, "energy", pair_hops, time_limit_s, node_limit, mip_rel_gap)


def _solve(
    c: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    integrality: np.ndarray,
    matrix: csr_array,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    mip_rel_gap: float,
    time_limit_s: float | None,
    node_limit: int | None,
) -> tuple[np.ndarray | None, float, str]:
    """HiGHS on the model; (solution or None, proven dual bound, status). The dual bound is
    read from HiGHS even when a limit stops it before any feasible solution."""
    highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("mip_rel_gap", mip_rel_gap)
    highs.setOptionValue("threads", 1)
    if time_limit_s is not None:
        highs.setOptionValue("time_limit", float(time_limit_s))
    if node_limit is not None:
        highs.setOptionValue("mip_max_nodes", int(node_limit))
    total = len(c)
    highs.addVars(total, lower, upper)
    highs.changeColsCost(total, np.arange(total, dtype=np.int32), c)
    highs.changeColsIntegrality(
        total, np.arange(total, dtype=np.int32),
        np.where(integrality > 0, highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous),
    )
    highs.addRows(len(row_lower), row_lower, row_upper, matrix.nnz, matrix.indptr.astype(np.int32),
                  matrix.indices.astype(np.int32), matrix.data)
    highs.run()
    model_status = highs.getModelStatus()
    info = highs.getInfo()
    names = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kInfeasible: "infeasible",
        highspy.HighsModelStatus.kTimeLimit: "limit reached",
        highspy.HighsModelStatus.kSolutionLimit: "limit reached",
    }
    status = names.get(model_status, str(model_status).rsplit(".", 1)[-1])
    if model_status == highspy.HighsModelStatus.kInfeasible:
        return None, float("inf"), status
    bound = float(info.mip_dual_bound)
    if not np.isfinite(bound) and model_status == highspy.HighsModelStatus.kOptimal:
        bound = float(info.objective_function_value)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.array(highs.getSolution().col_value) if has_solution else None
    return x, bound, status


def _milp(
    model: ModelProfile,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile],
    network: NetworkProfile,
    request: PlanRequest,
    objective: str,
    pair_hops: bool | None,
    time_limit_s: float | None,
    node_limit: int | None,
    mip_rel_gap: float,
) -> MilpResult:
    devs = device_map(devices)
    pricing = build_pricing(model, devs, network, request)
    ids, n, m = pricing.ids, model.n_units, len(devs)
    if pair_hops is None:
        pair_hops = m <= 16
    seq = request.sequences
    # (n, m): each device sized with the variant it runs (its weights and its KV)
    unit_mem = np.stack([np.asarray(model.unit_weights(devs[d].precision), dtype=float)
                         + seq * np.asarray(model.unit_kv(devs[d].precision), dtype=float) for d in ids], axis=1)
    cost = np.array([u.cost for u in model.units])
    speed = np.array([devs[d].speed for d in ids])
    overhead = np.array([devs[d].overhead_s for d in ids])
    # Tied embedding/head bytes are counted once only by a device holding every unit; granting
    # them to every device keeps the model a relaxation (a valid bound), exact when they are 0.
    memory = np.array([devs[d].memory_bytes for d in ids], dtype=float) + float(model.tied_bytes)
    runtime = float(model.runtime_overhead_bytes)
    hop = pricing.hop  # (m, m, n+1), inf on the diagonal

    nm = n * m
    X, S = 0, nm  # x[u, d] at X + u*m + d, s[u, d] (stage of d starts at u) at S + u*m + d
    extra = (n - 1) * m * m if pair_hops else (n - 1) * m
    total = 2 * nm + extra
    c = np.zeros(total)
    lower = np.zeros(total)
    upper = np.ones(total)
    integrality = np.zeros(total)
    integrality[X : X + nm] = 1

    c[X : X + nm] = (cost[:, None] / speed[None, :]).ravel()
    c[X : X + m] += pricing.enter
    c[X + (n - 1) * m : X + nm] += pricing.leave
    c[S : S + nm] = np.tile(overhead, n)
    too_big = unit_mem + runtime > memory[None, :]
    upper[X : X + nm][too_big.ravel()] = 0

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def constraint(entries: Iterable[tuple[int, float]], low: float, high: float) -> None:
        row = len(lo)
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lo.append(low)
        hi.append(high)

    for u in range(n):  # every unit on exactly one device
        constraint(((X + u * m + d, 1.0) for d in range(m)), 1.0, 1.0)
    for d in range(m):
        constraint([(S + d, 1.0), (X + d, -1.0)], 0.0, np.inf)
        for u in range(1, n):  # s[u, d] >= x[u, d] - x[u-1, d]
            constraint([(S + u * m + d, 1.0), (X + u * m + d, -1.0), (X + (u - 1) * m + d, 1.0)], 0.0, np.inf)
        constraint(((S + u * m + d, 1.0) for u in range(n)), 0.0, 1.0)  # one contiguous range
        memory_row = [(X + u * m + d, unit_mem[u, d]) for u in range(n)]
        memory_row += [(S + u * m + d, runtime) for u in range(n)]
        constraint(memory_row, -np.inf, memory[d])

    base = 2 * nm
    if pair_hops:
        # Transition flow between consecutive units: z[u, a, b] = 1 when unit u-1 runs on a and
        # unit u on b (a == b: the stage goes on). Flow conservation against x makes the LP
        # relaxation a layered shortest path, far tighter than z >= x_a + x_b - 1.
        def z(u: int, a: int, b: int) -> int:
            return base + ((u - 1) * m + a) * m + b

        for u in range(1, n):
            for a in range(m):
                for b in range(m):
                    if a != b:
                        c[z(u, a, b)] = hop[a, b, u]
            for a in range(m):  # everything leaving a at u-1
                constraint([(z(u, a, b), 1.0) for b in range(m)] + [(X + (u - 1) * m + a, -1.0)], 0.0, 0.0)
            for b in range(m):  # everything arriving at b at u; arrivals from elsewhere start a stage
                constraint([(z(u, a, b), 1.0) for a in range(m)] + [(X + u * m + b, -1.0)], 0.0, 0.0)
                constraint([(z(u, a, b), 1.0) for a in range(m) if a != b] + [(S + u * m + b, -1.0)], 0.0, 0.0)
    else:
        finite = np.where(np.isfinite(hop), hop, np.inf)
        out_min = finite.min(axis=1)  # (m, n+1): cheapest hop out of a at boundary u
        in_min = finite.min(axis=0)  # (m, n+1): cheapest hop into b
        for u in range(1, n):
            for d in range(m):
                e = base + (u - 1) * m + d
                c[e] = out_min[d, u] / 2
                c[S + u * m + d] += in_min[d, u] / 2
                # e >= x[u-1, d] - x[u, d]: a stage of d ends at boundary u
                constraint([(e, 1.0), (X + (u - 1) * m + d, -1.0), (X + u * m + d, 1.0)], 0.0, np.inf)

    if objective == "energy":
        # c so far is the ring time T of the assignment; energy adds T, v[d] and the busy part.
        ring = c.copy()
        busy = np.array([devs[d].power_busy_w for d in ids])
        idle = np.array([devs[d].power_idle_w for d in ids])
        finite_hop = hop[np.isfinite(hop)]
        t_max = float(
            (cost[:, None] / speed[None, :]).max(1).sum() + overhead.max() * min(n, m)
            + (finite_hop.max() if finite_hop.size else 0.0) * (n - 1)
            + pricing.enter.max() + pricing.leave.max()
        )
        if request.tpot_target_s is not None:
            t_max = min(t_max, request.tpot_target_s)
        T, V = total, total + 1
        total += 1 + m
        c = np.zeros(total)
        c[X : X + nm] = ((busy - idle)[None, :] * cost[:, None] / speed[None, :]).ravel()
        c[S : S + nm] = np.tile((busy - idle) * overhead, n)
        c[V : V + m] = idle
        lower = np.concatenate((lower, np.zeros(1 + m)))
        upper = np.concatenate((upper, [t_max], np.full(m, t_max)))
        integrality = np.concatenate((integrality, np.zeros(1 + m)))
        constraint([(T, 1.0)] + [(j, -float(w)) for j, w in enumerate(ring) if w != 0.0], 0.0, 0.0)
        # Any plan's ring time is at least the relaxed (device-reuse) DP's: T >= t_min.
        t_min = max(float(relaxed_split(cost_tables(pricing)).bound), 0.0)
        for d in range(m):  # v[d] >= T - t_max (1 - y[d]), y[d] = sum_u s[u, d]
            constraint([(V + d, 1.0), (T, -1.0)] + [(S + u * m + d, -t_max) for u in range(n)], -t_max, np.inf)
            # Valid cuts that tighten the relaxation: a used device's v[d] = T is at least its
            # own stage time and at least t_min.
            busy_time = [(X + u * m + d, -cost[u] / speed[d]) for u in range(n)]
            busy_time += [(S + u * m + d, -overhead[d]) for u in range(n)]
            constraint([(V + d, 1.0)] + busy_time, 0.0, np.inf)
            constraint([(V + d, 1.0)] + [(S + u * m + d, -t_min) for u in range(n)], 0.0, np.inf)

    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), total)).tocsr()
    x, bound, status = _solve(c, lower, upper, integrality, matrix, np.array(lo), np.array(hi),
                              mip_rel_gap, time_limit_s, node_limit)
    if x is None:
        return MilpResult(float(bound), None, None, status, pair_hops)

    owner = x[X : X + nm].reshape(n, m).argmax(1)
    stages = []
    start = 0
    for u in range(1, n + 1):
        if u == n or owner[u] != owner[start]:
            stages.append(Stage((ids[int(owner[start])],), start, u))
            start = u
    try:
        predicted = evaluate(tuple(stages), model, devs, network, request)
        value = predicted.ring_s if objective == "latency" else predicted.energy_j_per_token
    except PlanError:
        return MilpResult(float(bound), None, None, status, pair_hops)
    return MilpResult(float(bound), value, tuple(stages), status, pair_hops)
