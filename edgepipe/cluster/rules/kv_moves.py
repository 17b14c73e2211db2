"""KV moves at a plan switch, as state and decisions (pure): which live sequences move and how,
and which moves are in flight.

``plan(state, old, new, units, profile)`` decides a switch's moves: for every live sequence on
``old``, the copies of the layers that change hands (``deploy.kv_moves``) when moving all of them
is predicted cheaper than replaying all of them (every byte that changes hands against every
position replayed), else none; and how long the moves may take. A move in flight is
``ClusterState.moves`` (``KvMoveSent`` until its ``KvMoveEnded``); ``settled`` says which
sequences arrived whole (every copy acknowledged) and which are rebuilt by replay instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from . import deploy, replicas
from ..state.events import KvMoveEnded, KvMoveSent  # noqa: F401 - the events of a move, as kv_moves.X
from ..state.placement import Deployment

MOVE_TIMEOUT_S = 10.0  # KV moves still missing after this (plus 3x their predicted time) are rebuilt by replay
MOVE_TIMEOUT_MAX_S = 120.0


@dataclass(frozen=True)
class MovePlan:
    copies: tuple[tuple[str, deploy.KvCopy], ...]  # (rid, copy), in the order they are sent
    replay: tuple[str, ...]  # sequences rebuilt by replay on the new plan
    moved_bytes: int
    timeout_s: float
    relayed: bool = False  # a worker behind a relay (or gone): nothing moves, everything replays
    stay: tuple[str, ...] = ()  # sequences whose KV is already where the new plan keeps it (nothing to copy)


def plan(state, old: Deployment, new: Deployment, units, profile,
         new_route: Callable[[str], replicas.Route] = lambda rid: (),
         kv_from: Callable[[str], Sequence[int]] | None = None) -> MovePlan | None:
    """The moves of a switch from ``old`` to ``new`` (None: no live sequence has KV on ``old``).
    Where a plan replicates a stage, a sequence's copies go from its route on ``old`` (recorded
    in the state; none: it is replayed) to ``new_route(rid)`` on ``new``. ``kv_from(worker)``: KV
    bytes per position of each unit in the form the worker keeps (``deploy.worker_kv_bytes``; a
    copy carries its source's); None: the units' own figures."""
    live = {rid: q for rid, q in sorted(state.requests.items()) if q.plan == old.plan_id and q.kv_len > 0}
    if not live:
        return None
    workers = state.workers
    if any(w not in workers or workers[w].relay for w in set(old.workers) | set(new.workers)):
        return MovePlan((), tuple(live), 0, 0.0, relayed=True)
    kv_per_unit = [u.kv_bytes_per_token for u in units]
    kv_of = kv_from or (lambda worker: kv_per_unit)
    per_seq: dict[str, list[deploy.KvCopy] | None] = {}
    for rid in live:
        old_route = replicas.routed(state.requests, old, rid)
        unrouted = old.replicated and old_route is None
        per_seq[rid] = None if unrouted or uneven(state, rid, old, units) else deploy.kv_moves(old, new, len(units), kv_per_unit,
                                                                                                old_route, new_route(rid) or None)
    copies = max((cp for cp in per_seq.values() if cp is not None), key=len, default=[])
    # Replays of all live sequences share the stages (one row per frame), so moving is weighed
    # for all of them at once: every byte that changes hands against every position replayed.
    # Nothing to copy: every KV stays where it is, on stages whose range did not change.
    if copies and not _move_is_cheaper(profile, old, new, sum(q.kv_len for q in live.values()),
                                       sum(kv_of(cp.src)[u] for cp in copies for u in range(cp.start, cp.end))):
        return MovePlan((), tuple(live), 0, 0.0)
    sent = tuple((rid, cp) for rid in live for cp in per_seq[rid] or ())
    moved_bytes = sum(live[rid].kv_len * sum(kv_of(cp.src)[cp.start:cp.end]) for rid, cp in sent)
    return MovePlan(sent, tuple(rid for rid in live if per_seq[rid] is None), moved_bytes,
                    timeout_s(profile, old, moved_bytes), stay=tuple(rid for rid in live if per_seq[rid] == []))


def timeout_s(profile, old: Deployment, moved_bytes: int) -> float:
    """How long all moves may take: 10 s plus three times their predicted transfer time (the
    slowest sender's link carrying every byte), at most two minutes."""
    bandwidth = min(profile.link_of(w)[1] for w in old.workers)
    return min(MOVE_TIMEOUT_S + 3 * moved_bytes / max(bandwidth, 1.0), MOVE_TIMEOUT_MAX_S)


def _move_is_cheaper(profile, old: Deployment, new: Deployment, positions: int, moved_kv_per_token: int) -> bool:
    """Moving the KV of ``positions`` (all live sequences) beats replaying them: a replayed
    position is a one-row step at each stage (overhead included), not a row of a batch."""
    p = profile
    # a speed of 0 comes from a package imported without unit costs: no estimate, replay
    stage_s = [p.unit_cost(s.start, s.end) / max(p.of(s.worker_id).speed, 1e-9) + p.of(s.worker_id).overhead_s for s in new.stages]
    return deploy.move_is_cheaper(positions * moved_kv_per_token, min(p.link_of(w)[1] for w in old.workers),
                                  max(p.link_of(w)[0] for w in old.workers), stage_s, positions)


def settled(moves: MovePlan, acknowledged: Mapping[int, bool], ids: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """(sequences whose every copy was acknowledged: their KV is on the new plan, the others:
    rebuilt by replay). ``ids``: each copy's move id, in ``moves.copies`` order."""
    whole: dict[str, bool] = {}
    for (rid, _), move in zip(moves.copies, ids):
        whole[rid] = whole.get(rid, True) and acknowledged.get(move, False)
    return [r for r, ok in whole.items() if ok], list(moves.replay) + [r for r, ok in whole.items() if not ok]



def uneven(state, rid: str, old: Deployment, units) -> bool:
    """``rid`` runs direct on ``old``, a plan of several stages, of a model with sliding-window
    layers: its stages may each hold another count past the coordinator's (the last stage fed
    the first a step the others have not reached), and a new stage built from the copies of two
    old ones would import two lengths, a window layer's KV lined up with the other's. Such a
    sequence is replayed, not moved. (Full-cache layers take either length: the first step on
    the new plan forgets what lies past its start, ``rewind``.)"""
    q = state.requests.get(rid)
    return (q is not None and len(old.groups) > 1 and q.seq in state.steps.ahead
            and any(getattr(u, "kv_window", 0) for u in units))
