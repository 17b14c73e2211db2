"""Carrying out KV checkpoints (I/O): the KV_EXPORT frames of a due checkpoint, their
acknowledgements, and dropping checkpoint KV nobody refers to. What is due, what a checkpoint
holds, where a sequence resumes, which copies are in flight, which fail when a worker leaves and
what to drop are decided in ``checkpoints`` (pure) from the state (``ClusterState.checkpoints``,
``ClusterState.checkpoint_copies``); this shell keeps only the acknowledgements it awaits."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from ...net.messages import Drop, KvExport
from ..rules import deploy, replicas
from ..state import sequence_ids, state as S
from ..state.checkpoints import CheckpointSettings, Resume, copies_lost, due, unreferenced
from ..state.placement import Deployment
from .ports import Ports

MOVE_TIMEOUT_S = 30.0  # a checkpoint copy not acknowledged by then is void
FIRST_MOVE_ID = 1 << 40  # copy ids above the ids of a switch's KV moves (both are acknowledged by LOADED kv_received)
LOST_SOURCE_GRACE_S = 2.0  # a copy whose sender left fails after this (a frame it sent whole has landed by then)


@dataclass
class CheckpointCounts:
    sent: int = 0  # checkpoints whose every copy was acknowledged
    copies: int = 0  # copies sent (one per source stage and spare stage)
    failed: int = 0  # checkpoints voided (a copy failed or timed out)
    bytes: int = 0  # KV bytes the acknowledged copies installed
    resumed: int = 0  # sequences that resumed from a checkpoint after a recovery
    positions_saved: int = 0  # positions those did not replay


class Checkpoints:
    """Sends the copies ``due`` asks for, records the acknowledgements, drops unreferenced KV.
    It is given the coordinator's ``Ports`` (read and change the state, send, spawn, note)."""

    def __init__(self, ports: Ports, settings: CheckpointSettings):
        self.ports = ports
        self.settings = settings
        self.counts = CheckpointCounts()
        self._spare_seen = None  # the spare the last step saw (a new one: the old one's KV goes; when to sweep, not a fact)
        self.acks: dict[int, asyncio.Future] = {}  # copy id -> its acknowledgement awaited (handles only: the copies are state)
        self._names = itertools.count(1)
        self._moves = itertools.count(FIRST_MOVE_ID)

    @property
    def enabled(self) -> bool:
        # Speculative decoding leaves rejected drafts in a stage's KV between steps: not copied.
        return self.settings.interval > 0 and not self.ports.settings.speculative

    # -- after a step ---------------------------------------------------------------------------
    async def after_step(self, rid: str, seq: str, dep, prompt_len: int) -> None:
        """Between two steps of ``rid`` (none in flight): send a checkpoint if one is due. Only
        the KV_EXPORT frames are sent here (before the next step, so the first stage exports first)."""
        p = self.ports
        cluster = p.state()
        q = cluster.requests.get(rid)
        spare, spare_plan = cluster.spare, cluster.spare_plan
        if spare != self._spare_seen:  # the spare changed: what the old one holds goes
            self._spare_seen = spare
            self.sweep()
        if not self.enabled or q is None or spare is None or spare_plan is None or q.plan != dep.plan_id:
            return
        ck = cluster.checkpoints.get(rid)
        held = ck.position() if ck is not None and ck.spare == spare else None
        book = cluster.checkpoint_copies
        if not due(self.settings, q.kv_len, prompt_len, held, len(book.flying), rid in book.flying):
            return
        units = p.package.manifest.units
        kv_per_unit = [u.kv_bytes_per_token for u in units]
        # from the replicas of the sequence's route, on a plan with replicated stages
        copies = deploy.kv_moves(dep, Deployment(spare_plan, spare, "spare"), len(units), kv_per_unit, replicas.routed(cluster.requests, dep, rid))
        needs = frozenset(cp.dst for cp in copies)
        workers = cluster.workers
        involved = needs | {cp.src for cp in copies}
        # a relayed or browser worker has no data port of its own to take or send checkpoints
        if not copies or not needs <= cluster.spare_built or any(w not in workers or not workers[w].caps.kind.peer_kv
                                                        for w in involved):
            return
        # The holders hold ``held`` positions under the same name: send only what came since.
        since = held if ck is not None and held is not None and held <= q.kv_len else 0
        name = ck.seq if since else sequence_ids.checkpoint(rid, next(self._names))
        futures = []
        loop = asyncio.get_running_loop()
        # from the first frame on, a holder may be part-way; the name is placed and flying (``checkpoints.book``)
        p.emit(S.CheckpointSending(rid, name, spare, needs, q.kv_len))
        nbytes, kv_from = 0, deploy.worker_kv_bytes(cluster, p.package.manifest, p.settings.precision)
        for cp in copies:
            move, fut = next(self._moves), loop.create_future()
            self.acks[move] = fut
            p.emit(S.CopySent(move, rid, cp.src, cp.dst))
            futures.append((move, cp.dst, fut))
            nbytes += (q.kv_len - since) * sum(kv_from(cp.src)[cp.start:cp.end])  # in the form the source keeps
            link = p.links().get(cp.src)
            dst = workers[cp.dst].hello
            msg = KvExport(seq, dep.plan_id, cp.start, cp.end, spare_plan, dst.data_url, move,
                           fingerprint=dst.data_fingerprint, upto=q.kv_len, as_seq=name, since=since or None)
            try:
                if link is None:
                    raise ConnectionError(cp.src)
                await link.send(msg.to_message())
                self.counts.copies += 1
            except Exception:  # noqa: BLE001 - that worker's loss is handled where it is noticed
                fut.cancel()
        p.spawn(self._acknowledged(rid, name, spare, spare_plan, needs, q.kv_len, futures, nbytes))

    async def _acknowledged(self, rid: str, name: str, spare, spare_plan: int, needs: frozenset[str], position: int, futures,
                            nbytes: int) -> None:
        # Until every copy is acknowledged (or lost with its destination), a KV frame may still
        # land: the name stays flying, so ``sweep`` does not drop it before that.
        try:
            await asyncio.wait([f for _, _, f in futures], timeout=MOVE_TIMEOUT_S)
        except asyncio.CancelledError:  # the coordinator stops: the round is over and its name kept by nobody
            self._round_ended(rid, futures)
            self.ports.emit(S.CheckpointVoid(rid, "the coordinator stopped"))
            self.sweep()
            raise
        self._round_ended(rid, futures)
        ok = [f.done() and not f.cancelled() and f.exception() is None and f.result().ok for _, _, f in futures]
        for _, dst, f in futures:
            if not f.done():
                f.cancel()
            elif not f.cancelled() and f.exception() is None and (f.result().error or "").startswith("no stage for plan"):
                # its spare stage is gone (it took a stage of a new plan): send it no more
                self.ports.emit(S.SpareLoaded(spare_plan, spare, dst, False))
        # a holder that took a stage of a plan prepared meanwhile dropped its spare session, and the
        # KV in it, whatever it acknowledged (``checkpoints.displaced``)
        cluster = self.ports.state()
        kept = cluster.spare != spare or needs <= cluster.spare_built
        if all(ok) and kept:
            for worker in sorted(needs):  # the last makes it whole: its line (narrate.entry)
                self.ports.emit(S.CheckpointStored(rid, name, spare, needs, worker, position, nbytes))
            self.counts.sent += 1
            self.counts.bytes += nbytes
        else:
            self.ports.emit(S.CheckpointVoid(rid, "a checkpoint copy failed" if kept else "a holder dropped its spare session"))
            self.counts.failed += 1
        self.sweep()

    def _round_ended(self, rid: str, futures) -> None:
        for move, _, _ in futures:
            self.acks.pop(move, None)
        self.ports.emit(S.RoundEnded(rid, tuple(move for move, _, _ in futures)))

    def moved(self, reply) -> None:
        """A copy's acknowledgement (LOADED ``kv_received``), from its destination or, refused,
        from its source."""
        fut = self.acks.get(reply.kv_received)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def lost(self, worker_id: str) -> None:
        """A worker left: copies to it fail now (its KV went with it); copies from it fail after
        ``LOST_SOURCE_GRACE_S`` unless acknowledged meanwhile (a frame it sent whole still lands,
        and its name must not be dropped before that: ``sweep``)."""
        gone = ConnectionError(f"worker {worker_id} left")
        now, later = copies_lost(self.ports.state().checkpoint_copies, worker_id)
        for move in now:
            fut = self.acks.get(move)
            if fut is not None and not fut.done():
                fut.set_exception(gone)
        for move in later:
            fut = self.acks.get(move)
            if fut is not None and not fut.done():
                asyncio.get_running_loop().call_later(LOST_SOURCE_GRACE_S, lambda f=fut: f.done() or f.set_exception(gone))

    def resumed(self, resume: Resume) -> None:
        self.counts.resumed += 1
        self.counts.positions_saved += resume.position

    # -- clean-up -------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Drop checkpoint KV nobody refers to from the workers that may hold it
        (``checkpoints.unreferenced``: not while a copy of it is in flight)."""
        p = self.ports
        cluster = p.state()
        for name, holders in unreferenced(cluster.checkpoint_copies, cluster.checkpoints, cluster.requests):
            p.emit(S.CheckpointDropped(name))
            for wid in holders:
                link = p.links().get(wid)
                if link is not None:
                    p.spawn(_quiet(link.send(Drop(name).to_message())))


async def _quiet(aw) -> None:
    try:
        await aw
    except Exception:  # noqa: BLE001 - a worker that left holds nothing any more
        pass
