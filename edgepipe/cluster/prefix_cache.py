"""The coordinator's prefix cache (shell): holds the ``prefix.PrefixCache`` value, decides each
prompt prefill with ``prefix.prefill`` and commits or drops it when the frame's token comes back
or fails; counts hits and reused positions for ``/metrics`` and the dashboard.

The coordinator, not the stages, knows what is cached: it sees every prompt and sends every
frame, and a decision rides in the prefill frame through all stages in order, so all of them
apply the same decisions in the same order and no stage needs to report (see ``prefix``).

The cache is off (``why_off``) where reuse is not known to be exact or cannot be applied: a model
with sliding-window layers (their KV is trimmed, not kept per position), a stage on a GPU (the
device kernels were not checked row for row) or in a browser (its worker does not apply
decisions), and with ``prefix_cache_positions = 0`` (``serve --no-prefix-cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import deploy, prefix
from .placement import Deployment


@dataclass
class PrefixCounts:
    prefills: int = 0  # prompt prefills the cache was on for
    hits: int = 0  # ... that reused at least one block
    reused_positions: int = 0  # positions no stage computed
    saved_blocks: int = 0  # blocks kept after computing (committed)
    dropped: int = 0  # times the whole cache was dropped (plan switch, failed frame, a stage's miss)


class PrefixCaching:
    def __init__(self, coord):
        self.coord = coord
        self.cache = prefix.PrefixCache()
        self.counts = PrefixCounts()

    def why_off(self, dep: Deployment) -> str | None:
        c = self.coord
        if c.settings.prefix_cache_positions <= 0:
            return "turned off"
        if any(getattr(u, "kv_window", 0) for u in c.manifest.units):
            return "sliding-window layers"
        for s in dep.stages:
            w = c.cluster.workers.get(s.worker_id)
            if w is not None and (w.hello.kind == "browser" or w.hello.device == "gpu"):
                return f"stage on {s.worker_id} ({'browser' if w.hello.kind == 'browser' else 'gpu'})"
        return None

    def decide(self, dep: Deployment, rid: str, ids: list[int], reuse: bool) -> prefix.PrefillDecision | None:
        """The decision for a prompt prefill of ``ids`` from position 0 (None: the cache is off here)."""
        c = self.coord
        if len(ids) < prefix.MIN_COMPUTED or self.why_off(dep) is not None:
            return None
        if self.cache.plan != dep.plan_id:
            self._drop(prefix.for_plan(self.cache, dep.plan_id), None)
        room = prefix.room_blocks(c.settings.prefix_cache_positions, c.kv_capacity, deploy.kv_plan_positions(c.cluster, 0),
                                  c.settings.prefix_block)
        self.cache, decision = prefix.prefill(self.cache, ids, rid, room, c.settings.prefix_block, reuse)
        self.counts.prefills += 1
        if decision.reuse:
            self.counts.hits += 1
            self.counts.reused_positions += decision.reused_positions
        return None if decision.empty else decision

    def done(self, rid: str, ok: bool) -> None:
        """The frame that carried ``rid``'s decision came back (ok) or failed (drop the cache)."""
        if ok:
            self.counts.saved_blocks += len(self.cache.pending[rid].save) if rid in self.cache.pending else 0
            self.cache = prefix.commit(self.cache, rid)
        elif rid in self.cache.pending:
            self._drop(prefix.abort(self.cache, rid), f"the prefill of {rid} failed part-way")

    def _drop(self, cache: prefix.PrefixCache, why: str | None) -> None:
        if self.cache.blocks:
            self.counts.dropped += 1
            if why:
                self.coord.event("prefix_dropped", blocks=len(self.cache.blocks), why=why)
        self.cache = cache

    def view(self) -> dict:
        """What /status and the dashboard show."""
        c = self.coord
        dep = c.cluster.active
        return {"on": dep is not None and self.why_off(dep) is None, "off_why": self.why_off(dep) if dep else None,
                "block": c.settings.prefix_block, "blocks": len(self.cache.blocks),
                "positions": len(self.cache.blocks) * c.settings.prefix_block, "max_positions": c.settings.prefix_cache_positions,
                "prefills": self.counts.prefills, "hits": self.counts.hits, "reused_positions": self.counts.reused_positions,
                "dropped": self.counts.dropped}
