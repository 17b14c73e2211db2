"""Moving live sequences' KV when the plan changes (I/O): worker to worker, or rebuild by replay.

At a switch, after in-flight steps drained, each live sequence's KV for the layers that change
hands (``deploy.kv_moves``) is sent by the worker that holds it straight to the one that will
(KV_EXPORT -> KV -> LOADED ``kv_received``). A sequence moves when that is predicted cheaper
than replaying it; every move of a switch runs at once and whatever has not arrived within a
bound set by the bytes (``_move_timeout``) is rebuilt by replay instead (``state.KvMoved`` says
which plan holds whose KV). Where a plan replicates a stage, each sequence's KV goes from the
replicas of its route on the old plan to those of its route on the new one (``deploy.kv_moves``).
"""

from __future__ import annotations

import asyncio
import itertools

from ..net.messages import Drop, KvExport, Loaded
from . import deploy, replicas, state as S
from .placement import Deployment

MOVE_TIMEOUT_S = 10.0  # KV moves still missing after this (plus 3x their predicted time) are rebuilt by replay
MOVE_TIMEOUT_MAX_S = 120.0


class KvMigration:
    def __init__(self, coord, deployer):
        self.coord = coord
        self.deployer = deployer  # the data-port secrets it issued per plan
        self.moves: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)

    async def migrate(self, old: Deployment, new: Deployment) -> dict:
        """Move live sequences' KV from the old stages to the new ones, worker to worker.

        Each sequence moves when that is predicted cheaper than rebuilding it by replay on the
        new plan; otherwise, or if a move fails, it is rebuilt by replay."""
        c = self.coord
        live = {rid: q for rid, q in sorted(c.cluster.requests.items()) if q.plan == old.plan_id and q.kv_len > 0}
        if not live:
            return {}
        infos = c.cluster.workers
        if any(w not in infos or infos[w].relay for w in set(old.workers) | set(new.workers)):
            return {"kv_recomputed": len(live)}
        kv_per_unit = [u.kv_bytes_per_token for u in c.manifest.units]
        # a replicated stage: each sequence's copies go between its routes' replicas (None: no route
        # on the old plan, it is replayed)
        per_seq = {rid: self._copies(old, new, rid, kv_per_unit) for rid in live}
        copies = max((cp for cp in per_seq.values() if cp is not None), key=len, default=[])
        loop = asyncio.get_running_loop()
        futures: dict[str, list[asyncio.Future]] = {}
        moved_bytes, recompute = 0, []
        # Replays of all live sequences share the stages (one row per frame), so moving is weighed
        # for all of them at once: every byte that changes hands against every position replayed.
        # (nothing to copy: every KV stays where it is, on stages whose range did not change)
        moving = not copies or self._move_is_cheaper(old, new, sum(q.kv_len for q in live.values()),
                                                        sum(kv_per_unit[u] for cp in copies for u in range(cp.start, cp.end)))
        for rid, q in live.items():
            if not moving:
                recompute.append(rid)
                continue
            if per_seq[rid] is None:
                recompute.append(rid)
                continue
            if not per_seq[rid]:  # its KV stays where it is (a route through unchanged stages)
                c.emit(S.KvMoved(rid, new.plan_id))
                continue
            for copy in per_seq[rid]:
                move = next(self._ids)
                fut = self.moves[move] = loop.create_future()
                futures.setdefault(rid, []).append(fut)
                moved_bytes += q.kv_len * sum(kv_per_unit[copy.start:copy.end])
                link = c.links.get(copy.src)
                msg = KvExport(q.seq, old.plan_id, copy.start, copy.end, new.plan_id, infos[copy.dst].hello.data_url, move,
                               secret=self.deployer.secrets.get(new.plan_id, {}).get(copy.dst),
                               fingerprint=infos[copy.dst].hello.data_fingerprint)
                if link is None or not await _sent(link, msg):
                    fut.cancel()
        # All moves run at once; whatever has not arrived within the bound is rebuilt by replay.
        everything = [f for futs in futures.values() for f in futs]
        if everything:
            await asyncio.wait(everything, timeout=self._move_timeout(old, moved_bytes))
        ok = 0
        for rid, futs in futures.items():
            if all(f.done() and not f.cancelled() and f.exception() is None and f.result().ok for f in futs):
                c.emit(S.KvMoved(rid, new.plan_id))
                await self._drop_off_route(old, new, rid, live[rid].seq)
                ok += 1
            else:
                recompute.append(rid)
        for f in everything:
            if not f.done():
                f.cancel()
        for move in [m for m, f in self.moves.items() if f.done()]:
            del self.moves[move]
        return {"kv_moved": ok, "kv_moved_bytes": moved_bytes, "kv_recomputed": len(recompute)}

    async def _drop_off_route(self, old: Deployment, new: Deployment, rid: str, seq: str) -> None:
        """A sequence that moved to another replica: the workers of its old route off its new one
        keep their session (the range is unchanged) and its KV in it until the sequence ended."""
        if not (old.replicated or new.replicated):
            return
        requests = self.coord.cluster.requests
        before = replicas.routed(requests, old, rid) or replicas.plain_route(old)
        after = replicas.routed(requests, new, rid) or replicas.plain_route(new)
        for wid in sorted(set(before) - set(after)):
            if (link := self.coord.links.get(wid)) is not None:
                await _sent(link, Drop(seq))

    def _copies(self, old: Deployment, new: Deployment, rid: str, kv_per_unit: list[int]) -> list | None:
        """``rid``'s KV copies from its route on ``old`` to its route on ``new`` (chosen now, recorded)."""
        old_route = replicas.routed(self.coord.cluster.requests, old, rid)
        if old.replicated and old_route is None:
            return None
        return deploy.kv_moves(old, new, self.coord.n_units, kv_per_unit, old_route, self.coord.steps.route(new, rid) or None)

    def _move_timeout(self, old: Deployment, moved_bytes: int) -> float:
        """How long all moves may take: 10 s plus three times their predicted transfer time (the
        slowest sender's link carrying every byte), at most two minutes."""
        bandwidth = min(self.coord.profile.link_of(w)[1] for w in old.workers)
        return min(MOVE_TIMEOUT_S + 3 * moved_bytes / max(bandwidth, 1.0), MOVE_TIMEOUT_MAX_S)

    def _move_is_cheaper(self, old: Deployment, new: Deployment, positions: int, moved_kv_per_token: int) -> bool:
        """Moving the KV of ``positions`` (all live sequences) beats replaying them: a replayed
        position is a one-row step at each stage (overhead included), not a row of a batch."""
        p = self.coord.profile
        # a speed of 0 comes from a package imported without unit costs: no estimate, replay
        stage_s = [p.unit_cost(s.start, s.end) / max(p.of(s.worker_id).speed, 1e-9) + p.of(s.worker_id).overhead_s for s in new.stages]
        return deploy.move_is_cheaper(positions * moved_kv_per_token, min(p.link_of(w)[1] for w in old.workers),
                                      max(p.link_of(w)[0] for w in old.workers), stage_s, positions)

    def moved(self, reply: Loaded) -> None:
        fut = self.moves.pop(reply.kv_received, None)
        if fut is None:  # not a move of a switch: a KV checkpoint's copy (``checkpoints``)
            self.coord.checkpoints.moved(reply)
        elif not fut.done():
            fut.set_result(reply)

    def abort_moves(self, exc: Exception) -> None:
        for fut in self.moves.values():
            if not fut.done():
                fut.set_exception(exc)
        self.moves.clear()


async def _sent(link, msg) -> bool:
    """Send, or say it could not (the loss of that worker is handled where it is noticed)."""
    try:
        await link.send(msg.to_message())
        return True
    except Exception:
        return False
