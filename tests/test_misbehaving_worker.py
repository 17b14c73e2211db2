"""A worker that answers pings but drops its work is found by what it does, taken out and
quarantined for a while (by device identity, so reconnecting does not clear it), and planned
again once the time is up — pure checks over ``ClusterState``, then real processes."""

from __future__ import annotations

import time

import pytest

from edgepipe.cluster.rules import membership
from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.state import ClusterState, apply
from edgepipe.net.messages import Hello
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form

from harness import Server


def _cluster(*names: str) -> ClusterState:
    state = ClusterState()
    for i, name in enumerate(names):
        state = apply(state, S.WorkerJoined(f"w{i}", name, Hello.from_fields({"kind": "native", "memory_bytes": 10**9, "threads": 1}), now=0.0))
    return state


def _pong(state: ClusterState, wid: str, computed: int, now: float) -> ClusterState:
    return apply(state, S.Ponged(wid, 0.001, {"computed": computed}, now))


def test_the_first_stage_that_computed_nothing_while_answering_pings_is_blamed():
    state = _cluster("a", "b", "c")
    for wid in ("w0", "w1", "w2"):
        state = _pong(state, wid, 10, now=1.0)
    before = membership.computed_counts(state, ["w0", "w1", "w2"])
    # w0 passed the step on, w1 swallowed it: w1 and w2 never moved, w1 comes first
    state = _pong(_pong(_pong(state, "w0", 11, 5.0), "w1", 10, 5.0), "w2", 10, 5.0)
    assert membership.idle_stage(state, ["w0", "w1", "w2"], before, sent_at=2.0) == "w1"
    # with other steps in flight, w0's count may have moved for them while it dropped this one:
    # starving w1 is not proof; the first stage, fed by the coordinator itself, still is
    assert membership.idle_stage(state, ["w0", "w1", "w2"], before, sent_at=2.0, alone=False) is None
    assert membership.idle_stage(_pong(state, "w0", 10, 5.0), ["w0", "w1", "w2"], before, sent_at=2.0, alone=False) == "w0"
    # every stage moved (some other sequence's work hides a partial dropper): nobody is blamed
    moved = _pong(_pong(state, "w1", 12, 6.0), "w2", 12, 6.0)
    assert membership.idle_stage(moved, ["w0", "w1", "w2"], before, sent_at=2.0) is None
    # no pong since the step was sent: a silent worker is membership's business, not a dropper
    assert membership.idle_stage(state, ["w0", "w1", "w2"], before, sent_at=5.5) is None
    # a worker that reports no counts (an old or browser worker) cannot be judged this way
    blind = apply(state, S.Ponged("w1", 0.001, {}, 6.0))
    assert membership.idle_stage(blind, ["w0", "w1", "w2"], before, sent_at=2.0) is None


def test_quarantine_survives_reconnecting_doubles_and_ends():
    state = _cluster("a", "b")
    state = apply(state, S.Misbehaved("w1", "dropped a step", now=100.0))
    state = apply(state, S.WorkerLost("w1", "quarantined", now=100.0))
    # the same device reconnects under a new id: still out of new plans
    state = apply(state, S.WorkerJoined("w9", "b", Hello.from_fields({"kind": "native", "memory_bytes": 10**9, "threads": 1}), now=101.0))
    assert [w.id for w in state.live(now=101.0)] == ["w0"]
    until = state.quarantine[state.workers["w9"].identity].until
    assert until == 100.0 + S.QUARANTINE_S
    assert not membership.quarantine_ended(state, 101.0, until - 0.1)
    assert membership.quarantine_ended(state, until - 0.1, until + 0.1)
    assert [w.id for w in state.live(now=until + 0.1)] == ["w0", "w9"]
    # caught again: twice as long, capped
    state = apply(state, S.Misbehaved("w9", "dropped again", now=200.0))
    assert state.quarantine[state.workers["w9"].identity].until == 200.0 + 2 * S.QUARANTINE_S
    for k in range(10):
        state = apply(state, S.Misbehaved("w9", "and again", now=300.0 + k))
    assert state.quarantine[state.workers["w9"].identity].until == 309.0 + S.QUARANTINE_MAX_S
    # another device with another identity is untouched
    assert state.workers["w0"].identity not in state.quarantine


