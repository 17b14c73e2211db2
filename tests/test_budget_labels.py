"""A ``--memory`` budget on a real device is a budget, not emulation (issue 42, item 11): only what
``--slowdown``, ``--roofline``, link shaping, ``--drop-work`` and ``--misreport`` inject is labelled
emulated, in the planner's device profile (reports), the join line, the status and the budget's own messages."""

from __future__ import annotations

import pytest

from edgepipe.cluster.state import state as S
from edgepipe.cluster.shells.narrate import entry
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.cluster.simulation.sim import FakeManifest
from edgepipe.cluster.state.worker_info import WorkerInfo
from edgepipe.emulate.slowdown import MemoryBudget, MemoryBudgetExceeded
from edgepipe.net.messages import Hello
from edgepipe.worker.settings import WorkerSettings

pytestmark = pytest.mark.pure
GB = 10 ** 9


def hello_of(**settings) -> Hello:
    s = WorkerSettings(coordinator="http://127.0.0.1:8420", name="dev", **settings)
    return Hello.from_fields({"name": "dev", "memory_bytes": s.memory_bytes or 8 * GB, "data_url": "ws://dev:1", "emulation": s.emulation()})


@pytest.mark.parametrize("settings, emulated", [
    ({"memory_bytes": GB}, False),  # a budget the user chose on a real device
    ({}, False),
    ({"memory_bytes": GB, "slowdown": 2.0}, True),
    ({"link_delay_ms": 20.0}, True),
    ({"link_rate": "1MB/s"}, True),
    ({"roofline": "20e9,8GB"}, True),
    ({"drop_work": True}, True),
    ({"misreport": 2.0}, True),
])
def test_only_injected_slowness_is_labelled_emulated(settings, emulated):
    hello = hello_of(**settings)
    assert hello.emulated is emulated
    assert hello.memory_budget == settings.get("memory_bytes")
    assert (hello.declared_emulation is not None) is emulated and "memory_budget" not in (hello.declared_emulation or {})
    worker = WorkerInfo("w1-dev", "dev", hello, 0.0, 0.0)
    device = ClusterProfile(FakeManifest()).device_profiles([worker])[0]
    assert device.emulated is emulated  # what the planner's reports label "(emulated)"
    join = entry(S.WorkerJoined("w1-dev", "dev", hello, 0.0), S.ClusterState(), None, 0.0)
    assert (join["emulation"] is not None) is emulated and join["memory_budget"] == settings.get("memory_bytes")


def test_a_budget_says_budget_not_emulated_budget():
    budget = MemoryBudget(GB)
    assert not budget.emulated and "emulated" not in budget.label()
    with pytest.raises(MemoryBudgetExceeded) as refused:
        budget.check(2 * GB, "units [0, 14) weights + KV for 2048 tokens")
    assert "emulated" not in str(refused.value) and "of the 1 GB memory budget is free" in str(refused.value)
