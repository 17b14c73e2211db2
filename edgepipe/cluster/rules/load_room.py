"""Where a new plan may load beside the running one, pure: each worker's room for a new stage,
and whether a plan is the one that just failed.

A new plan is prepared beside the running one (hot swap), so a worker of the running plan has
its budget less what its running stage holds for any other stage; a worker that refused a LOAD
over its budget (``LoadRefused``) is priced with the figures it reported. ``planning`` plans with
these rooms (``loadable_beside``), the deployer holds back the plan that just failed.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..state.placement import StageAssignment
from ..state.state import ClusterState


def new_stage_room(state: ClusterState, manifest, forms: Mapping[str, str | None], overhead_bytes: int) -> dict[str, int]:
    """Worker id -> the memory the planner may give it for a stage other than the one it runs now.

    A new plan is loaded beside the running one (hot swap), so a worker of the running plan has
    its budget less what its running stage holds: where it refused a LOAD beside this very plan
    (``LoadRefused``), the figures it reported (its budget, what was free); else its declared
    budget less its running stage's weights in its form. A worker that refused with nothing
    running holds its reported budget. The figure counts ``overhead_bytes`` as the planner's
    memory does (``ModelProfile.stage_bytes``), so that a stage fits it exactly when the worker
    would take it. Workers with neither (no running stage, no refusal) are not listed."""
    active = state.active
    running = {s.worker_id: (s.start, s.end) for s in active.stages} if active is not None else {}
    room = {}
    for wid in sorted(set(running) | set(state.refusals)):
        w = state.workers.get(wid)
        if w is None:
            continue
        refused = state.refusals.get(wid)
        budget = refused.budget_bytes if refused is not None else w.memory_bytes
        if refused is not None and refused.beside is not None and active is not None and refused.beside == active.plan_id:
            held = refused.budget_bytes - refused.free_bytes
        elif wid in running:
            start, end = running[wid]
            held = sum(manifest.variant(u, forms.get(wid)).weight_bytes for u in range(start, end))
        else:
            held = 0
        room[wid] = max(0, min(w.memory_bytes, budget - held + overhead_bytes))
    return room


FAILED_PLAN_HOLD_S = 60.0  # a plan that failed to prepare is not tried again for this long (unless membership changes)


def repeats_failure(state: ClusterState, stages: Sequence[StageAssignment], now: float) -> bool:
    """Whether ``stages`` are the plan that last failed to prepare while the running plan served
    (``ClusterState.failed_stages``), less than ``FAILED_PLAN_HOLD_S`` ago: it is not prepared
    again in a row (the running plan keeps serving; a commit or a change of membership lifts
    this; after the hold, a failure that may have been passing, a timeout, is tried once more)."""
    return (state.active is not None and state.failed_stages is not None and tuple(state.failed_stages) == tuple(stages)
            and now - state.failed_at < FAILED_PLAN_HOLD_S)
