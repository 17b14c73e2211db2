"""Moving live sequences' KV when the plan changes (I/O): worker to worker, or rebuild by replay.

At a switch, after in-flight steps drained, each live sequence's KV for the layers that change
hands is sent by the worker that holds it straight to the one that will (KV_EXPORT -> KV ->
LOADED ``kv_received``). What moves, and how long the moves may take, is decided by
``kv_moves.plan``; every move runs at once and is state while in flight (``KvMoveSent`` until
``KvMoveEnded``); whatever has not arrived within the bound is rebuilt by replay instead
(``kv_moves.settled``; ``state.KvMoved`` says which plan holds whose KV). This shell only sends
the frames and awaits their acknowledgements; it is lent ``ports.Ports``, not the coordinator.
Where a plan replicates a stage, each sequence's KV goes from the replicas of its route on the
old plan to those of its route on the new one, and the old route's replicas off the new route
drop it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from ...net.messages import Drop, KvExport, Loaded
from ..rules import deploy, kv_moves, replicas
from ..state import state as S
from ..state.placement import Deployment
from .ports import Ports


class KvMigration:
    def __init__(self, ports: Ports, route: Callable[[Deployment, str], replicas.Route]):
        self.ports = ports
        self.route = route  # a sequence's route on a plan (chosen and recorded at first use)
        self.acks: dict[int, asyncio.Future] = {}  # the acknowledgements awaited, by move (the moves: ``ClusterState.moves``)
        self._ids = itertools.count(1)

    @property
    def moves(self):
        """The moves in flight (the state's)."""
        return self.ports.state().moves

    async def migrate(self, old: Deployment, new: Deployment) -> dict:
        """Move live sequences' KV from the old stages to the new ones, worker to worker, where
        ``kv_moves.plan`` says moving is cheaper; the rest, and any move that fails, replay."""
        p = self.ports
        state = p.state()
        moves = kv_moves.plan(state, old, new, p.package.manifest.units, p.profile, lambda rid: self.route(new, rid),
                              deploy.worker_kv_bytes(state, p.package.manifest, p.settings.precision))
        if moves is None:
            return {}
        if moves.relayed:
            return {"kv_recomputed": len(moves.replay)}
        ids = tuple(next(self._ids) for _ in moves.copies)
        acks = {move: asyncio.get_running_loop().create_future() for move in ids}
        try:
            for (rid, copy), move in zip(moves.copies, ids):
                q, dst = state.requests[rid], state.workers[copy.dst].hello
                p.emit(kv_moves.KvMoveSent(move, rid, copy.src, copy.dst, new.plan_id, copy.start, copy.end))
                self.acks[move] = acks[move]
                msg = KvExport(q.seq, old.plan_id, copy.start, copy.end, new.plan_id, dst.data_url, move,
                               secret=p.state().secrets.get(new.plan_id, {}).get(copy.dst), fingerprint=dst.data_fingerprint)
                if not await _sent(p, copy.src, msg):
                    acks[move].cancel()
            # All moves run at once; whatever has not arrived within the bound is rebuilt by replay.
            if acks:
                await asyncio.wait(list(acks.values()), timeout=moves.timeout_s)
            acknowledged = {m: f.done() and not f.cancelled() and f.exception() is None and f.result().ok for m, f in acks.items()}
        finally:
            for move, fut in acks.items():
                fut.cancel()
                self.acks.pop(move, None)
                p.emit(kv_moves.KvMoveEnded(move, bool(fut.done() and not fut.cancelled() and fut.exception() is None
                                                       and fut.result().ok)))
        for rid in moves.stay:
            p.emit(S.KvMoved(rid, new.plan_id))
        whole, replay = kv_moves.settled(moves, acknowledged, ids)
        for rid in whole:
            p.emit(S.KvMoved(rid, new.plan_id))
            await self._drop_off_route(old, new, rid, state.requests[rid].seq)
        # A request that ended while its KV was on the way (simulation seed 107571): its DROP went to the
        # old plan's workers and the copy landed after it. Checked with no await before the switch
        # commits: a request ending later drops on every worker, the new plan then being the active one.
        live = p.state().requests
        for rid, copy in moves.copies:
            if rid in whole and rid not in live:
                p.spawn(_sent(p, copy.dst, Drop(state.requests[rid].seq)))
        whole = [*moves.stay, *whole]
        return {"kv_moved": len(whole), "kv_moved_bytes": moves.moved_bytes, "kv_recomputed": len(replay)}

    def moved(self, reply: Loaded) -> None:
        """A move's acknowledgement (the core found it among the state's moves: ``core.AckKvMove``)."""
        fut = self.acks.pop(reply.kv_received, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def abort_moves(self, exc: Exception) -> None:
        """A worker was lost: every move of the switch under way fails (those sequences replay)."""
        for fut in self.acks.values():
            if not fut.done():
                fut.set_exception(exc)
        self.acks.clear()


    async def _drop_off_route(self, old: Deployment, new: Deployment, rid: str, seq: str) -> None:
        """A sequence whose KV moved: the workers of its old route off its new one may keep their
        session (another replica of an unchanged range, or a warm spare: simulation seed 10123), and
        the sequence's KV in it would outlive the sequence; they drop it now."""
        requests = self.ports.state().requests
        before = replicas.routed(requests, old, rid) or replicas.plain_route(old)
        after = replicas.routed(requests, new, rid) or replicas.plain_route(new)
        for wid in sorted(set(before) - set(after)):
            await _sent(self.ports, wid, Drop(seq))


async def _sent(ports: Ports, worker_id: str, msg) -> bool:
    """Send, or say it could not (the loss of that worker is handled where it is noticed)."""
    try:
        await ports.send(worker_id, msg.to_message())
        return True
    except Exception:
        return False
