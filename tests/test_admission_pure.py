"""An API request's state as plain decisions (no process, no loop). Admission: the book of
tickets is ``ClusterState.admission`` (``admission_book``), and ``core.handle`` decides who
runs, who waits in line, who is refused and who leaves the line when a slot frees. A paused
request: ``RequestPaused`` and the ``RequestFed`` that ends it are state, and the dashboard's
``pause``/``recovered`` lines are read from them (``narrate.entry``)."""

from __future__ import annotations

import pytest

from edgepipe.cluster.state import admission_book as AB, state as S
from edgepipe.cluster.rules import core
from edgepipe.cluster.shells import narrate

pytestmark = pytest.mark.pure  # no process, no model: the cores as plain functions

LIMITS = AB.Limits(max_active=3, max_queue=2, retry_after_s=7)
CONFIG = core.Config()


def _book(running=(), waiting=()) -> AB.AdmissionBook:
    book = AB.AdmissionBook()
    for ticket, positions in running:
        book = AB.apply(book, AB.Admitted(ticket, positions))
    for ticket, positions in waiting:
        book = AB.apply(book, AB.Queued(ticket, positions))
    return book


@pytest.mark.parametrize("running, waiting, positions, capacity, verdict", [
    ((), (), 10_000, 100, AB.Verdict.ADMIT),  # alone it always runs, whatever the capacity
    (((1, 10),), (), 10, None, AB.Verdict.ADMIT),
    (((1, 10), (2, 10), (3, 10)), (), 1, None, AB.Verdict.QUEUE),  # max_active running
    (((1, 300), (2, 300)), (), 300, 1000, AB.Verdict.ADMIT),  # 3 x 300 fits 1000
    (((1, 300), (2, 300)), (), 400, 1000, AB.Verdict.QUEUE),  # 3 x 400 does not
    (((1, 300),), (), 10, 500, AB.Verdict.QUEUE),  # 2 x the longest running (300) does not fit 500
    (((1, 10),), ((2, 10),), 1, None, AB.Verdict.QUEUE),  # it would fit, but nobody overtakes the line
    (((1, 10),), ((2, 10), (3, 10)), 1, None, AB.Verdict.REFUSE),  # the line is full
])
def test_admit_queue_or_refuse(running, waiting, positions, capacity, verdict):
    assert AB.decide(_book(running, waiting), positions, capacity, LIMITS) is verdict


def test_the_core_admits_queues_and_refuses_with_events_and_commands():
    state = S.ClusterState()
    for ticket in (1, 2, 3):
        done = core.handle(state, core.AdmitAsked(ticket, 10, None, LIMITS), CONFIG)
        assert done.events == (AB.Admitted(ticket, 10),) and done.commands == (core.StartRequest(ticket),)
        state = done.state
    queued = core.handle(state, core.AdmitAsked(4, 10, None, LIMITS), CONFIG)
    assert queued.events == (AB.Queued(4, 10),) and queued.commands == ()  # its waiter waits for a StartRequest
    state = core.handle(queued.state, core.AdmitAsked(5, 10, None, LIMITS), CONFIG).state
    refused = core.handle(state, core.AdmitAsked(6, 10, None, LIMITS), CONFIG)
    why = "server busy: 3 requests running and 2 queued; retry later"
    assert refused.events == (AB.Refused(6, why),) and refused.commands == (core.RefuseRequest(6, why, 7),)
    assert refused.state.admission.refused == 1 and 6 not in refused.state.admission.running
    assert dict(refused.state.admission.running) == {1: 10, 2: 10, 3: 10} and refused.state.admission.waiting == ((4, 10), (5, 10))


