"""The shells' last ledgers and lines as state and pure functions (no process, no model, no loop):
dashboard lines read from the events that made the change, the link-probe secret a data port
accepts, and whose a worker's LOADED is (``core.handle`` of a ``LoadAnswered``)."""

from __future__ import annotations

import pytest

from edgepipe.cluster.rules import core
from edgepipe.cluster.state import measurements as M, state as S
from edgepipe.cluster.shells import narrate
from edgepipe.cluster.state.placement import Deployment, StageAssignment as A
from edgepipe.net.messages import Hello, Loaded

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

PLAN = Deployment(4, (A("w1", 0, 4), A("w2", 4, 8)), "w2 joined", {"tpot_s": 0.02, "objective": "latency"})


def _up(*plans: Deployment) -> S.ClusterState:
    state = S.ClusterState()
    for name in ("w1", "w2"):
        state = S.apply(state, S.WorkerJoined(name, name, Hello.from_fields({"memory_bytes": 1 << 30}), 0.0))
    for dep in plans:
        state = S.apply(state, S.Committed(dep, 1.0))
    return state


# -- lines about a change of state are read from its event, never noted beside it ----------------------
def test_checkpoint_spare_and_overruled_lines_come_from_their_events():
    """The ``checkpoint``, ``spare_unbuilt`` and ``probe_overruled`` lines were notes sent beside
    the event that made the change; now each is the event's own line, and noting one fails."""
    for kind in ("checkpoint", "spare_unbuilt", "probe_overruled"):
        with pytest.raises(ValueError):
            S.NoteKind(kind)
    spare = (A("w3", 0, 4), A("w4", 4, 8))
    state = _up(PLAN)
    state = S.apply(S.apply(state, S.SpareChosen(spare)), S.RequestStarted("r1", 64))
    unbuilt = S.SpareLoaded(-1, spare, "w4", False, "out of memory")
    assert narrate.entry(unbuilt, S.apply(state, unbuilt), None, 2.0) == {"t": 2.0, "kind": "spare_unbuilt", "worker": "w4", "plan": -1,
                                                                         "error": "out of memory"}
    assert narrate.entry(S.SpareLoaded(-1, spare, "w3", True), state, None, 2.0) is None  # built: no line
    needs = frozenset({"w3", "w4"})
    for holder in sorted(needs):  # checkpoints go to built spare sessions only
        state = S.apply(state, S.SpareLoaded(-1, spare, holder, True))
    state = S.apply(state, S.CheckpointSending("r1", "r1.c1", spare, needs, 40))
    lines = []
    for worker in sorted(needs):  # as ``Checkpoints`` acknowledges a round: the last makes it whole
        event = S.CheckpointStored("r1", "r1.c1", spare, needs, worker, 40, 8192)
        state = S.apply(state, event)
        lines.append(narrate.entry(event, state, None, 3.0))
    assert lines == [None, {"t": 3.0, "kind": "checkpoint", "request": "r1", "position": 40, "bytes": 8192}]
    overruled = M.Distrusted("w2", (1, 2), 0.001, 0.004)
    assert narrate.entry(overruled, state, None, 4.0) == {"t": 4.0, "kind": "probe_overruled", "worker": "w2", "units": [1, 2],
                                                         "reported_ms": 1.0, "measured_ms": 4.0}
    assert narrate.entry(M.Distrusted("w2"), state, None, 4.0) is None  # a recorded one without its figures: no line


def test_the_probe_secret_a_data_port_accepts_is_state_and_goes_with_the_worker():
    """``links`` sends a worker a new link-probe secret only when the state holds none for it."""
    state = _up()
    state = S.apply(state, S.ProbeAccepting("w2", "s3cr3t-probe"))
    assert state.workers["w2"].probe_secret == "s3cr3t-probe" and state.workers["w1"].probe_secret is None
    assert "s3cr3t-probe" not in repr(state) and "s3cr3t-probe" not in repr(S.ProbeAccepting("w2", "s3cr3t-probe"))
    assert S.apply(state, S.ProbeAccepting("w9", "x")) is state  # a worker lost meanwhile: nothing to keep
    back = S.apply(S.apply(state, S.WorkerLost("w2", "gone", 2.0)), S.WorkerJoined("w2", "w2", state.workers["w2"].hello, 3.0))
    assert back.workers["w2"].probe_secret is None  # a worker that comes back is sent a new one


def test_a_loaded_goes_to_whoever_awaits_it():
    """A LOAD's answer to its waiter; a ``kv_received`` to the switch's move or the checkpoint's
    copy the state has in flight; one no longer in flight is dropped; the state does not change."""
    spare = (A("w1", 0, 8),)
    state = S.apply(S.apply(_up(PLAN), S.SpareChosen(spare)), S.RequestStarted("r1", 64))
    state = S.apply(state, S.KvMoveSent(3, "r1", "w1", "w2", 5, 0, 4))
    state = S.apply(S.apply(state, S.CheckpointSending("r1", "r1.c1", spare, frozenset({"w1"}), 32)), S.CopySent(1 << 40, "r1", "w2", "w1"))
    answers = {
        Loaded(True, plan=5): core.AnswerLoad("w2", Loaded(True, plan=5)),
        Loaded(True, kv_received=3): core.AckKvMove(Loaded(True, kv_received=3)),
        Loaded(False, kv_received=1 << 40, error="refused"): core.AckCheckpointCopy(Loaded(False, kv_received=1 << 40, error="refused")),
    }
    for reply, command in answers.items():
        handled = core.handle(state, core.LoadAnswered("w2", reply), core.Config())
        assert handled.commands == (command,) and handled.state is state and handled.events == ()
    ended = S.apply(S.apply(state, S.KvMoveEnded(3, False)), S.RoundEnded("r1", (1 << 40,)))
    for late in (Loaded(True, kv_received=3), Loaded(True, kv_received=1 << 40), Loaded(True, kv_received=99)):
        assert core.handle(ended, core.LoadAnswered("w2", late), core.Config()).commands == ()  # its switch or round is over
