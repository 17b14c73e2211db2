"""Measuring the links between workers, on the path the activations take (I/O).

Links between workers are measured by the workers themselves, on the data-port path the
activations take (``probe_pair``): at join, the newcomer and each calibrated worker probe each
other (both directions, at most ``MAX_PEERS_AT_JOIN`` peers); after a deployment, each stage
probes its planned successor if that pair was never measured (``probe_neighbours``). The
results go into ``ClusterProfile.peer_links``, the matrix the planner's network profile uses.
Probes share the calibration lock: two measurements at once on shared cores measure each other.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from ...net import auth
from ...net.channel import ChannelClosed
from ..rules import replicas
from ..state.events import NoteKind, ProbeAccepting
from ..state.measurements import PeerLink
from .steps import PipelineBroken

MAX_PEERS_AT_JOIN = 8  # a newcomer measures its links to at most this many workers at once (the rest when planned)
PEER_PROBE_BYTES = 1 << 19  # largest timed transfer of a peer probe (the worker sizes it to ~0.15 s)


class LinkProber:
    """Given the coordinator's ``Ports``, the calibrator's ``probe`` (ask a worker, await its
    timing) and its lock (probes and calibrations never overlap). The secret each worker's data
    port accepts is state (``WorkerInfo.probe_secret``, set by ``ProbeAccepting``; it goes with
    the worker)."""

    def __init__(self, ports, probe: Callable[..., Awaitable], lock: asyncio.Lock):
        self.ports, self.probe, self.lock = ports, probe, lock

    def _reachable(self, wid: str) -> bool:
        info = self.ports.state().workers.get(wid)
        return info is not None and not info.relay and bool(info.hello.data_url) and wid in self.ports.links()

    async def probe_pair(self, src: str, dst: str) -> bool:
        """``src`` times its data-port path to ``dst`` (``dst`` first told which probe secret to
        accept); the result goes into the link matrix. False when either cannot be probed."""
        p = self.ports
        if src == dst or not (self._reachable(src) and self._reachable(dst)):
            return False
        try:
            accepting = p.state().workers.get(dst)
            secret = accepting.probe_secret if accepting is not None else None
            if secret is None:
                secret = auth.plan_secrets(1)[0]
                if not (await self.probe(dst, kind="accept", secret=secret)).ok:
                    return False
                p.emit(ProbeAccepting(dst, secret))
            target = p.state().workers[dst].hello
            reply = await self.probe(src, kind="peer", url=target.data_url, secret=secret,
                                      fingerprint=target.data_fingerprint, bytes=PEER_PROBE_BYTES)
        except (asyncio.TimeoutError, ChannelClosed, KeyError, PipelineBroken) as exc:  # PipelineBroken: it left meanwhile
            p.note(NoteKind.LINK_PROBE_FAILED, src=src, dst=dst, error=str(exc) or type(exc).__name__)
            return False
        if not (reply.ok and reply.rtt_s is not None and reply.bandwidth_bytes_per_s):
            p.note(NoteKind.LINK_PROBE_FAILED, src=src, dst=dst, error=getattr(reply, "error", None) or "no figures")
            return False
        p.measure(PeerLink(src, dst, reply.rtt_s, reply.bandwidth_bytes_per_s))  # its dashboard line: narrate.entry
        return True

    async def probe_peers(self, wid: str) -> None:
        """The newcomer and up to ``MAX_PEERS_AT_JOIN`` calibrated workers measure each other."""
        state, profile = self.ports.state(), self.ports.profile
        peers = [p for p in sorted(state.workers) if p != wid and profile.of(p).calibrated and not state.workers[p].calibrating]
        for peer in peers[:MAX_PEERS_AT_JOIN]:
            await self.probe_pair(wid, peer)
            await self.probe_pair(peer, wid)

    async def probe_peers_locked(self, wid: str) -> None:
        try:
            async with self.lock:
                await self.probe_peers(wid)
        finally:
            self.ports.replan_wanted.set()

    async def probe_neighbours(self, stages) -> None:
        """After a deployment: each stage measures the link to its successor if nobody has yet
        (pools larger than ``MAX_PEERS_AT_JOIN``); a re-plan follows when anything was learnt."""
        p = self.ports
        if not p.settings.calibrate:
            return
        pairs = [pair for pair in replicas.neighbour_pairs(stages) if pair not in p.profile.peer_links]
        if not pairs:
            return
        learnt = False
        async with self.lock:
            for src, dst in pairs:
                learnt |= await self.probe_pair(src, dst)
        if learnt:
            p.replan_wanted.set()
