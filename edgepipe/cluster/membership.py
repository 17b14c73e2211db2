"""Membership decisions: who is alive, who is suspected, who is lost (pure, over ``ClusterState``).

A worker is judged by how long it has been silent compared with what was observed of it
(phi accrual, Hayashibara et al. 2004): with the mean and spread of its recent heartbeat gaps,
``phi = -log10 P(a gap at least this long)``. A silent worker is first *suspected* (no new plan
uses it and it is probed), and *lost* only after it stayed silent for a grace period that grows
with the longest gap seen from it, so a machine that stalls for a few seconds under load (a
session build, swapping) is not dropped. A lost worker is not banned: when it reconnects it
joins again and keeps its calibration (``ClusterProfile.recall``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .state import ClusterState, WorkerInfo


@dataclass(frozen=True)
class LivenessSettings:
    heartbeat_s: float = 0.5  # ping period
    suspect_phi: float = 8.0  # suspect when a gap this long had probability < 10^-phi
    min_suspect_s: float = 2.0  # never suspect before this much silence
    lose_after_s: float = 10.0  # lose a suspected worker after this much silence at least...
    lose_gap_factor: float = 3.0  # ...or this many times the longest gap observed from it


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


def lose_after(worker: WorkerInfo, settings: LivenessSettings) -> float:
    """Seconds of silence after which a suspected worker is lost (adapts to its history)."""
    longest = max(worker.intervals, default=settings.heartbeat_s)
    return max(settings.lose_after_s, settings.lose_gap_factor * longest)


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
