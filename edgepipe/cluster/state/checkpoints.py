"""KV checkpoints for recovery: live sequences' KV copied, in the background, to the spare plan.

While serving, the workers of the active plan copy a sequence's KV (the layers each spare stage
will hold, ``deploy.kv_moves`` from the active plan to the spare) to the spare plan's workers,
every ``interval`` generated positions, at most ``max_in_flight`` sequences at a time. The copy
is asked for between two steps of the sequence, when every stage holds ``kv_len`` positions of
it, and taken as it was at that length (``KvExport.upto``: a later stage may run the next step
before the request reaches it; one that holds fewer refuses, and the checkpoint is void). It is
stored under a name of its own (``KvExport.as_seq``), so nothing done to the live sequence
touches it. Once the holders hold a checkpoint at ``p``, the next copies only positions from
``p`` on (``KvExport.since``), appended on the receiver; a void checkpoint starts over whole
under a new name.

The state records, per sequence, which positions each spare stage holds (``Checkpoint``); a
checkpoint counts only when every spare stage that keeps KV holds the same position ``p``. When
the spare plan is committed (recovery), each sequence with such a checkpoint resumes at ``p`` and
replays only the tokens after it (``RequestInfo.resume``, set by ``state.apply``); any other
sequence, and one whose resumed step fails, is rebuilt by full replay. A resumed step tells the
stages to forget positions beyond ``p`` (``rewind``): a round of copies under way at the failure
may have moved some holders on, on some layers. A new spare, a lost
holder, a plan prepared that gives a holder another stage (it drops its spare session for it:
``displaced``), a failed copy or a finished sequence void the checkpoint; ``Checkpoints.sweep`` drops
KV no longer referenced from the workers that hold it.

This module holds the state and the decisions (``due``, ``Checkpoint.position``, ``resumable``,
``resume_point``, the reducers ``sending`` and ``stored``), all pure; ``checkpointing.Checkpoints``
is the I/O that carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, Sequence

from .placement import StageAssignment



# -- the state ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoint:
    """What the spare plan holds of one sequence: KV stored as ``seq`` on each holder."""

    seq: str  # the name it is stored under on the spare's workers
    spare: tuple[StageAssignment, ...]  # the spare plan it was copied to
    needs: frozenset[str]  # the spare's workers that keep KV (each must hold it)
    held: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # worker -> positions it holds
    # A round of copies to this position is under way: a holder may have taken part of it (some
    # layers, from one sender, its length moved on) and not the rest. What every holder
    # acknowledged (``position``) is whole on every layer all the same: a sequence resuming there
    # tells the stages to forget what they hold beyond it (``rewind``).
    sending: int | None = None

    def position(self) -> int | None:
        """The position every holder acknowledged (None: some holder lacks it or they differ)."""
        ps = {self.held.get(w) for w in self.needs}
        return ps.pop() if len(ps) == 1 and None not in ps and self.needs else None


@dataclass(frozen=True)
class Resume:
    """Where a sequence resumes on plan ``plan``: its KV up to ``position`` is held as ``seq``."""

    plan: int
    seq: str
    position: int


# -- events -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointSending:
    """Copies of ``rid``'s KV up to ``position`` are on their way to the spare's holders as ``seq``."""

    rid: str
    seq: str
    spare: tuple[StageAssignment, ...]
    needs: frozenset[str]
    position: int


@dataclass(frozen=True)
class CheckpointStored:
    """``worker`` of the spare plan ``spare`` holds ``rid``'s KV as ``seq`` up to ``position``;
    ``nbytes``: the KV bytes the round's copies installed on all holders (the ``checkpoint`` line)."""

    rid: str
    seq: str
    spare: tuple[StageAssignment, ...]
    needs: frozenset[str]
    worker: str
    position: int
    nbytes: int = 0


@dataclass(frozen=True)
class CheckpointVoid:
    """``rid``'s checkpoint cannot be trusted (a copy failed, its resumed step failed)."""

    rid: str
    why: str