def test_a_release_starts_the_head_of_the_line_or_nobody():
    state = S.ClusterState()
    for event in (AB.Admitted(1, 300), AB.Admitted(2, 300), AB.Queued(3, 400), AB.Queued(4, 10)):
        state = S.apply(state, event)
    one = core.handle(state, core.AdmitLeft(1, 1000, LIMITS), CONFIG)  # 2 x 400 fits; then 3 x 400 does not: 4 waits behind
    assert one.events == (AB.AdmissionEnded(1), AB.Admitted(3, 400)) and one.commands == (core.StartRequest(3),)
    assert dict(one.state.admission.running) == {2: 300, 3: 400} and one.state.admission.waiting == ((4, 10),)
    both = core.handle(state, core.AdmitLeft(1, None, LIMITS), CONFIG)  # unbounded: both go, in arrival order
    assert both.commands == (core.StartRequest(3), core.StartRequest(4))
    blocked = core.handle(state, core.AdmitLeft(1, 500, LIMITS), CONFIG)  # the head does not fit: nobody goes
    assert blocked.events == (AB.AdmissionEnded(1),) and blocked.commands == ()


def test_leaving_the_line_and_unknown_tickets():
    state = S.ClusterState()
    for event in (AB.Admitted(1, 10), AB.Admitted(2, 10), AB.Admitted(3, 10), AB.Queued(4, 10), AB.Queued(5, 10)):
        state = S.apply(state, event)
    left = core.handle(state, core.AdmitLeft(4, None, LIMITS), CONFIG)
    assert left.events == (AB.AdmissionEnded(4),) and left.commands == () and left.state.admission.waiting == ((5, 10),)
    unknown = core.handle(state, core.AdmitLeft(99, None, LIMITS), CONFIG)
    assert unknown.events == () and unknown.state is state
    assert S.apply(state, AB.AdmissionEnded(99)) == state  # a late or duplicated end is harmless


def test_the_book_replays_from_its_events_and_has_no_dashboard_line():
    state, log = S.ClusterState(), []
    limits = AB.Limits(max_active=3, max_queue=2)
    for asked in (core.AdmitAsked(1, 10, 100, limits), core.AdmitAsked(2, 90, 100, limits), core.AdmitAsked(3, 10, 100, limits),
                  core.AdmitLeft(1, 100, limits), core.AdmitAsked(4, 10, 100, limits), core.AdmitAsked(5, 10, 100, limits),
                  core.AdmitLeft(2, 100, limits)):
        done = core.handle(state, asked, CONFIG)
        state, log = done.state, log + list(done.events)
    replayed = S.ClusterState()
    for event in log:
        replayed = S.apply(replayed, event)
    assert replayed.admission == state.admission
    assert dict(state.admission.running) == {3: 10, 4: 10} and state.admission.refused == 1  # 2 (90) ran alone; 5 found the line full
    assert all(narrate.entry(e, state, None, 0.0) is None for e in log)
    assert AB.limit(state.admission, 100, AB.Limits(max_active=16)) == 10 and AB.limit(state.admission, None, LIMITS) == 3


def test_pause_and_recovered_lines_come_from_their_events():
    state = S.apply(S.ClusterState(), S.RequestStarted("r1", 50))
    state = S.apply(state, S.RequestFed("r1", "r1.0", 1, 10, 1.0))
    assert narrate.entry(S.RequestFed("r1", "r1.0", 1, 10, 1.0), state, None, 0.0) is None  # no pause ended
    paused = S.RequestPaused("r1", 3, "worker w2 lost", 2.0)
    state = S.apply(state, paused)
    assert state.requests["r1"].paused == (2.0, 3)
    assert narrate.entry(paused, state, None, 5.0) == {"t": 5.0, "kind": "pause", "request": "r1", "step": 3, "why": "worker w2 lost"}
    again = S.RequestPaused("r1", 3, "still no plan", 2.5)
    assert S.apply(state, again) == state and narrate.entry(again, S.apply(state, again), None, 5.0) is None  # paused once
    fed = S.RequestFed("r1", "r1.1", 2, 12, 4.25)
    state = S.apply(state, fed)
    assert state.requests["r1"].paused is None
    assert narrate.entry(fed, state, None, 6.0) == {"t": 6.0, "kind": "recovered", "request": "r1", "step": 3, "seconds": 2.25, "plan": 2}
    next_fed = S.RequestFed("r1", "r1.1", 2, 13, 4.5)
    assert narrate.entry(next_fed, S.apply(state, next_fed), None, 7.0) is None  # one line per pause
