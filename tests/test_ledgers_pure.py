"""The coordinator's remaining ledgers as state (no process, no model, no loop): typed dashboard
notes, the "up" line read from ``Committed``."""

from __future__ import annotations

import pytest

from edgepipe.cluster import narrate, state as S
from edgepipe.cluster.placement import Deployment, StageAssignment as A

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

PLAN = Deployment(4, (A("w1", 0, 4), A("w2", 4, 8)), "w2 joined", {"tpot_s": 0.02, "objective": "latency"})


def test_a_note_has_one_of_the_listed_kinds():
    assert S.NoteKind("refused") is S.NoteKind.REFUSED
    with pytest.raises(ValueError):
        S.NoteKind("refusd")  # a misspelt kind fails where it is written, not on the dashboard
    assert "up" not in {k.value for k in S.NoteKind}  # a plan serving is its Committed, not a note
    line = narrate.entry(S.Noted(S.NoteKind.REFUSED, {"peer": "10.0.0.2", "reason": "wrong token"}, 1.0), S.ClusterState(), None, 5.0)
    assert line == {"t": 5.0, "kind": "refused", "peer": "10.0.0.2", "reason": "wrong token"}
    assert S.apply(S.ClusterState(), S.Noted(S.NoteKind.PAUSE, {}, 1.0)) == S.ClusterState()


def test_the_up_line_is_read_from_the_commit():
    timings = S.UpTimings(1.25, 0.5, 2048, replaced=3, moved={"quiesce_s": 0.1, "kv_moved": 2, "kv_recomputed": 0})
    state = S.apply(S.ClusterState(), S.Committed(PLAN, 9.0, timings))
    assert state.active == PLAN and state.phase is S.Phase.UP  # the timings change nothing else
    assert state == S.apply(S.ClusterState(), S.Committed(PLAN, 9.0))
    line = narrate.entry(S.Committed(PLAN, 9.0, timings), state, None, 100.0)
    assert line == {"t": 100.0, "kind": "up", "plan": 4, "prepare_s": 1.25, "paused_s": 0.5, "fetched_bytes": 2048,
                    "predicted": {"tpot_s": 0.02, "objective": "latency"}, "replaced": 3, "quiesce_s": 0.1, "kv_moved": 2,
                    "kv_recomputed": 0}
    assert narrate.describe(line) == "plan 4 serving: 20 ms/token predicted, objective latency"
    assert narrate.entry(S.Committed(PLAN, 9.0), state, None, 100.0) is None  # a commit without timings: no line