def sending(checkpoints: Mapping[str, Checkpoint], spare, event: CheckpointSending) -> Mapping[str, Checkpoint]:
    """The checkpoints once a round of copies started (ignored when the spare changed since)."""
    if spare != event.spare:
        return checkpoints
    ck = checkpoints.get(event.rid)
    if ck is None or ck.seq != event.seq or ck.spare != event.spare:
        ck = Checkpoint(event.seq, event.spare, event.needs)
    return MappingProxyType({**checkpoints, event.rid: replace(ck, sending=event.position)})


def stored(checkpoints: Mapping[str, Checkpoint], spare, built: frozenset[str], event: CheckpointStored) -> Mapping[str, Checkpoint]:
    """The checkpoints after a holder's acknowledgement (ignored when the spare changed since, or
    the holder's spare session is no longer built: the KV went with it, ``displaced``); the round
    is over once every holder acknowledged its position."""
    if spare != event.spare or event.worker not in built:
        return checkpoints
    ck = checkpoints.get(event.rid)
    if ck is None or ck.seq != event.seq or ck.spare != event.spare:
        ck = Checkpoint(event.seq, event.spare, event.needs)
    held = MappingProxyType({**ck.held, event.worker: event.position})
    done = ck.sending is not None and all(held.get(w) == ck.sending for w in ck.needs)
    return MappingProxyType({**checkpoints, event.rid: replace(ck, held=held, sending=None if done else ck.sending)})


def resumable(checkpoints: Mapping[str, Checkpoint], spare, stages: Sequence[StageAssignment], plan: int) -> dict[str, Resume]:
    """At the commit of ``stages`` as ``plan``: the sequences that resume from their checkpoint
    (the committed plan is the spare they were copied to, every holder at the same position)."""
    if spare is None or _key(spare) != _key(stages):
        return {}
    out = {}
    for rid, ck in checkpoints.items():
        p = ck.position()
        if p is not None and ck.spare == spare:
            out[rid] = Resume(plan, ck.seq, p)
    return out


def displaced(spare, stages: Sequence[StageAssignment]) -> frozenset[str]:
    """The spare's workers that a plan of ``stages`` gives a stage of another range: preparing it,
    each drops its spare session, and the checkpoint KV in it, for the new stage
    (``worker.core._fetched``: the real stage takes the memory the warm spare held)."""
    ranges: dict[str, set[tuple[int, int]]] = {}
    for s in spare or ():
        ranges.setdefault(s.worker_id, set()).add((s.start, s.end))
    return frozenset(s.worker_id for s in stages if s.worker_id in ranges and (s.start, s.end) not in ranges[s.worker_id])


def without_holders(checkpoints: Mapping[str, Checkpoint], workers: frozenset[str]) -> Mapping[str, Checkpoint]:
    """The checkpoints that none of ``workers`` holds a part of (the rest are void)."""
    return MappingProxyType({rid: ck for rid, ck in checkpoints.items() if not ck.needs & workers})


def _key(stages) -> list:
    return [(s.worker_id, s.start, s.end) for s in stages]


# -- decisions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointSettings:
    interval: int = 32  # positions generated since the last checkpoint before the next (0: off)
    max_in_flight: int = 2  # sequences being copied at once (bounds the bandwidth and compute checkpoints take)


def due(settings: CheckpointSettings, kv_len: int, prompt_len: int, held: int | None, in_flight: int, rid_in_flight: bool) -> bool:
    """Whether to checkpoint a sequence now: ``kv_len`` positions in its KV, ``held`` of them
    checkpointed (None: none), ``in_flight`` sequences being copied (``rid_in_flight``: this one)."""
    if settings.interval <= 0 or rid_in_flight or in_flight >= settings.max_in_flight:
        return False
    generated = kv_len - prompt_len
    return generated >= settings.interval and kv_len - (held or 0) >= settings.interval


