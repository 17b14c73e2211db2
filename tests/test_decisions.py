"""The coordinator's decisions as plain functions of state (no process, no model, no loop):
switch or stay, resume or replay. (Abandon and blame: ``membership``, in test_sim_pure.py.)"""

from __future__ import annotations

import types

import pytest

from edgepipe.cluster.rules import deploy
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A

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


from edgepipe.cluster.rules.scheduling import next_feed  # noqa: E402

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
    from edgepipe.cluster.state import state as S
    from edgepipe.cluster.shells.coordinator import Coordinator
    from edgepipe.cluster.state.event_log import EventLog
    from edgepipe.cluster.simulation.simrun import Schedule, run

    monkeypatch.setattr(EventLog.__init__, "__defaults__", (None, 64))
    checked = []
    stop = Coordinator.stop

    async def checking_stop(self):
        state, profile = self.history.replay()
        same = state == self.cluster and profile.snapshot() == self.profile.snapshot()
        checked.append((bool(same), self.history.first, len(self.history.events), len(profile.snapshot()["devices"])))
        await stop(self)

    monkeypatch.setattr(Coordinator, "stop", checking_stop)
    for seed in range(10_000, 10_006):
        assert not run(Schedule.random(seed)).violations
    assert checked and all(same for same, *_ in checked), checked
    # not trivially equal: devices were profiled (a coordinator restarted late in a schedule may stop
    # before it profiled any), and the bound was reached and the base moved on
    assert sum(devices > 0 for *_, devices in checked) >= len(checked) - 1, checked
    assert any(first > 0 for _, first, _, _ in checked)
    log = EventLog(S.ClusterState(), None, size=2)
    assert [log.append(S.PlanFailed("a")), log.append(S.PlanFailed("b")), log.append(S.PlanFailed("c"))] == [0, 1, 2]
    assert [i for i, _ in log.since(0)] == [1, 2] and log.replay()[0] == S.apply(S.ClusterState(), S.PlanFailed("c"))


# -- the deployer's and the calibrator's ledgers, as state ------------------------------------------
from edgepipe.cluster.shells import calibration
from edgepipe.cluster.state import state as S
from edgepipe.net.messages import Hello  # noqa: E402


def _joined(*names) -> S.ClusterState:
    st = S.ClusterState()
    for i, n in enumerate(names):
        st = S.apply(st, S.WorkerJoined(n, n, Hello.from_fields({"memory_bytes": 1 << 30}), float(i)))
    return st


def test_sequences_pause_only_while_their_plan_is_swapped_in():
    st = _joined("w1", "w2")
    assert deploy.steps_may_start(st)
    st = S.apply(st, S.SwitchStarted(5, 1.0))
    assert not deploy.steps_may_start(st) and st.switching == 5
    assert not deploy.steps_may_start(S.apply(st, S.SwitchEnded(4, 2.0)))  # another plan's end does not open it
    assert deploy.steps_may_start(S.apply(st, S.SwitchEnded(5, 2.0)))


def test_a_commit_keeps_the_secrets_of_the_new_plan_and_of_the_one_it_replaces():
    st = _joined("w1", "w2")
    one, three = Deployment(1, (A("w1", 0, 8),)), Deployment(3, (A("w1", 0, 4), A("w2", 4, 8)))
    st = S.apply(st, S.SecretsIssued(1, {"w1": "sekret-1"}))
    assert "sekret-1" not in repr(st) + repr(S.SecretsIssued(1, {"w1": "sekret-1"}))  # kept out of logs and assertion messages
    st = S.apply(S.apply(st, S.Preparing(one, 1.0)), S.Committed(one, 2.0))
    st = S.apply(st, S.SecretsIssued(2, {"w2": "s2"}))  # plan 2 fails to load: its secrets wait for the next commit
    st = S.apply(st, S.PrepareFailed(2, "no", 3.0))
    assert set(st.secrets) == {1, 2}
    st = S.apply(st, S.SecretsIssued(3, {"w1": "a", "w2": "b"}))
    st = S.apply(st, S.Committed(three, 4.0))
    assert dict(st.secrets[3]) == {"w1": "a", "w2": "b"} and set(st.secrets) == {1, 3}
    st = S.apply(S.apply(st, S.WorkerLost("w2", "gone", 5.0)), S.SecretsIssued(4, {"w1": "c"}))
    st = S.apply(st, S.Committed(Deployment(4, (A("w1", 0, 8),)), 6.0))
    assert set(st.secrets) == {4}  # nothing was up to replace: only the new plan's