def test_a_worker_that_drops_work_is_quarantined_and_the_request_completes(native_pkg, home):
    """Two honest workers and one that answers heartbeats but drops every activation frame
    (``--drop-work``, emulation). The request that meets it pauses for one step timeout, the
    dropper is quarantined, the plan moves to the honest two, and the answer is exactly the
    single-process one; without the fix the request retried the same plan until its 300 s
    bound and failed."""
    timeout_s = 6
    with Server(home, workers=2, args=("--placement", "memory", "--min-workers", "3", "--step-timeout", str(timeout_s)),
                wait_up=False) as server:
        dropper = server.worker("--drop-work", "--name", "dropper", "--threads", "1")
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and len(s["plan"]["stages"]) == 3, timeout=180)
            dropper_id = next(w["id"] for w in status["workers"] if w["name"] == "dropper")
            assert dropper_id in [s["worker"] for s in status["plan"]["stages"]]

            prompt = "Name three primary colors."
            tok = native_pkg.tokenizer
            ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
            expected = generate(native_pkg.pipeline(precision=local_form(native_pkg)), ids, GenerationParams(max_tokens=12), tok.decode, native_pkg.manifest.eos_ids).tokens
            expected = [t for t in expected if t not in native_pkg.manifest.eos_ids]
            t0 = time.monotonic()
            r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}],
                                                                  "max_tokens": 12, "temperature": 0, "return_token_ids": True})
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected
            assert took < 4 * timeout_s + 60, took  # one step timeout and a re-plan, not the 300 s bound

            events = server.client.get("/v1/cluster/events").json()["events"]
            caught = [e for e in events if e.get("kind") == "quarantine"]
            assert caught and caught[0]["worker"] == dropper_id, caught
            status = server.status()
            assert all(w["name"] != "dropper" for w in status["workers"] if w["id"] in [s["worker"] for s in status["plan"]["stages"]])
            # it reconnects on its own (a process that stays up) but sits out its quarantine
            back = server.wait_for(lambda s: any(w["name"] == "dropper" for w in s["workers"]), timeout=60)
            assert next(w for w in back["workers"] if w["name"] == "dropper")["quarantined_s"] > 0
            assert dropper.poll() is None
        finally:
            dropper.kill()
            dropper.wait()


def test_probe_times_a_worker_underreports_are_overruled_by_the_coordinators_clock():
    from edgepipe.cluster.shells.calibration import trusted_step_times

    # 8 extra steps took 80 ms more on the coordinator's clock: 10 ms per step
    honest, overruled = trusted_step_times([0.009, 0.011, 0.010], 0.200, 0.120, 8)
    assert (honest, overruled) == ([0.009, 0.011, 0.010], False)
    lied, overruled = trusted_step_times([0.001, 0.001, 0.001], 0.200, 0.120, 8)
    assert overruled and lied == pytest.approx([0.01] * 3)
    # a difference that says nothing (noise made the short probe slower) keeps the reports
    assert trusted_step_times([0.001], 0.100, 0.120, 8) == ([0.001], False)


@pytest.mark.slow
def test_a_worker_claiming_to_be_20x_faster_is_calibrated_by_what_it_takes(native_pkg, home):
    with Server(home, workers=1, args=("--placement", "planner", "--min-workers", "2", "--worker-threads", "1"), wait_up=False) as server:
        liar = server.worker("--misreport", "20", "--name", "liar", "--threads", "1")
        try:
            status = server.wait_for(lambda s: any(w["name"] == "liar" for w in s["workers"]), timeout=120)
            liar_id = next(w["id"] for w in status["workers"] if w["name"] == "liar")

            def calibrated(_):
                return any(e.get("kind") == "calibrated" and e.get("worker") == liar_id
                           for e in server.client.get("/v1/cluster/events").json()["events"])

            server.wait_for(calibrated, timeout=120)
            events = server.client.get("/v1/cluster/events").json()["events"]
            overruled = [e for e in events if e.get("kind") == "probe_overruled"]
            assert overruled and all(e["worker"] == liar_id for e in overruled), overruled
            assert all(e["measured_ms"] > 5 * e["reported_ms"] for e in overruled)
            honest = [w["id"] for w in status["workers"] if w["name"] != "liar"]
            assert not any(e["worker"] in honest for e in overruled)
            # its speed comes from the coordinator's clock: not 20x an honest single-threaded worker's
            speeds = {e["worker"]: e["speed"] for e in events if e.get("kind") == "calibrated"}
            assert speeds[liar_id] < 4 * speeds[honest[0]], speeds
        finally:
            liar.kill()
            liar.wait()