def resume_point(resume: Resume | None, plan: int, prompt_len: int, total: int) -> Resume | None:
    """The checkpoint a sequence of ``total`` tokens (``prompt_len`` of them the prompt) resumes
    from on ``plan``, or None to replay it whole: the checkpoint must be for this plan and hold
    the whole prompt and at most the tokens before the last (which the next step feeds)."""
    if resume is None or resume.plan != plan or not prompt_len <= resume.position < total:
        return None
    return resume


# -- the copies in flight and where checkpoint KV may be held -----------------------------------
@dataclass(frozen=True)
class CopySent:
    """Copy ``move`` of a round of ``rid``'s checkpoint is on its way from ``src`` to ``dst``
    (acknowledged by LOADED ``kv_received``; the shell awaits it)."""

    move: int
    rid: str
    src: str
    dst: str


@dataclass(frozen=True)
class RoundEnded:
    """``rid``'s round of copies is over (each acknowledged, failed or timed out): its copies
    ``moves`` are no longer in flight, and a frame of them can no longer land."""

    rid: str
    moves: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointDropped:
    """Checkpoint KV ``seq`` was dropped from every worker that may hold it (``unreferenced``)."""

    seq: str


@dataclass(frozen=True)
class CopyBook:
    """What the copies of checkpoints left in flight and on the workers (``ClusterState.copies``)."""

    flying: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # rid -> the name its round's copies go to
    placed: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))  # name -> workers that may hold it
    copies: Mapping[int, tuple[str, str]] = field(default_factory=lambda: MappingProxyType({}))  # copy in flight -> (source, destination)

    def __bool__(self) -> bool:
        return bool(self.flying or self.placed or self.copies)


def book(b: CopyBook, event) -> CopyBook:
    """The book after a checkpoint event (any other leaves it as it was). A round's names are
    placed and flying from its ``CheckpointSending`` on, whatever became of the request: a frame
    it sent may still land, so its name is dropped only once the round is over."""
    match event:
        case CheckpointSending(rid, seq, _, needs, _):
            placed = {**b.placed, seq: b.placed.get(seq, frozenset()) | needs}
            return replace(b, flying=MappingProxyType({**b.flying, rid: seq}), placed=MappingProxyType(placed))
        case CopySent(move, _, src, dst):
            return replace(b, copies=MappingProxyType({**b.copies, move: (src, dst)}))
        case RoundEnded(rid, moves):
            return replace(b, flying=MappingProxyType({r: n for r, n in b.flying.items() if r != rid}),
                           copies=MappingProxyType({m: c for m, c in b.copies.items() if m not in moves}))
        case CheckpointDropped(seq):
            return replace(b, placed=MappingProxyType({n: w for n, w in b.placed.items() if n != seq}))
    return b


def referenced(checkpoints: Mapping[str, Checkpoint], requests: Mapping) -> set[str]:
    """Checkpoint names still in use: a checkpoint of a running sequence, a resume not yet taken,
    or a live sequence that resumed from one."""
    names = {ck.seq for ck in checkpoints.values()}
    for q in requests.values():
        names.add(q.seq)
        if q.resume is not None:
            names.add(q.resume.seq)
    return names


def unreferenced(b: CopyBook, checkpoints: Mapping[str, Checkpoint], requests: Mapping) -> list[tuple[str, list[str]]]:
    """The checkpoint KV to drop now, as (name, the workers that may hold it): placed, referenced
    by nobody, and no round of copies to it under way (its import would create it again)."""
    keep, busy = referenced(checkpoints, requests), set(b.flying.values())
    return [(name, sorted(workers)) for name, workers in b.placed.items() if name not in keep and name not in busy]


def copies_lost(b: CopyBook, worker: str) -> tuple[list[int], list[int]]:
    """A worker left: the copies that fail now (to it: its KV went with it) and those that fail
    after a grace (from it: a frame it sent whole may still land)."""
    return ([m for m, (_, dst) in b.copies.items() if dst == worker],
            [m for m, (src, dst) in b.copies.items() if src == worker and dst != worker])