def test_a_worker_the_calibrator_holds_is_not_planned_until_it_lets_go():
    st = S.apply(_joined("w1", "w2", "w3"), S.Calibrating("w2", True))
    assert calibration.busy(st) == {"w2"}
    assert [w.id for w in deploy.plannable(st, 10.0)] == ["w1", "w3"]
    st = S.apply(st, S.Suspected("w3", 10.0))
    assert [w.id for w in deploy.plannable(st, 10.0)] == ["w1"]  # nor a suspected one
    st = S.apply(st, S.Calibrating("w2", False))
    assert calibration.busy(st) == set() and [w.id for w in deploy.plannable(st, 10.0)] == ["w1", "w2"]
    assert calibration.busy(S.apply(st, S.Calibrating("gone", True))) == set()  # an unknown worker: no change


@pytest.mark.parametrize("enabled, known, step", [(True, False, "time"), (True, True, "recall"), (False, False, None), (False, True, None)])
def test_a_newcomer_is_timed_unless_its_hardware_was_seen_or_calibration_is_off(enabled, known, step):
    assert calibration.on_join(enabled, known) == step


def test_the_variant_and_device_a_worker_is_sent_come_from_its_declaration():
    class Manifest:
        precision, units = "int4", ()

    st = S.apply(S.ClusterState(), S.WorkerJoined("g", "g", Hello.from_fields({"memory_bytes": 1, "precision": "fp32", "device": "gpu"}), 0.0))
    settings = types.SimpleNamespace(precision="int8", speculative=True, batch_invariant=False)
    assert deploy.stage_form(st, "g", Manifest, settings) == deploy.StageForm("fp32", gpu=True, verify=True)
    assert deploy.stage_form(st, "gone", Manifest, settings) == deploy.StageForm("int8", gpu=False, verify=True)


# -- the dashboard's lines come from the event log ------------------------------------------------
def test_the_dashboards_lines_are_the_event_logs_and_a_replayed_log_gives_the_same(monkeypatch):
    """Every dashboard line is ``narrate.entry`` of a logged event: walking the log from its base
    gives exactly the lines the coordinator showed (the whole run with a log that kept it all; the
    tail with a log far shorter than the run), after seeded fault schedules with calibration on."""
    from edgepipe.cluster.shells import narrate
    from edgepipe.cluster.shells.coordinator import Coordinator
    from edgepipe.cluster.state.event_log import EventLog
    from edgepipe.cluster.simulation.simrun import Schedule, run

    def lines(log: EventLog) -> list[dict]:
        return [line for e, wall, st, prof in log.walk() if (line := narrate.entry(e, st, prof, wall)) is not None]

    checked, kinds = [], set()
    stop = Coordinator.stop

    async def checking_stop(self):
        shown = list(self.events)
        replayed = lines(self.history)
        kinds.update(line["kind"] for line in shown)
        if self.history.first == 0:
            checked.append(("whole", not self.events.dropped and shown == replayed))
        else:
            checked.append(("tail" if replayed else "tail without lines", shown[len(shown) - len(replayed):] == replayed))
        await stop(self)

    monkeypatch.setattr(Coordinator, "stop", checking_stop)
    for size in (1 << 20, 256):
        monkeypatch.setattr(EventLog.__init__, "__defaults__", (None, size))
        for seed in range(10_000, 10_004):
            assert not run(Schedule.random(seed)).violations
    assert checked and all(ok for _, ok in checked), checked
    assert {"whole", "tail"} <= {how for how, _ in checked}
    assert {"join", "prepare", "up", "calibrated", "leave"} <= kinds, kinds  # the lines that used to come in pairs are there
