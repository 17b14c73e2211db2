"""Micro-batch lanes (pure bookkeeping, part of the cluster state) and the KV pool's row gathering."""

import numpy as np

from edgepipe.cluster.state.batching import (MAX_LANE, LaneAsked, LaneBook, LaneExpired, LaneItem, LaneLeft, LaneReturned, apply,
                                       departures)
from edgepipe.runtime.stage_runner import _KVPool


class Lanes:
    """The lanes as the state holds them, folded event by event (``batching.departures``): the
    batches each event lets go, and the timers it starts (handed to ``arm``)."""

    def __init__(self, arm=lambda i, d: None, max_lane=MAX_LANE):
        self.book, self.arm, self.max_lane = LaneBook(), arm, max_lane

    def _after(self, event):
        gone = departures(self.book, event, self.max_lane)
        if self.max_lane == MAX_LANE:
            assert apply(self.book, event) == gone.book  # the state's reducer folds the same lanes
        self.book = gone.book
        for index, departure in gone.armed:
            self.arm(index, departure)
        return [list(b) for b in gone.batches]

    def submit(self, item, n_lanes):
        return self._after(LaneAsked(item, n_lanes))

    def returned(self, rid):
        return self._after(LaneReturned(rid))

    def leave(self, rid):
        return self._after(LaneLeft(rid))

    def expire(self, index, departure):
        return self._after(LaneExpired(index, departure))

    def sizes(self):
        return self.book.sizes()


def item(rid, plan=1):
    return LaneItem(rid, plan, ord(rid))


def rids(batches):
    return [sorted(i.rid for i in b) for b in batches]


def test_one_sequence_goes_out_at_once():
    lanes = Lanes()
    assert rids(lanes.submit(item("a"), 3)) == [["a"]]
    assert lanes.returned("a") == []
    assert rids(lanes.submit(item("a"), 3)) == [["a"]]  # alone in its lane: no waiting


def test_sequences_spread_over_one_lane_per_stage():
    lanes = Lanes()
    for r in "abcdef":
        lanes.submit(item(r), 3)
    assert lanes.sizes() == [2, 2, 2]


def test_a_lane_waits_for_all_its_members_then_leaves_together():
    armed = []
    lanes = Lanes(arm=lambda i, d: armed.append((i, d)))
    lanes.submit(item("a"), 1)
    lanes.submit(item("b"), 1)  # a is flying: b waits for the lane
    assert lanes.returned("a") == []  # back, but a has not asked for its next step yet
    assert armed  # a timer bounds the wait for it
    assert rids(lanes.submit(item("a"), 1)) == [["a", "b"]]


def flying_pair(armed):
    lanes = Lanes(arm=lambda i, d: armed.append((i, d)))
    lanes.submit(item("a"), 1)
    lanes.submit(item("b"), 1)
    lanes.returned("a")
    lanes.submit(item("a"), 1)  # a and b fly together
    lanes.returned("a")
    lanes.returned("b")
    return lanes


def test_a_late_member_is_left_behind_after_the_wait():
    armed = []
    lanes = flying_pair(armed)
    assert lanes.submit(item("a"), 1) == []
    index, departure = armed[-1]
    assert rids(lanes.expire(index, departure)) == [["a"]]
    assert lanes.expire(index, departure) == []  # a stale timer does nothing
    assert lanes.submit(item("b"), 1) == []  # b waits for its lane to come back
    assert lanes.returned("a") == []  # now the lane waits for a again ...
    assert rids(lanes.submit(item("a"), 1)) == [["a", "b"]]  # ... and both go


def test_leaving_releases_a_lane_that_waited_for_it():
    lanes = flying_pair([])
    lanes.submit(item("a"), 1)
    assert rids(lanes.leave("b")) == [["a"]]


def test_steps_of_two_plans_go_in_separate_frames():
    lanes = flying_pair([])
    lanes.submit(item("a", plan=1), 1)
    out = lanes.submit(item("b", plan=2), 1)
    assert sorted(rids(out)) == [["a"], ["b"]]


def test_lanes_are_capped_and_rebalanced_when_the_plan_shrinks():
    lanes = Lanes(max_lane=2)
    for r in "abcde":
        lanes.submit(item(r), 2)
    assert sorted(lanes.sizes()) == [1, 2, 2]  # a third lane once two are full
    for r in "abcde":
        lanes.returned(r)
    lanes.leave("a")
    lanes.leave("b")
    # One stage now: everyone still here ends up in lane 0.
    for r in "cde":
        lanes.submit(item(r), 1)
    assert lanes.sizes()[0] >= 2


def test_gather_makes_rows_contiguous_and_keeps_each_sequences_kv():
    pool = _KVPool([0], kv_heads=1, head_dim=2)
    for s in "abcd":
        pool.add(s)
    pool.reserve(4)
    for s, r in pool.row_of.items():
        for a in pool.arrays.values():
            a[r] = ord(s)
    pool.gather(["a", "c"])
    rows = sorted(pool.row_of[s] for s in "ac")
    assert rows == [rows[0], rows[0] + 1]
    for s, r in pool.row_of.items():
        for a in pool.arrays.values():
            assert np.all(a[r] == ord(s)), s
    assert sorted(pool.row_of.values()) == [0, 1, 2, 3]


def test_a_step_that_failed_while_waiting_is_not_sent_and_does_not_hold_the_lane():
    lanes = flying_pair([])
    lanes.submit(item("a"), 1)
    assert lanes.returned("a") == []  # a's step failed (its plan broke) before the lane went out
    assert rids(lanes.submit(item("b"), 1)) == []  # the lane still waits for a's next step ...
    assert rids(lanes.submit(item("a"), 1)) == [["a", "b"]]  # ... and both go together
