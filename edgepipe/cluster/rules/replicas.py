"""Replicated stages at runtime, the decisions (pure): which replica a sequence uses, what a loss does.

A plan's stage may run on several workers (data-parallel replicas, ``placement.stage_groups``),
each holding the KV of its share of the sequences. A sequence's *route* is the worker it uses
at every stage, chosen once, when it first steps on the plan (``choose_route``): at each
replicated stage the replica with the fewest live sequences routed to it (then the fewest KV
positions reserved there, then the first in plan order). The route is sticky for the
sequence's life on that plan (``state.Routed`` records it): its steps, KV, lanes and hops all
go through it, so the previous stage sends to the route's next worker and the last stage's
token comes back from the route's last. A plan without replicas has one route, its stages.

A replica's loss takes the plan down and the whole plan recovers as any lost stage does (the
spare plan, KV checkpoints where they apply, replay): the sequences of the other replicas still
share the stages that are not replicated, whose KV a partial recovery would have to untangle
(``replica_loss`` says who held KV there, for the dashboard's line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..state.placement import Deployment, StageAssignment, stage_groups

Route = tuple[str, ...]  # a worker id per stage of the pipeline


def plain_route(dep: Deployment) -> Route:
    """The route of a plan without replicas (every stage's one worker)."""
    return tuple(g[0].worker_id for g in dep.groups)


def routed(requests: Mapping, dep: Deployment, rid: str) -> Route | None:
    """``rid``'s route on ``dep``, if it has one (None: not routed there yet)."""
    q = requests.get(rid)
    route = getattr(q, "route", None)
    return route[1] if route is not None and route[0] == dep.plan_id else None


def choose_route(dep: Deployment, requests: Mapping, rid: str) -> Route:
    """The route a sequence starting on ``dep`` takes: the least loaded replica of every stage.

    Load is counted over the other requests routed on ``dep`` (module docstring); the choice is
    deterministic (no randomness, ties go to plan order)."""
    if not dep.replicated:
        return plain_route(dep)
    count: dict[str, int] = {}
    positions: dict[str, int] = {}
    for other, q in sorted(requests.items()):
        route = routed(requests, dep, other)
        if other == rid or route is None:
            continue
        for wid in route:
            count[wid] = count.get(wid, 0) + 1
            positions[wid] = positions.get(wid, 0) + q.positions
    return tuple(min(group, key=lambda s: (count.get(s.worker_id, 0), positions.get(s.worker_id, 0), group.index(s))).worker_id
                 for group in dep.groups)


def path(dep: Deployment, route: Route) -> tuple[StageAssignment, ...]:
    """The stage assignments a route goes through, in pipeline order."""
    by_worker = {s.worker_id: s for s in dep.stages}
    return tuple(by_worker[w] for w in route)


def valid_route(dep: Deployment, route: Route) -> bool:
    groups = dep.groups
    return len(route) == len(groups) and all(w in {s.worker_id for s in g} for w, g in zip(route, groups))


def last_stage(dep: Deployment, worker_id: str) -> bool:
    """Whether ``worker_id`` runs (a replica of) the plan's last stage: the one that sends tokens."""
    return any(s.worker_id == worker_id for s in dep.groups[-1])


def next_workers(stages, i: int) -> tuple[str, ...]:
    """The workers stage assignment ``i`` may send its output to: every replica of the next stage
    (empty: it is the last)."""
    groups = [[s.worker_id for s in g] for g in stage_groups(stages)]
    at = next(k for k, g in enumerate(groups) if stages[i].worker_id in g)
    return tuple(groups[at + 1]) if at + 1 < len(groups) else ()


def neighbour_pairs(stages) -> list[tuple[str, str]]:
    """(sender, receiver) pairs of consecutive stages, every replica with every replica."""
    groups = stage_groups(stages)
    return [(a.worker_id, b.worker_id) for g, h in zip(groups, groups[1:]) for a in g for b in h]


@dataclass(frozen=True)
class ReplicaLoss:
    """What losing ``worker`` does to the active plan: ``plan_down`` (this runtime recovers the
    whole plan) and the sequences whose KV that worker held (routed through it)."""

    worker: str
    replica_of: tuple[str, ...]  # the other replicas of its stage (empty: not a replicated stage)
    plan_down: bool
    sequences: tuple[str, ...]


def replica_loss(dep: Deployment | None, requests: Mapping, worker_id: str) -> ReplicaLoss | None:
    """The loss of ``worker_id`` as it concerns ``dep`` (None: not one of its workers)."""
    if dep is None or worker_id not in dep.workers:
        return None
    group = next(g for g in dep.groups if any(s.worker_id == worker_id for s in g))
    others = tuple(s.worker_id for s in group if s.worker_id != worker_id)
    held = tuple(sorted(rid for rid in requests if (r := routed(requests, dep, rid)) is not None and worker_id in r)) \
        if dep.replicated else tuple(sorted(rid for rid, q in requests.items() if q.plan == dep.plan_id))
    return ReplicaLoss(worker_id, others, plan_down=True, sequences=held)


def kv_share_positions(dep: Deployment, requests: Mapping, worker_id: str) -> int:
    """KV positions reserved on ``worker_id`` by the sequences routed through it (every sequence
    on the plan for a stage that is not replicated)."""
    group = next((g for g in dep.groups if any(s.worker_id == worker_id for s in g)), ())
    if len(group) <= 1:
        return sum(q.positions for q in requests.values())
    return sum(q.positions for rid, q in requests.items() if (r := routed(requests, dep, rid)) is not None and worker_id in r)
