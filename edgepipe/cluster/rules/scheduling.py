"""Scheduling decisions: how long a request may wait for the cluster, and where its next step resumes.

Admission (which requests run) is state and a decision of the core: the book of tickets is
``ClusterState.admission`` (``admission_book``), the decision ``core.handle`` of ``AdmitAsked`` /
``AdmitLeft``, its shell ``shells.admission.Admission``.

Waiting for Up: a request whose cluster is not Up waits, but not forever (``wait_verdict``):
when the connected workers cannot hold the model at all it fails after ``capacity_wait_s``
with one line saying what they hold and what the model needs; otherwise after ``max_wait_s``.
The micro-batch lanes are in ``batching``; replay (rebuilding a sequence's KV) in ``requests``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..state.state import ClusterState, Phase


# -- waiting for the cluster ----------------------------------------------------------------------
@dataclass(frozen=True)
class WaitSettings:
    capacity_wait_s: float = 30.0  # the connected workers cannot hold the model: fail after this
    max_wait_s: float = 300.0  # not Up for any other reason: fail after this


def shortfall(state: ClusterState, weight_bytes: int, kv_bytes: int, overhead_bytes: int, now: float | None = None) -> str | None:
    """One line saying why the connected workers cannot hold the model, or None if they may.

    A plan needs the weights, the KV room every stage keeps (``kv_bytes`` over all layers) and
    each worker's runtime overhead; only declared budgets are counted (see below). Workers a plan
    may not use at ``now`` (suspected, quarantined) hold nothing for it."""
    workers = state.live(now)
    if not workers:
        benched = len(state.workers)
        return f"no usable workers: {benched} connected, all suspected or quarantined" if benched else "no workers are connected"
    budget = [w for w in workers if w.hello.memory_budget]
    if len(budget) < len(workers):  # a worker without a declared budget is bounded by its host's RAM: assume it fits
        return None
    held = sum(max(0, w.memory_bytes - overhead_bytes) for w in workers)
    if held >= weight_bytes + kv_bytes:
        return None
    benched = len(state.workers) - len(workers)
    return (f"not enough memory: the {len(workers)} connected worker(s){f' ({benched} more suspected or quarantined)' if benched else ''} "
            f"hold {held / 1e6:.0f} MB for the model, "
            f"it needs {(weight_bytes + kv_bytes) / 1e6:.0f} MB ({weight_bytes / 1e6:.0f} MB weights + {kv_bytes / 1e6:.0f} MB KV room)")


def wait_verdict(state: ClusterState, waited_s: float, lacking: str | None, settings: WaitSettings) -> str | None:
    """None to keep waiting for Up, or the one-line reason the request fails now."""
    if state.phase is Phase.UP and state.active is not None:
        return None
    if lacking is not None and waited_s >= settings.capacity_wait_s:
        return f"cluster lacks capacity after waiting {waited_s:.0f} s: {lacking}"
    if waited_s >= settings.max_wait_s:
        why = f": {state.last_failure}" if state.last_failure else ""
        return f"cluster not up after waiting {waited_s:.0f} s{why}"
    return None


@dataclass(frozen=True)
class NextFeed:
    """What a sequence's next step feeds, and on which footing (``next_feed``)."""

    fed_plan: int | None  # the plan whose workers hold its KV once this step is fed
    new_epoch: bool  # its KV on the old plan is void: drop it there and replay under a new sequence id
    feed: list[int]  # the token ids to send
    replay_from: int | None  # a replay: positions before this go as one prefill frame, the rest one by one


def next_feed(fed_plan: int | None, active_plan: int, moved_to: int | None, prompt_ids: list[int], generated: list[int]) -> NextFeed:
    """Resume or replay: where the sequence's KV was last fed (``fed_plan``; -1 after a broken
    step, None before the first), the active plan, and where a KV move brought it (``moved_to``).

    On the plan that holds its KV, or the one its KV moved to with its layers, it resumes with the
    last token; on any other plan it replays every token so far (the prompt as a prefill, each
    generated token as a decode step, so the rebuilt KV is exactly the one it had)."""
    if fed_plan != active_plan and moved_to == active_plan:
        fed_plan = active_plan  # its KV moved with its layers: carry on
    if fed_plan == active_plan:
        return NextFeed(fed_plan, False, generated[-1:], None)
    feed = prompt_ids + generated
    return NextFeed(fed_plan, fed_plan is not None, feed, len(prompt_ids) if len(feed) > len(prompt_ids) else None)
