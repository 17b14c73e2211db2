"""A request's progress through its steps, decided (pure): what its next step feeds, and what a
step's outcome makes of it.

Where a request's token loop stands is state: ``RequestInfo.progress`` (``state.Progress``: the
sequence id its steps go under and its epoch, the plan its KV was fed on, the plan its latest
step went to, whether the stages hold rejected drafts, the checkpoint it resumed from, its
consecutive broken steps and when it last made progress), changed only by events. Two rules
read it:

``plan_step(state, rid, plan, prompt_ids, generated) -> Planned``: resume or replay. On the plan
that holds its KV (or that its KV moved to with its layers) it resumes with its last token; on a
plan that holds a checkpoint of it, it replays only the tokens after the checkpoint; on any other
plan it replays everything under a new epoch (the old id's KV is dropped first), so that no token
is lost or repeated.

``after_step(state, rid, outcome, now, settings) -> (events, commands)``: a step yielded tokens
(``Yielded``: its KV is fed, the next step follows: ``FeedNext``), or broke (``Broke``: the
request pauses, a KV move that brought it and the checkpoint it resumed from are void, and it
retries after a backoff, ``Retry``; or, with no token for ``max_wait_s``, fails: ``Fail``).

``schedule(state, waiting, plan, stopped, lacking, now, waits) -> commands``: one decision for
every sequence between steps at once: on a usable plan each gets its next step (``StartStep``, from
``plan_step``); while there is none each waits, or fails once its wait exceeds its bound
(``FailRequest``); once the coordinator halted each fails with its reason.

The scheduler (``shells.requests``) asks ``schedule`` whenever steps have come back or sequences
arrived, carries out its commands (a step's I/O, one task per step in flight) and turns each
step's outcome into ``after_step``'s events and commands.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..state import checkpoints, sequence_ids
from ..state.events import KvMoved, RequestFed, RequestPaused, StepBroke, StepPlanned
from ..state.state import CheckpointVoid, ClusterState
from .scheduling import WaitSettings, next_feed, wait_verdict

RETRY_STEP_S = 0.01  # the backoff grows by this per consecutive broken step...
RETRY_MAX_S = 0.25  # ...up to this


@dataclass(frozen=True)
class NextStep:
    """Resume or replay (``next_step``): what a sequence's next step feeds, under which id."""

    seq: str | None  # a new sequence id (the old one's KV is void: dropped, replayed or resumed from a checkpoint); None: the same
    epoch: int  # the epoch of the id it feeds under
    fed_plan: int | None  # the plan whose workers hold its KV once this step is fed
    feed: list[int]  # the token ids to send
    replay_from: int | None  # positions before this go as one prefill frame, the rest one by one
    resume: checkpoints.Resume | None = None  # the checkpoint on the spare it resumes from (replaying only what came after it)


def next_step(state: ClusterState, rid: str, fed_plan: int | None, plan: int, prompt_ids: list[int], generated: list[int],
              epoch: int) -> NextStep:
    """Resume or replay on ``plan`` (``fed_plan``: where it was last fed, -1 after a broken step,
    None before the first; ``scheduling.next_feed``), a checkpoint on ``plan`` saving the replay
    of what it holds."""
    info = state.requests.get(rid)
    nxt = next_feed(fed_plan, plan, info.migrated_to if info else None, prompt_ids, generated)
    total = len(prompt_ids) + len(generated)
    resume = checkpoints.resume_point(info.resume if info else None, plan, len(prompt_ids), total) if nxt.fed_plan != plan else None
    if resume is not None:
        feed = (prompt_ids + generated)[resume.position:]
        return NextStep(resume.seq, epoch + 1, plan, feed, 1 if len(feed) > 1 else None, resume)
    if nxt.new_epoch:
        return NextStep(sequence_ids.live(rid, epoch + 1), epoch + 1, nxt.fed_plan, nxt.feed, nxt.replay_from)
    return NextStep(None, epoch, nxt.fed_plan, nxt.feed, nxt.replay_from)


@dataclass(frozen=True)
class Planned:
    """A request's next step, carried out in this order: ``drop`` (the KV its old id left on a
    plan: ``(seq, plan)``), then ``event`` (its progress), then the step ``step`` feeds."""

    drop: tuple[str, int] | None
    event: StepPlanned
    step: NextStep
    rewind: bool  # the step tells the stages to forget positions past its start (rejected drafts, a checkpoint's extra)


