"""The prefix cache's decisions (pure): which token blocks a plan's stages hold, what a new
prompt reuses, what is evicted, and what a plan switch or a failed frame invalidates.

A prompt is cut into blocks of ``block`` token ids; block ``i`` is named by a hash chained over
blocks ``0..i`` (as vLLM and llama-server do), so one name stands for the whole prefix that ends
with it. Every stage of a plan must hold the same blocks, so the coordinator decides for all of
them: the prefill frame that travels through every stage carries a :class:`PrefillDecision`
(install these blocks, evict those, keep these once computed), and each stage applies it in
frame order. The stages never report what they hold; the coordinator's :class:`PrefixCache`
is the truth, and whenever it might not be (a frame carrying a decision failed or was cancelled
part-way down the pipeline) the whole cache of the plan is dropped: a new ``epoch``, which each
stage sees in the next decision and clears its store for. A plan switch drops it too (a stage's
range, and with it every cached block, changes).

Exactness (the tokens equal those without the cache, greedy, bit for bit): a prefill of ``n``
positions computes each row as a prefill of more or fewer rows does (ONNX Runtime's CPU GEMMs and
attention, fp32, int4 MatMulNBits and the GGUF kernel; ``tests/test_prefix_cache.py``), but a
one-position step takes the one-row kernels, whose sums differ in the last bits. So a reuse leaves
at least ``MIN_COMPUTED`` positions to compute, and only prompt positions (computed by prefills,
never by decode steps) are saved.

Room: cached blocks live beside the sequences' KV in the memory the planner gave each stage. They
get at most ``max_positions`` and never what the running requests may grow to (``room_blocks``);
a decision evicts least recently used blocks, deepest first (the chain it reuses last: the
sequence has its copy by then), before it saves new ones.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import numpy as np

BLOCK_TOKENS = 32
MIN_COMPUTED = 2  # a one-position chunk runs the one-row kernels: bits differ from the same row of a prefill


def block_hashes(ids: list[int], block: int) -> list[str]:
    """The chained name of each full block of ``ids`` (a trailing partial block has none)."""
    names, previous = [], b""
    for i in range(len(ids) // block):
        digest = hashlib.blake2b(previous + np.asarray(ids[i * block:(i + 1) * block], "<i8").tobytes(), digest_size=12).digest()
        names.append(digest.hex())
        previous = digest
    return names


@dataclass(frozen=True)
class Held:
    """One block the plan's stages hold (or will, once ``pending``'s frame is through)."""

    parent: str | None
    depth: int  # block index in its prompt
    used: int  # tick of the latest decision that reused or saved it (LRU)
    pending: str | None = None  # the request whose frame saves it; None: every stage has it


@dataclass(frozen=True)
class PrefillDecision:
    """What one prefill frame tells every stage, in the order they apply it: install ``reuse``
    as the sequence's first positions, drop ``evict`` (the reused blocks too, when the running
    requests leave no room), compute, keep ``save``."""

    epoch: int
    block: int
    reuse: tuple[str, ...] = ()
    save: tuple[tuple[int, str], ...] = ()  # (block index in the prompt, name)
    evict: tuple[str, ...] = ()

    @property
    def reused_positions(self) -> int:
        return len(self.reuse) * self.block

    @property
    def empty(self) -> bool:
        return not (self.reuse or self.save or self.evict)

    def wire(self) -> dict:
        """The ``prefix`` entry of a FORWARD batch item (``docs/protocol.md``)."""
        return {"epoch": self.epoch, "block": self.block, "reuse": list(self.reuse), "save": [list(s) for s in self.save],
                "evict": list(self.evict)}


@dataclass(frozen=True)
class PrefixCache:
    """The blocks one plan's stages hold. Functions below return new values; none mutates."""

    plan: int | None = None
    epoch: int = 0
    blocks: Mapping[str, Held] = field(default_factory=lambda: MappingProxyType({}))
    tick: int = 0
    pending: Mapping[str, PrefillDecision] = field(default_factory=lambda: MappingProxyType({}))  # rid -> its frame's decision

    @property
    def held(self) -> int:
        """Blocks every stage holds or is about to (each stage the same)."""
        return len(self.blocks)

    def reusable(self, ids: list[int], block: int) -> int:
        """How many leading blocks of ``ids`` a prefill would reuse now."""
        names = block_hashes(ids[: max(0, len(ids) - MIN_COMPUTED)], block)
        n = 0
        while n < len(names) and (h := self.blocks.get(names[n])) is not None and h.pending is None:
            n += 1
        return n


