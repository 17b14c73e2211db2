"""Where the draft model runs (I/O): this process's ``ModelDrafter`` or a drafter worker.

``plan.draft_site.site_to_use`` decides from the measurements (each drafter worker's step time
and round trip against the coordinator's own draft step, and an operator's ``--draft-on``);
:class:`PlacedDrafter` sends each pass there. A drafter worker that fails, times out or leaves
is dropped and the pass drafts in the coordinator's process instead: drafts never change which
tokens a greedy request gets, and a sampled one's drafts are drawn from the same model with the
same draws, so no request is lost or changed by the move.
"""

from __future__ import annotations

from ...plan.draft_site import COORDINATOR, DraftSite, site_to_use
from ...runtime.speculative import ModelDrafter, time_draft_steps
from .drafters import DrafterLost, RemoteDrafter

RECHECK_EVERY = 64  # draft requests between looks at where the draft is cheapest


class PlacedDrafter:
    """The draft model where ``plan.draft_site`` says: this process's ``ModelDrafter`` (``local``,
    also the fallback) or one of the drafter workers. ``package``: the draft model's package (its
    files go to the drafter workers). ``on_move(site, why)`` hears every change of site."""

    def __init__(self, local: ModelDrafter, package, on_move=None):
        self.local, self.package, self.name = local, package, local.name
        self.remotes: dict[str, RemoteDrafter] = {}
        self.site = COORDINATOR
        self.local_step_s: float | None = None  # measured once a drafter worker offers to draft (calibration)
        self.on_move = on_move or (lambda site, why: None)
        self.remote_drafts = 0  # passes drafted by a drafter worker
        self.fallbacks = 0  # requests a drafter worker failed, drafted here instead
        self.pinned: str | None = None  # serve --draft-on: "coordinator" or "workers" (None: the cheapest)
        self._asked = 0

    @property
    def states_distributions(self) -> bool:
        return self.local.states_distributions

    def sites(self) -> list[DraftSite]:
        local = [DraftSite(COORDINATOR, self.local_step_s)] if self.local_step_s is not None else []
        return local + [r.site() for r in self.remotes.values() if not r.gone]

    def place(self, why: str) -> str:
        """Decide where drafts are made now (the drafting thread or the loop may call it)."""
        chosen = site_to_use(self.sites(), self.site, self.pinned, bool(self.remotes))
        if chosen != self.site:
            self.site = chosen
            self.on_move(chosen, why)
        return chosen

    def _with_fallback(self, call_remote, call_local):
        remote = self.remotes.get(self.site)
        if remote is not None:
            try:
                out = call_remote(remote)
                self.remote_drafts += 1
                self._asked += 1
                if self._asked % RECHECK_EVERY == 0 and self.pinned is None:
                    self.place("measured draft costs")
                return out
            except DrafterLost as exc:
                self.fallbacks += 1
                self.drop(remote.wid, str(exc))
        return call_local()

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        return self._with_fallback(lambda r: r.draft(seq, ids, k, params, step), lambda: self.local.draft(seq, ids, k, params, step))

    def draft_sampled(self, seq: str, ids: list[int], k: int, params, step: int = 0):
        return self._with_fallback(lambda r: r.draft_sampled(seq, ids, k, params, step),
                                   lambda: self.local.draft_sampled(seq, ids, k, params, step))

    def prime(self, seq: str, ids: list[int]) -> None:
        remote = self.remotes.get(self.site)
        if remote is None:
            return self.local.prime(seq, ids)
        try:
            remote.prime(seq, ids)
        except DrafterLost as exc:
            self.drop(remote.wid, str(exc))
            self.local.prime(seq, ids)

    def forget(self, seq: str) -> None:
        self.local.forget(seq)
        for remote in list(self.remotes.values()):
            remote.forget(seq)

    def calibrate(self) -> float:
        """Time this process's draft step once (on the drafting thread), as a drafter worker times its own."""
        if self.local_step_s is None:
            self.local_step_s = time_draft_steps(self.local)
        return self.local_step_s

    def add(self, remote: RemoteDrafter) -> None:
        self.remotes[remote.wid] = remote
        self.place(f"drafter {remote.wid} ready ({remote.step_s * 1e3:.1f} ms a draft step)")

    def drop(self, wid: str, why: str) -> None:
        remote = self.remotes.pop(wid, None)
        if remote is None:
            return
        remote.lost(why)
        if self.site == wid:
            self.site = COORDINATOR  # at once: the next pass must not wait on it
            self.on_move(COORDINATOR, why)
        self.place(why)
