"""Issue 42 item 1 in the simulation: no plan loop when a device joins a memory-tight cluster or
a LOAD is refused (the real coordinator and worker core on a virtual clock, ``cluster.sim``).

Before the fix each of these prepared the same refused plan twice a second until the schedule
ended (51, 39 and 4 failed prepares) while the dashboard stayed "up"."""

from __future__ import annotations

from edgepipe.cluster.simulation.sim import RUNTIME_OVERHEAD_BYTES, UNIT_BYTES, UNIT_KV_ROOM
from edgepipe.cluster.simulation.simrun import Fault, Req, Schedule, run

GGUF_KV_ROOM = UNIT_KV_ROOM // 2  # a unit's KV room in the gguf form (fp16)


def units(n: int, kv_room: int = UNIT_KV_ROOM) -> int:
    """Memory for ``n`` units with their KV room, plus the runtime's."""
    return n * (UNIT_BYTES + kv_room) + RUNTIME_OVERHEAD_BYTES


def _requests(*at: float) -> tuple[Req, ...]:
    return tuple(Req(t, (5, 6, 7, i), 6) for i, t in enumerate(at))


def test_a_device_of_another_form_joining_a_tight_cluster_starts_no_plan_loop():
    """Two kernel workers each hold half the model in the gguf form with 0.1 MB to spare; a worker
    without the kernel library (the `native` form, twice the KV: a tab) joins at 5 s. The running
    plan still fits its devices, so no plan is prepared after the join, and every request is served."""
    tight = units(4, GGUF_KV_ROOM) + 100_000
    schedule = Schedule(4242, (tight, tight, units(3)), (0.0, 0.0, 5.0), _requests(2.0, 8.0, 14.0, 20.0, 26.0), (), kernel_less=(2,))
    report = run(schedule)
    assert not report.violations, report.violations
    assert report.ok == len(schedule.requests)
    after_join = [t for t in report.prepared if t >= 5.0]
    assert len(after_join) <= 1 and report.prepare_failed == 0, (report.prepared, report.prepare_failed)


def test_a_device_that_overstates_its_memory_is_planned_with_what_it_reported():
    """A worker declares room for the whole model but enforces a budget of four units: its first
    LOAD is refused, and the next plan is priced with the budget it reported (one refusal, not a
    loop); the requests are served."""
    schedule = Schedule(4444, (units(9), units(5)), (0.0, 0.0), _requests(2.0, 10.0, 18.0), (), budgets=(units(4), None))
    report = run(schedule)
    assert not report.violations, report.violations
    assert report.ok == len(schedule.requests)
    assert report.prepare_failed <= 1 and len(report.prepared) <= 3, (report.prepared, report.prepare_failed)


def test_after_a_recovery_onto_one_device_no_plan_it_cannot_load_is_prepared():
    """A worker of the plan is killed; the spare brings the whole model up on the one worker that
    holds it (eight of its nine units). A faster plan would give it five units beside the eight it
    runs, which it cannot load: that plan is not prepared (nor any other that cannot load)."""
    schedule = Schedule(4343, (units(5), units(9), units(3), units(3)), (0.0,) * 4, _requests(2.0, 10.0, 18.0, 24.0, 30.0),
                        (Fault("kill", 15.0, 0),))
    report = run(schedule)
    assert not report.violations, report.violations
    assert report.ok == len(schedule.requests)
    after_kill = [t for t in report.prepared if t >= 15.0]
    assert len(after_kill) <= 2 and report.prepare_failed <= 1, (report.prepared, report.prepare_failed)


def test_no_plan_failure_is_reported_while_devices_are_still_arriving():
    """Two workers whose budgets add up to the model but whose whole units do not (4 + 3 of 8):
    no plan can be made until a third joins at 6 s. The dashboard says nothing failed meanwhile
    (before the fix: a "plan failed to deploy" line at every look), and the cluster comes up."""
    def memory(n: float) -> int:
        return int(n * (UNIT_BYTES + UNIT_KV_ROOM)) + RUNTIME_OVERHEAD_BYTES

    schedule = Schedule(4545, (memory(4.5), memory(3.6), memory(5)), (0.0, 0.0, 6.0), _requests(8.0), ())
    report = run(schedule)
    assert not report.violations, report.violations
    assert report.ok == 1 and "up" in report.dashboard
    assert "plan_failed" not in report.dashboard[:report.dashboard.index("up")], report.dashboard