def room_blocks(max_positions: int, kv_capacity: int | None, live_positions: int, block: int) -> int:
    """Blocks the cache may hold: ``max_positions`` at most, and never KV the running requests
    may need (``kv_capacity``: positions the tightest stage's budget holds; None: no budget declared)."""
    room = max_positions if kv_capacity is None else min(max_positions, kv_capacity - live_positions)
    return max(0, room) // block


def for_plan(cache: PrefixCache, plan: int | None) -> PrefixCache:
    """The cache on ``plan``: itself, or empty under a new epoch after a plan switch."""
    if cache.plan == plan:
        return cache
    return PrefixCache(plan=plan, epoch=cache.epoch + 1, tick=cache.tick)


def prefill(cache: PrefixCache, ids: list[int], rid: str, room: int, block: int = BLOCK_TOKENS,
            reuse: bool = True) -> tuple[PrefixCache, PrefillDecision]:
    """Decide one prefill of ``ids`` (a prompt, from position 0) for request ``rid``.

    ``room``: blocks the cache may hold after this decision (``room_blocks``); ``reuse``: False
    when the request needs every position computed (prompt logprobs)."""
    tick = cache.tick + 1
    names = block_hashes(ids, block)
    blocks = dict(cache.blocks)
    hits = cache.reusable(ids, block) if reuse else 0
    for name in names[:hits]:
        blocks[name] = replace(blocks[name], used=tick)
    # The prompt's further full blocks, unless held already (another request may be saving them now).
    wanted = [(i, names[i]) for i in range(hits, len(names)) if names[i] not in blocks]
    keep = set(names[:hits])
    evict: list[str] = []
    while len(blocks) + len(wanted) > room:
        leaf = _lru_leaf(blocks, keep) or _lru_leaf(blocks, set())  # the reused chain last
        if leaf is None:
            break
        evict.append(leaf)
        del blocks[leaf]
    # Save only a run that starts where the held chain ends: a block without its parent is unreachable.
    save: list[tuple[int, str]] = []
    for i, name in wanted:
        if len(blocks) >= room or (i > 0 and names[i - 1] not in blocks):
            break
        blocks[name] = Held(names[i - 1] if i else None, i, tick, pending=rid)
        save.append((i, name))
    decision = PrefillDecision(cache.epoch, block, tuple(names[:hits]), tuple(save), tuple(evict))
    pending = dict(cache.pending)
    if not decision.empty:
        pending[rid] = decision
    return replace(cache, blocks=MappingProxyType(blocks), tick=tick, pending=MappingProxyType(pending)), decision


def record(cache: PrefixCache, rid: str, decision: PrefillDecision, parents: tuple[str | None, ...]) -> PrefixCache:
    """The cache ``prefill`` left after deciding ``decision`` for ``rid`` (``parents``: the block
    each saved block follows), rebuilt from the decision alone: what an event log replays."""
    tick = cache.tick + 1
    blocks = dict(cache.blocks)
    for name in decision.reuse:
        if name in blocks:
            blocks[name] = replace(blocks[name], used=tick)
    for name in decision.evict:
        blocks.pop(name, None)
    for (i, name), parent in zip(decision.save, parents):
        blocks[name] = Held(parent, i, tick, pending=rid)
    pending = {**cache.pending, rid: decision} if not decision.empty else cache.pending
    return replace(cache, blocks=MappingProxyType(blocks), tick=tick, pending=MappingProxyType(dict(pending)))


def _lru_leaf(blocks: dict[str, Held], keep: set[str]) -> str | None:
    """The least recently used block no other block builds on (deepest first among equals)."""
    parents = {h.parent for h in blocks.values()}
    leaves = [(h.used, -h.depth, name) for name, h in blocks.items() if name not in parents and name not in keep]
    return min(leaves)[2] if leaves else None


def commit(cache: PrefixCache, rid: str) -> PrefixCache:
    """``rid``'s prefill came back from the last stage: every stage applied its decision."""
    decision = cache.pending.get(rid)
    if decision is None:
        return cache
    pending = {k: v for k, v in cache.pending.items() if k != rid}
    blocks = {name: (replace(h, pending=None) if h.pending == rid else h) for name, h in cache.blocks.items()}
    return replace(cache, blocks=MappingProxyType(blocks), pending=MappingProxyType(pending))


def abort(cache: PrefixCache, rid: str) -> PrefixCache:
    """``rid``'s prefill failed or was given up: some stages may have applied its decision and
    others not, so nothing cached is known to be the same everywhere. A new epoch, empty."""
    if rid not in cache.pending:
        return cache
    return PrefixCache(plan=cache.plan, epoch=cache.epoch + 1, tick=cache.tick)


def reset(cache: PrefixCache) -> PrefixCache:
    """Drop everything (a stage said it lacks a block it should hold)."""
    return PrefixCache(plan=cache.plan, epoch=cache.epoch + 1, tick=cache.tick)