def test_a_silent_stage_abandons_the_plan_only_when_the_others_can_serve():
    from edgepipe.cluster.state.placement import Deployment, StageAssignment

    state = _cluster("a", "b", "c")
    dep = Deployment(7, (StageAssignment("w0", 0, 4), StageAssignment("w1", 4, 8)))
    state = apply(apply(state, S.Committed(dep, now=1.0)), S.RequestStarted("r1", 64))
    state = apply(state, S.RequestFed("r1", "r1.0", 7, 10))
    assert not membership.abandon_active(state, ["w1"], lacking=None)  # no spare prepared: wait for it
    state = apply(state, S.SpareChosen((StageAssignment("w1", 0, 8),)))
    assert not membership.abandon_active(apply(state, S.Suspected("w1", 4.0)), ["w1"], lacking=None)  # the spare needs it too
    state = apply(state, S.SpareChosen((StageAssignment("w2", 0, 8),)))
    state = apply(state, S.Suspected("w1", 4.0))
    assert membership.abandon_active(state, ["w1"], lacking=None)
    assert not membership.abandon_active(state, ["w2"], lacking=None)  # not in the plan
    assert not membership.abandon_active(state, ["w1"], lacking="no workers are connected")  # everyone stalled: wait
    down = apply(state, S.PlanAbandoned(7, "stage w1 went silent", now=5.0))
    assert down.phase is S.Phase.DOWN and down.active is None and "w1" in down.workers  # still a member
    assert down.requests["r1"].plan is None and down.last_failure == "stage w1 went silent"
    assert apply(state, S.PlanAbandoned(6, "old plan", now=5.0)) == state  # a plan no longer active: nothing


def test_a_silent_stage_is_routed_around_after_twice_its_longest_stall_or_the_replay_cost_if_less():
    from edgepipe.cluster.state.placement import Deployment, StageAssignment

    settings = membership.LivenessSettings(heartbeat_s=0.5, min_suspect_s=2.0)
    state = _cluster("a", "b", "c")
    state = apply(state, S.Committed(Deployment(7, (StageAssignment("w0", 0, 4), StageAssignment("w1", 4, 8))), now=1.0))
    t = 0.0
    for _ in range(40):  # both answer every heartbeat...
        t += 0.5
        state = apply(apply(state, S.Heard("w0", t)), S.Heard("w1", t))
    state = apply(state, S.Heard("w1", t + 2.4))  # ...but w1's machine once stalled for 2.4 s (a loaded laptop)
    t += 2.4
    state = apply(state, S.Heard("w1", t + 0.5))
    state = apply(state, S.Heard("w0", t + 0.5))
    assert state.workers["w1"].stalls == (pytest.approx(2.4),) and state.workers["w0"].stalls == (pytest.approx(2.9),)
    frozen_at = t + 0.5
    state = apply(apply(state, S.Suspected("w0", frozen_at + 2.0)), S.Suspected("w1", frozen_at + 2.0))
    long_replay = 600.0  # 16 sequences of 1,800 tokens to rebuild: waiting is cheaper
    assert membership.silent_stages(state, frozen_at + 2.0, settings, long_replay) == []  # both once stalled: waited for
    assert membership.silent_stages(state, frozen_at + 4.9, settings, long_replay) == ["w1"]  # 2 x 2.4 s
    assert membership.silent_stages(state, frozen_at + 5.9, settings, long_replay) == ["w0", "w1"]
    assert membership.silent_stages(state, frozen_at + 3.0, settings, replay_s=3.0) == ["w0", "w1"]  # abandoning costs 3 s
    assert membership.silent_stages(state, frozen_at + 2.0, settings, replay_s=0.0) == ["w0", "w1"]  # nothing to rebuild: the floor
    assert membership.abandon_after(state.workers["w2"], settings, long_replay) == 2.0  # never stalled: the floor
    assert membership.silent_stages(state, frozen_at + 60, settings, long_replay) == ["w0", "w1"]  # w2 silent, not in the plan
