"""Membership decisions: who is alive, who is suspected, who is lost (pure, over ``ClusterState``).

A worker is judged by how long it has been silent compared with what was observed of it
(phi accrual, Hayashibara et al. 2004): with the mean and spread of its recent heartbeat gaps,
``phi = -log10 P(a gap at least this long)``. A silent worker is first *suspected* (no new plan
uses it and it is probed), and *lost* only after it stayed silent for a grace period that grows
with the longest gap seen from it, so a machine that stalls for a few seconds under load (a
session build, swapping) is not dropped. A lost worker is not banned: when it reconnects it
joins again and keeps its calibration (``ClusterProfile.recall``).

A worker is also judged by what it does: one that answers pings but returns nothing for a
step (``idle_stage``: its count of computed rows did not move while its pongs kept coming) is
lost and quarantined (``state.Misbehaved``) — kept out of new plans for a while, doubling for
each repeat, and planned again once the time is up (``quarantine_ended``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..state.state import ClusterState, PlanAbandoned, Suspected, WorkerInfo, apply


@dataclass(frozen=True)
class LivenessSettings:
    heartbeat_s: float = 0.5  # ping period
    suspect_phi: float = 8.0  # suspect when a gap this long had probability < 10^-phi
    min_suspect_s: float = 2.0  # never suspect before this much silence
    lose_after_s: float = 10.0  # lose a suspected worker after this much silence at least...
    lose_gap_factor: float = 3.0  # ...or this many times the longest gap observed from it
    abandon_gap_factor: float = 2.0  # route around an active stage silent this many times its longest gap (or min_suspect_s)


@dataclass(frozen=True)
class Suspect:
    worker_id: str
    silent_s: float


@dataclass(frozen=True)
class Lose:
    worker_id: str
    why: str


Verdict = Suspect | Lose


def phi(worker: WorkerInfo, now: float, heartbeat_s: float) -> float:
    """Suspicion level of a worker silent since ``worker.last_seen`` (0: just heard)."""
    silent = now - worker.last_seen
    if silent <= 0:
        return 0.0
    gaps = worker.intervals or (heartbeat_s,)
    mean = math.fsum(gaps) / len(gaps)
    var = math.fsum((g - mean) ** 2 for g in gaps) / len(gaps)
    std = max(math.sqrt(var), 0.25 * mean, 0.05)
    z = (silent - mean) / std
    # P(gap >= silent) for a normal gap distribution, via the complementary error function.
    p = 0.5 * math.erfc(z / math.sqrt(2))
    return math.inf if p <= 0 else -math.log10(p)


def longest_gap(worker: WorkerInfo, settings: LivenessSettings) -> float:
    """The longest silence seen from this worker (recent gaps and its remembered stalls)."""
    return max(worker.intervals + worker.stalls, default=settings.heartbeat_s)


def lose_after(worker: WorkerInfo, settings: LivenessSettings) -> float:
    """Seconds of silence after which a suspected worker is lost (adapts to its history)."""
    return max(settings.lose_after_s, settings.lose_gap_factor * longest_gap(worker, settings))


def abandon_after(worker: WorkerInfo, settings: LivenessSettings, replay_s: float) -> float:
    """Seconds of silence after which a stage of the active plan is routed around (see
    ``abandon_active``). Abandoning costs ``replay_s`` (rebuilding the live sequences' KV on the
    spare), waiting costs the silence: as in ski rental, wait about as long as abandoning would
    cost — but no longer than twice the longest stall seen from this worker (a worker whose loop
    stalled for 2 s under load gets 4 s; one that always answered, then froze, gets the floor)."""
    return max(settings.min_suspect_s, min(settings.abandon_gap_factor * longest_gap(worker, settings), replay_s))


def silent_stages(state: ClusterState, now: float, settings: LivenessSettings, replay_s: float) -> list[str]:
    """Suspected stages of the active plan silent past their ``abandon_after``, in id order."""
    return sorted(wid for wid, w in state.workers.items()
                  if state.uses(wid) and w.suspected_since is not None and now - w.last_seen >= abandon_after(w, settings, replay_s))


def verdicts(state: ClusterState, now: float, settings: LivenessSettings) -> list[Verdict]:
    """What to do about each silent worker now, in worker-id order."""
    out: list[Verdict] = []
    for wid in sorted(state.workers):
        w = state.workers[wid]
        silent = now - w.last_seen
        if silent >= lose_after(w, settings):
            out.append(Lose(wid, f"silent for {silent:.1f} s (suspected, probed, no answer)"))
        elif w.suspected_since is None and silent >= settings.min_suspect_s and phi(w, now, settings.heartbeat_s) >= settings.suspect_phi:
            out.append(Suspect(wid, silent))
    return out


def computed_counts(state: ClusterState, worker_ids: Sequence[str]) -> dict[str, int | None]:
    """Each worker's count of computed rows as of its last pong (None: it reports none)."""
    out: dict[str, int | None] = {}
    for wid in worker_ids:
        w = state.workers.get(wid)
        value = w.stats.get("computed") if w is not None else None
        out[wid] = int(value) if isinstance(value, int) and not isinstance(value, bool) else None
    return out