def plan_step(state: ClusterState, rid: str, plan: int, prompt_ids: list[int], generated: list[int]) -> Planned:
    """Resume or replay ``rid`` (a running request) on the active ``plan``, from its progress."""
    now = state.requests[rid].progress
    nxt = next_step(state, rid, now.fed_plan, plan, prompt_ids, generated, now.epoch)
    replay = nxt.seq is not None  # the plan changed under it: its KV is rebuilt by replay (or from a checkpoint)
    drop = (now.seq, now.fed_plan) if replay and now.fed_plan is not None else None
    # A prefill or a replay leaves no rejected drafts on the stages. A checkpoint's holder may hold
    # more of it than the checkpoint (a round of copies was under way), and KV moved from another
    # plan may hold a position past the count (its stage ran a step it fed itself, ``direct``):
    # the step forgets the rest.
    moved = not replay and now.fed_plan is not None and now.fed_plan != plan
    rewind = nxt.resume is not None or moved or (now.rewind and len(nxt.feed) <= 1)
    event = StepPlanned(rid, plan, nxt.seq if replay else now.seq, nxt.epoch, nxt.fed_plan, rewind, nxt.resume, replay)
    return Planned(drop, event, nxt, rewind)


# -- a step's outcome -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Yielded:
    """The step came back: its KV lives on ``plan`` with ``kv_len`` positions; ``rewind``: the
    stages hold drafts the verify rejected."""

    plan: int
    kv_len: int
    rewind: bool = False


@dataclass(frozen=True)
class Broke:
    """Step ``step`` broke (``PipelineBroken``: its plan lost a worker, or gave the step up)."""

    step: int
    why: str


Outcome = Yielded | Broke


@dataclass(frozen=True)
class FeedNext:
    """Go on: the next step (or the end, once the sequence finished)."""


@dataclass(frozen=True)
class Retry:
    """Wait ``after_s``, then plan the step again (always a wait: the task that takes a dead
    worker out must get to run, and a send to a closed channel fails without awaiting)."""

    after_s: float


@dataclass(frozen=True)
class Fail:
    """The request fails now with ``why`` (one line)."""

    why: str


Command = FeedNext | Retry | Fail


@dataclass(frozen=True)
class ProgressSettings:
    max_wait_s: float = 300.0  # no token for this long: the request fails


def after_step(state: ClusterState, rid: str, outcome: Outcome, now: float, settings: ProgressSettings) -> tuple[tuple, tuple[Command, ...]]:
    """The events and commands of a step's outcome for ``rid`` (a running request)."""
    info = state.requests[rid]
    progress = info.progress
    match outcome:
        case Yielded(plan, kv_len, rewind):
            return (RequestFed(rid, progress.seq, plan, kv_len, now, rewind),), (FeedNext(),)
        case Broke(step, why):
            waited = now - progress.last_progress
            if waited >= settings.max_wait_s:
                return (), (Fail(f"no token for {waited:.0f} s: {why}"),)
            events: list = [RequestPaused(rid, step, why, now)] if info.paused is None else []  # the first break since its last token
            # Stages before the failure may have taken the step: its KV there is no longer known
            # to be whole, so a move that brought it is void and the retry replays; so is the
            # checkpoint it resumed from.
            events += [StepBroke(rid, why, now), KvMoved(rid, None)]
            if progress.resume is not None:
                events.append(CheckpointVoid(rid, why))
            return tuple(events), (Retry(min(RETRY_STEP_S * (progress.breaks + 1), RETRY_MAX_S)),)
    raise TypeError(f"not a step's outcome: {outcome!r}")


# -- one decision for every sequence between steps ------------------------------------------------
@dataclass(frozen=True)
class Waiting:
    """A running request between steps (its latest step came back, or it has not stepped yet)."""

    rid: str
    prompt_ids: list[int]
    generated: list[int]


@dataclass(frozen=True)
class StartStep:
    """Carry out ``planned``, the request's next step on the usable plan."""

    rid: str
    planned: Planned


@dataclass(frozen=True)
class FailRequest:
    """The request fails now with ``why`` (one line)."""

    rid: str
    why: str


Decision = StartStep | FailRequest


def schedule(state: ClusterState, waiting: tuple[Waiting, ...], plan: int | None, stopped: str | None, lacking: str | None,
             now: float, waits: WaitSettings) -> tuple[Decision, ...]:
    """The next step of every sequence in ``waiting`` on ``plan`` (the active plan while it is Up
    and no plan is being swapped in; None: there is none to step on). Without a plan a sequence
    keeps waiting (no command) until ``wait_verdict`` says its wait, counted from its latest
    progress, is over; ``lacking`` says why the workers cannot hold the model (None: they may).
    ``stopped``: why the coordinator halted (every waiting request fails with it)."""
    decisions: list[Decision] = []
    for w in waiting:
        if stopped:
            decisions.append(FailRequest(w.rid, stopped))
        elif plan is not None:
            decisions.append(StartStep(w.rid, plan_step(state, w.rid, plan, w.prompt_ids, w.generated)))
        elif (why := wait_verdict(state, now - state.requests[w.rid].progress.last_progress, lacking, waits)) is not None:
            decisions.append(FailRequest(w.rid, why))
    return tuple(decisions)
