"""The coordinator's decisions as plain functions of state (no process, no model, no loop):
switch or stay, resume or replay. (Abandon and blame: ``membership``, in test_sim_pure.py.)"""

from __future__ import annotations

import pytest

from edgepipe.cluster import deploy
from edgepipe.cluster.placement import Deployment, StageAssignment as A

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

RUNNING = Deployment(3, (A("w1", 0, 4), A("w2", 4, 8)))
OTHER = [A("w1", 0, 5), A("w2", 5, 8)]


def test_nothing_running_switches():
    assert deploy.stay_reason(None, OTHER, pinned=False, decision=None) is None


def test_a_pinned_plan_stays_whatever_the_planner_says():
    assert deploy.stay_reason(RUNNING, OTHER, pinned=True, decision={"switch": True}) == "pinned"


def test_the_same_placement_stays():
    assert deploy.stay_reason(RUNNING, list(RUNNING.stages), pinned=False, decision={"switch": True}) == "same plan"


def test_a_better_plan_not_worth_its_switch_cost_waits_and_says_why():
    why = deploy.stay_reason(RUNNING, OTHER, pinned=False, decision={"switch": False, "reason": "gain 2% < margin 10%"})
    assert why is not None and "gain 2% < margin 10%" in why


def test_a_better_plan_worth_it_or_a_plan_function_without_a_verdict_switches():
    assert deploy.stay_reason(RUNNING, OTHER, pinned=False, decision={"switch": True}) is None
    assert deploy.stay_reason(RUNNING, OTHER, pinned=False, decision=None) is None


from edgepipe.cluster.scheduling import next_feed  # noqa: E402

PROMPT, GENERATED = [1, 2, 3], [7, 8]


def test_the_first_step_prefills_the_prompt():
    nxt = next_feed(None, 3, None, PROMPT, [])
    assert (nxt.feed, nxt.replay_from, nxt.new_epoch, nxt.fed_plan) == (PROMPT, None, False, None)


def test_on_the_plan_that_holds_its_kv_a_sequence_resumes_with_its_last_token():
    nxt = next_feed(3, 3, None, PROMPT, GENERATED)
    assert (nxt.feed, nxt.replay_from, nxt.new_epoch, nxt.fed_plan) == ([8], None, False, 3)


def test_kv_that_moved_with_its_layers_resumes_on_the_new_plan():
    nxt = next_feed(3, 4, 4, PROMPT, GENERATED)
    assert (nxt.feed, nxt.new_epoch, nxt.fed_plan) == ([8], False, 4)


def test_on_any_other_plan_it_replays_everything_under_a_new_epoch():
    nxt = next_feed(3, 4, None, PROMPT, GENERATED)
    assert (nxt.feed, nxt.replay_from, nxt.new_epoch, nxt.fed_plan) == (PROMPT + GENERATED, 3, True, 3)
    # a move to a plan that is no longer the active one does not count
    assert next_feed(3, 5, 4, PROMPT, GENERATED).new_epoch


def test_after_a_broken_step_it_replays_even_on_the_same_plan():
    nxt = next_feed(-1, 3, None, PROMPT, GENERATED)
    assert nxt.new_epoch and nxt.feed == PROMPT + GENERATED and nxt.replay_from == 3


def test_the_event_log_replays_into_the_state_the_coordinator_holds(monkeypatch):
    """Every state change and every measurement is an event kept in an indexed, bounded log:
    folding them over the state and profile before its oldest event gives the coordinator's
    state and profile (what the planner decides from), after seeded fault schedules (kills,
    partitions, restarts, ...; calibration and link probes on) with the log far shorter than the run."""
    from edgepipe.cluster import state as S
    from edgepipe.cluster.coordinator import Coordinator
    from edgepipe.cluster.event_log import EventLog
    from edgepipe.cluster.simrun import Schedule, run

    monkeypatch.setattr(EventLog.__init__, "__defaults__", (None, 64))
    checked = []
    stop = Coordinator.stop

    async def checking_stop(self):
        state, profile = self.history.replay()
        same = state == self.cluster and profile.snapshot() == self.profile.snapshot() and profile.snapshot()["devices"]
        checked.append((bool(same), self.history.first, len(self.history.events)))
        await stop(self)

    monkeypatch.setattr(Coordinator, "stop", checking_stop)
    for seed in range(10_000, 10_006):
        assert not run(Schedule.random(seed)).violations
    assert checked and all(same for same, _, _ in checked), checked
    assert any(first > 0 for _, first, _ in checked)  # the bound was reached and the base moved on
    log = EventLog(S.ClusterState(), None, size=2)
    assert [log.append(S.PlanFailed("a")), log.append(S.PlanFailed("b")), log.append(S.PlanFailed("c"))] == [0, 1, 2]
    assert [i for i, _ in log.since(0)] == [1, 2] and log.replay()[0] == S.apply(S.ClusterState(), S.PlanFailed("c"))