def idle_stage(state: ClusterState, stage_ids: Sequence[str], before: Mapping[str, int | None], sent_at: float,
               alone: bool = True) -> str | None:
    """The stage to blame for a step that timed out, or None when it cannot be told.

    Stages are taken in pipeline order: a stage that did compute passed the step on, so the
    first one whose computed count has not moved since the step was sent — while it kept
    answering pings after that (a silent worker is membership's business, not this) — is the
    one that dropped it. That reasoning holds past the first stage only when this step was
    ``alone`` on the plan (no other step in flight or sent meanwhile): otherwise a predecessor's
    count may have moved for other work while it dropped this frame, and the stage after it
    would be blamed for starving. The first stage is fed by the coordinator itself: if it
    computed nothing at all, it is at fault either way. When nobody can be blamed the step is
    simply retried."""
    for i, wid in enumerate(stage_ids):
        w = state.workers.get(wid)
        was = before.get(wid)
        if w is None or was is None or w.stats_at is None or w.stats_at <= sent_at:
            return None
        now = computed_counts(state, [wid])[wid]
        if now is None:
            return None
        if now <= was:
            return wid if i == 0 or alone else None
    return None


def quarantine_ended(state: ClusterState, since: float, now: float) -> bool:
    """Whether a quarantine ran out in ``(since, now]`` (the device may be planned again)."""
    return any(since < q.until <= now for q in state.quarantine.values())


def abandon_active(state: ClusterState, suspects: Sequence[str], lacking: str | None) -> bool:
    """Whether to stop using the active plan now that ``suspects`` went silent: only when it uses
    one of them, the workers still heard from may hold the model (``lacking`` is None), and the
    prepared spare plan avoids every silent worker (its files and sessions are in place, so the
    switch is cheap). Otherwise waiting beats re-planning: a worker that is merely slow to answer
    on a busy machine wakes up, while building a new plan there makes everyone slower."""
    if lacking is not None or not any(state.uses(wid) for wid in suspects):
        return False
    live = {w.id for w in state.live()}
    return bool(state.spare) and {s.worker_id for s in state.spare} <= live


@dataclass(frozen=True)
class Beat:
    """What one heartbeat decides (``beat``): the events to emit (``Suspected``, then at most one
    ``PlanAbandoned``, in that order), the workers to take out, whether the re-planner looks again."""

    events: tuple[Suspected | PlanAbandoned, ...]
    lose: tuple[Lose, ...]
    replan: bool
    abandoned: int | None = None  # the active plan given up (its steps fail; the spare serves next)


def beat(state: ClusterState, last: float, now: float, settings: LivenessSettings, replay_s: float,
         lacking: Callable[[ClusterState], str | None]) -> Beat:
    """One heartbeat's verdicts since the last (at ``last``): suspect or lose silent workers, and
    give up the active plan when a stage went silent and ``abandon_active`` says the others can
    serve without it (judged on the state with this beat's suspicions applied). ``lacking``:
    why the workers of a state cannot hold the model (None: they may)."""
    replan = quarantine_ended(state, last, now)  # a quarantined device may be planned again
    events: list[Suspected | PlanAbandoned] = []
    lose: list[Lose] = []
    for verdict in verdicts(state, now, settings):
        if isinstance(verdict, Lose):
            lose.append(verdict)
        else:
            events.append(Suspected(verdict.worker_id, now))
            state = apply(state, events[-1])
    suspects = silent_stages(state, now, settings, replay_s)
    if suspects and abandon_active(state, suspects, lacking(state)):
        # A frozen stage would hold every request until it wakes or the step times out:
        # serve from the others now; it rejoins the plans when heard from again.
        plan = state.active.plan_id
        events.append(PlanAbandoned(plan, f"plan {plan}: stage {', '.join(suspects)} went silent", now))
        return Beat(tuple(events), tuple(lose), True, plan)
    return Beat(tuple(events), tuple(lose), replan)
