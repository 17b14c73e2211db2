"""A MILP for the latency objective, to measure the heuristic searches against.

This module owns the assignment model of seed 004 (eq. 5: compute time plus transfer time,
with a binary x[u, d] per unit and device and a memory cap per device), extended with the
contiguity the pipeline needs (each device runs at most one range) and a per-stage overhead.
HiGHS solves it through `scipy.optimize.milp`.

Hops are priced one of two ways:
- `pair_hops=True`: a flow variable per (boundary, sender, receiver) makes the model exact, so
  its optimum equals the best plan's ring time (O(n m^2) variables: small pools);
- `pair_hops=False`: each stage end pays half the cheapest hop out of its device and each
  stage start half the cheapest hop in; since a hop a->b costs at least both, this is a valid
  lower bound with O(n m) variables (large pools).

The planner never calls this: a time limit makes it depend on the clock. It is a yardstick
for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from .plan import PlanError, PlanRequest, Stage, device_map, evaluate
from .profiles import DeviceProfile, ModelProfile, NetworkProfile
from .split import build_pricing


@dataclass(frozen=True)
class MilpResult:
    """Lower bound on the ring time, the solver's plan (if any) and its true ring time."""

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
    devs = device_map(devices)
    pricing = build_pricing(model, devs, network, request)
    ids, n, m = pricing.ids, model.n_units, len(devs)
    if pair_hops is None:
        pair_hops = m <= 16
    seq = request.sequences
    kv = np.array([seq * b for b in model.kv_bytes_per_sequence], dtype=float)
    # (n, m): each device sized with the weight variant it runs
    unit_mem = np.stack([np.asarray(model.unit_weights(devs[d].precision), dtype=float) + kv for d in ids], axis=1)
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

    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), total)).tocsr()
    options: dict[str, object] = {"mip_rel_gap": mip_rel_gap, "presolve": True}
    if time_limit_s is not None:
        options["time_limit"] = time_limit_s
    if node_limit is not None:
        options["node_limit"] = node_limit
    result = milp(
        c,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)),
        options=options,
    )
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        bound = result.fun if result.status == 0 else float("-inf")
    status = {0: "optimal", 1: "limit reached", 2: "infeasible", 3: "unbounded", 4: "other"}.get(
        result.status, str(result.status)
    )
    if result.x is None:
        return MilpResult(float(bound), None, None, status, pair_hops)

    owner = result.x[X : X + nm].reshape(n, m).argmax(1)
    stages = []
    start = 0
    for u in range(1, n + 1):
        if u == n or owner[u] != owner[start]:
            stages.append(Stage((ids[int(owner[start])],), start, u))
            start = u
    try:
        value = evaluate(tuple(stages), model, devs, network, request).ring_s
    except PlanError:
        return MilpResult(float(bound), None, None, status, pair_hops)
    return MilpResult(float(bound), value, tuple(stages), status, pair_hops)
