"""The coordinator's prefix cache (shell): hands each prompt prefill and each returned or failed
frame to the coordinator's core (``core.PrefillAsked``/``PrefillEnded``, through the executor),
which decides a ``PrefixDecided`` or ``PrefixDone`` event and, for a decision that is not
empty, the ``CarryPrefix`` whose decision the prefill frame carries; the bookkeeping (which blocks
the stages hold, the counts for ``/metrics`` and the dashboard) is ``ClusterState.prefix``
(``prefix_book``), the decisions are ``prefix``'s.

The coordinator, not the stages, knows what is cached: it sees every prompt and sends every
frame, and a decision rides in the prefill frame through all stages in order, so all of them
apply the same decisions in the same order and no stage needs to report (see ``prefix``).

The cache is off (``prefix_book.why_off``) where reuse is not known to be exact or cannot be
applied: a model with sliding-window layers (their KV is trimmed, not kept per position), a stage
on a GPU (the device kernels were not checked row for row) or in a browser (its worker does not
apply decisions), and with ``prefix_cache_positions = 0`` (``serve --no-prefix-cache``).
"""

from __future__ import annotations

from typing import Callable

from ..rules import core, deploy
from ..state import prefix, prefix_book as PB
from ..state.placement import Deployment
from .ports import Ports


class PrefixCaching:
    def __init__(self, ports: Ports, kv_capacity: Callable[[], int | None], executor):
        self.ports = ports
        self.kv_capacity = kv_capacity  # KV positions the active plan's tightest stage holds (None: no budget declared)
        self.executor = executor  # ``executor.Executor``: asks the core; its ``CarryPrefix`` comes back here (``carry``)
        self._carried: dict[str, prefix.PrefillDecision] = {}  # rid -> the decision its prefill frame is to carry (until taken)

    @property
    def cache(self) -> prefix.PrefixCache:
        return self.ports.state().prefix.cache

    @property
    def counts(self) -> PB.PrefixCounts:
        return self.ports.state().prefix.counts

    def why_off(self, dep: Deployment) -> str | None:
        p = self.ports
        return PB.why_off(p.state().workers, p.package.manifest.units, dep, p.settings.prefix_cache_positions)

    def decide(self, dep: Deployment, rid: str, ids: list[int], reuse: bool) -> prefix.PrefillDecision | None:
        """The decision for a prompt prefill of ``ids`` from position 0 (None: the cache is off here)."""
        p = self.ports
        state = p.state()
        if len(ids) < prefix.MIN_COMPUTED or self.why_off(dep) is not None:
            return None
        room = prefix.room_blocks(p.settings.prefix_cache_positions, self.kv_capacity(), deploy.kv_plan_positions(state, 0),
                                  p.settings.prefix_block)
        self.executor.handle(core.PrefillAsked(dep.plan_id, rid, ids, reuse, room))
        return self._carried.pop(rid, None)

    def carry(self, rid: str, decision: prefix.PrefillDecision) -> None:
        """``core.CarryPrefix``: ``rid``'s prefill frame carries ``decision`` (taken by ``decide``)."""
        self._carried[rid] = decision

    def done(self, rid: str, ok: bool) -> None:
        """The frame that carried ``rid``'s decision came back (ok) or failed (the cache is dropped)."""
        self.executor.handle(core.PrefillEnded(rid, ok))

    def view(self) -> dict:
        """What /status and the dashboard show."""
        p = self.ports
        state = p.state()
        dep, cache, counts, block = state.active, state.prefix.cache, state.prefix.counts, p.settings.prefix_block
        return {"on": dep is not None and self.why_off(dep) is None, "off_why": self.why_off(dep) if dep else None,
                "block": block, "blocks": len(cache.blocks), "positions": len(cache.blocks) * block,
                "max_positions": p.settings.prefix_cache_positions, "prefills": counts.prefills, "hits": counts.hits,
                "reused_positions": counts.reused_positions, "dropped": counts.dropped}
