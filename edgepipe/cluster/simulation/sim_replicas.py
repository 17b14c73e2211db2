"""Replicated stages in the simulation's schedules: an operator's plan that replicates the last
stage (``replicate``), and what a played schedule covered of them (``replica_counts``)."""

from __future__ import annotations

import itertools

from ..state import state as S
from ..state.placement import StageAssignment
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from .sim import UNIT_BYTES, UNIT_KV_ROOM


def replicated_plan(workers, n_units: int, active=None) -> list[StageAssignment] | None:
    """A plan whose last stage is replicated on two workers and whose first stage is a third,
    each holding its range beside its stage of the ``active`` plan (a worker keeps that until
    the switch): the first that fits, in id order (None: none)."""
    held = {s.worker_id: s.end - s.start for s in (active.stages if active is not None else ())}
    room = {w.id: (w.memory_bytes - RUNTIME_OVERHEAD_BYTES) // (UNIT_BYTES + UNIT_KV_ROOM) - held.get(w.id, 0) for w in workers}
    ids = sorted(room)
    for first, a, b in itertools.permutations(ids, 3):
        if a < b:
            for cut in range(n_units - 1, 0, -1):  # as many units as possible on the replicas
                if room[first] >= cut and min(room[a], room[b]) >= n_units - cut:
                    return [StageAssignment(first, 0, cut), StageAssignment(a, cut, n_units), StageAssignment(b, cut, n_units)]
    return None


async def replicate(coord) -> None:
    """An operator pins a plan with a replicated stage (``replicated_plan``) for 30 s; a load
    that fails, or a worker that leaves meanwhile, leaves the running plan in place."""
    stages = replicated_plan(coord.cluster.live(), coord.n_units, coord.cluster.active)
    if coord.cluster.active is None or stages is None or coord.cluster.switching is not None:
        return
    try:
        await coord.deploy(stages, reason="manual rebalance", pin_s=30.0)
    except Exception:  # noqa: BLE001 - as for an operator: the plan stays
        pass


def replica_counts(coord) -> tuple[int, int]:
    """(plans with a replicated stage committed, workers lost while they ran a replica of the
    active plan), from the coordinator's event log."""
    committed = lost = 0
    active = None
    for event in coord.history.events:
        if isinstance(event, S.Committed):
            active = event.deployment
            committed += active.replicated
        elif isinstance(event, S.WorkerLost) and active is not None and event.worker_id in active.workers:
            lost += active.replicated
            active = None
    return committed, lost
