"""Where speculative decoding's draft model runs (pure): the coordinator's own process or a
drafter worker (a device that holds no stage), whichever drafts a pass for the least time.

A site's cost for a pass of ``k`` drafts is its round trip (``call_s``: nothing in process, a
control-channel round trip to a worker) plus ``k`` of its measured draft steps. The cheapest site
wins, ties to the coordinator, then by worker id; a running site is left only for one cheaper by
``margin`` (measurements are noisy, and a move makes the new site take in each sequence's ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

COORDINATOR = "coordinator"  # the site id of the coordinator's own process
TYPICAL_K = 4  # drafts per pass the sites are compared at
SWITCH_MARGIN = 0.2  # a running site is left for one at least this much cheaper


@dataclass(frozen=True)
class DraftSite:
    """A place the draft model can run: ``id`` (``COORDINATOR`` or a worker id), its measured
    seconds per draft step, and the round trip of a draft request to it."""

    id: str
    step_s: float
    call_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step_s) and self.step_s >= 0 and math.isfinite(self.call_s) and self.call_s >= 0):
            raise ValueError(f"draft site {self.id}: step_s and call_s must be finite seconds >= 0, got {self.step_s}, {self.call_s}")

    def pass_s(self, k: int = TYPICAL_K) -> float:
        return self.call_s + k * self.step_s


def choose_draft_site(sites: list[DraftSite], current: str | None = None, k: int = TYPICAL_K, margin: float = SWITCH_MARGIN) -> str:
    """The id of the site to draft on: the cheapest for a pass of ``k`` drafts, staying on
    ``current`` unless another is ``margin`` cheaper. ``ValueError`` without sites."""
    if not sites:
        raise ValueError("no site to draft on")
    ranked = sorted(sites, key=lambda s: (round(s.pass_s(k), 9), s.id != COORDINATOR, s.id))  # equal to a nanosecond: a tie
    best = ranked[0]
    running = next((s for s in sites if s.id == current), None)
    if running is not None and best.pass_s(k) > (1 - margin) * running.pass_s(k):
        return running.id
    return best.id


WORKERS = "workers"  # pinned to the drafter workers (``serve --draft-on workers``)


def site_to_use(sites: list[DraftSite], current: str, pinned: str | None = None, remotes: bool = True) -> str:
    """Where drafts are made now, given the measured ``sites`` (the coordinator's among them once
    timed; live drafter workers), the running site ``current``, an operator's ``pinned``
    (``COORDINATOR``, ``WORKERS`` or None: the cheapest) and whether any drafter worker is attached
    (``remotes``). Pinned to the workers, a running worker site is kept and the cheapest worker
    taken otherwise; with no worker left the coordinator drafts."""
    if pinned == COORDINATOR or not remotes:
        return COORDINATOR
    if pinned == WORKERS:
        workers = [s for s in sites if s.id != COORDINATOR]
        if any(s.id == current for s in workers):
            return current
        return choose_draft_site(workers, None) if workers else COORDINATOR
    return choose_draft_site(sites, current) if sites else COORDINATOR
