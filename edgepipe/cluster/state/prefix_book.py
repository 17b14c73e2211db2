"""The prefix cache's bookkeeping, as part of the cluster state (pure): which blocks the active
plan's stages hold (``prefix.PrefixCache``), the decisions whose frames are still travelling, and
the counts (``/metrics``, the dashboard), changed only by events through ``apply``.

``decide`` is the lookup: a prompt prefill's ``PrefixDecided`` event (what it reuses, evicts and
saves) or None where the cache is off (``why_off``). A frame that came back commits its
decision (``PrefixDone(ok=True)``); one that failed part-way drops the whole cache
(``PrefixDone(ok=False)``: a new epoch). A plan committed (a switch, or a recovery onto the
spare) invalidates the cache of any other plan (``switched``): its stages hold other layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import prefix
from .placement import Deployment


@dataclass(frozen=True)
class PrefixCounts:
    prefills: int = 0  # prompt prefills the cache was on for
    hits: int = 0  # ... that reused at least one block
    reused_positions: int = 0  # positions no stage computed
    saved_blocks: int = 0  # blocks kept after computing (committed)
    dropped: int = 0  # times the whole cache was dropped (plan switch, failed frame, a stage's miss)


@dataclass(frozen=True)
class PrefixBook:
    cache: prefix.PrefixCache = prefix.PrefixCache()
    counts: PrefixCounts = PrefixCounts()
    last_drop: tuple[int, str] | None = None  # (blocks, why) the latest PrefixDone dropped (its dashboard line)


@dataclass(frozen=True)
class PrefixDecided:
    """A prompt prefill of ``rid`` on ``plan`` carries ``decision`` (``parents``: the block each
    saved block follows, so that a replay rebuilds the chain)."""

    rid: str
    plan: int
    decision: prefix.PrefillDecision
    parents: tuple[str | None, ...]


@dataclass(frozen=True)
class PrefixDone:
    """The frame that carried ``rid``'s decision came back from the last stage (``ok``) or failed."""

    rid: str
    ok: bool


def why_off(workers, units, dep: Deployment, max_positions: int) -> str | None:
    """Why the cache is off on ``dep`` (None: on). ``workers``: the state's, ``units``: the manifest's."""
    if max_positions <= 0:
        return "turned off"
    if any(getattr(u, "kv_window", 0) for u in units):
        return "sliding-window layers"
    for s in dep.stages:
        w = workers.get(s.worker_id)
        if w is not None and not w.caps.kind.prefix_cache:
            return f"stage on {s.worker_id} ({w.caps.kind.name})"
    return None


def decide(book: PrefixBook, plan: int, rid: str, ids: list[int], room: int, block: int, reuse: bool) -> PrefixDecided | None:
    """The event of a prompt prefill of ``ids`` from position 0 on ``plan`` (None: too short to
    cache). ``room``: blocks the cache may hold (``prefix.room_blocks``); ``reuse``: False when
    every position must be computed (prompt logprobs)."""
    if len(ids) < prefix.MIN_COMPUTED:
        return None
    cache, decision = prefix.prefill(prefix.for_plan(book.cache, plan), ids, rid, room, block, reuse)
    return PrefixDecided(rid, plan, decision, tuple(cache.blocks[name].parent for _, name in decision.save))


def switched(book: PrefixBook, plan: int | None) -> PrefixBook:
    """``plan`` committed (None: the active plan went down): a cache of any other plan is dropped
    (a new epoch, empty)."""
    if book.cache.plan == plan:
        return book
    dropped = book.counts.dropped + (1 if book.cache.blocks else 0)
    return replace(book, cache=prefix.for_plan(book.cache, plan), counts=replace(book.counts, dropped=dropped), last_drop=None)


def apply(book: PrefixBook, event: PrefixDecided | PrefixDone) -> PrefixBook:
    """The book after one of its events (pure; a late one about a request not pending changes nothing)."""
    counts = book.counts
    match event:
        case PrefixDecided(rid, plan, decision, parents):
            book = switched(book, plan)  # a decision on another plan than the cache's (it changed under the step)
            counts = replace(book.counts, prefills=book.counts.prefills + 1, hits=book.counts.hits + bool(decision.reuse),
                             reused_positions=book.counts.reused_positions + decision.reused_positions)
            return PrefixBook(prefix.record(book.cache, rid, decision, parents), counts)
        case PrefixDone(rid, True) if rid in book.cache.pending:
            counts = replace(counts, saved_blocks=counts.saved_blocks + len(book.cache.pending[rid].save))
            return PrefixBook(prefix.commit(book.cache, rid), counts)
        case PrefixDone(rid, False) if rid in book.cache.pending:
            held = len(book.cache.blocks)
            counts = replace(counts, dropped=counts.dropped + 1) if held else counts
            return PrefixBook(prefix.abort(book.cache, rid), counts, (held, f"the prefill of {rid} failed part-way") if held else None)
    return replace(book, last_drop=None) if book.last_drop else book
