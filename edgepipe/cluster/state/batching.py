"""Micro-batches for the pipeline: stable groups ("lanes") of sequences that travel together.

With one sequence only one stage works at a time. With many, the coordinator keeps one
micro-batch per stage in flight (recurrent pipelining, seed 001 ch. 3): every sequence
belongs to a lane; a lane's decode steps go out as one frame, every stage runs a frame as
one batch, and the lane's tokens come back together. A lane goes out again as soon as all its
members have asked for their next step (or after ``wait_s``, so one slow consumer cannot
stall the others: a member that misses its lane's departure waits for the next one).

Lanes are stable on purpose. Stages never merge two waiting frames: two lanes that meet at a
stage leave it one after the other and so spread over the stages again, whereas merged lanes
would stay bunched forever and leave stages idle.

The lanes are part of the cluster state (``StepBook.lanes``, ``step_book``), changed by the
events below through ``apply``: a decode step asks for its lane (``LaneAsked``), a sequence's step
is over (``LaneReturned``), a sequence leaves its lane (``LaneLeft``: a prefill travels alone, a
finished one is gone), the wait for a lane's late members is over (``LaneExpired``). Each is also
a decision (``departures``): the batches to send now and the lanes whose wait timer starts (no
I/O, no clock: ``core.handle`` turns them into commands the shell carries out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

MAX_LANE = 16  # sequences in one micro-batch at most (a worker's batch limit)


@dataclass(frozen=True)
class LaneItem:
    """One decode step of one sequence, waiting to go out with its lane."""

    rid: str  # the request (stable over plan changes, unlike the sequence id)
    plan: int
    step_id: int  # its step in flight (``step_book``): the shell holds what its frame carries
    route: tuple = ()  # its replicas (``cluster.replicas``): a frame goes to one first-stage replica


@dataclass(frozen=True)
class LaneState:
    index: int
    members: frozenset[str] = frozenset()
    waiting: Mapping[str, LaneItem] = field(default_factory=lambda: MappingProxyType({}))
    flying: frozenset[str] = frozenset()
    departures: int = 0  # how many times the lane went out
    armed: int = -1  # the departure a wait timer was armed for


@dataclass(frozen=True)
class LaneBook:
    lanes: tuple[LaneState, ...] = ()
    lane_of: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def sizes(self) -> list[int]:
        return [len(lane.members) for lane in self.lanes]

    def idle(self) -> bool:
        """No sequence in any lane."""
        return not self.lane_of and not any(lane.members or lane.waiting or lane.flying for lane in self.lanes)


@dataclass(frozen=True)
class LaneAsked:
    """A sequence's decode step asks to go out with its lane (``n_lanes``: the plan's stages)."""

    item: LaneItem
    n_lanes: int


@dataclass(frozen=True)
class LaneReturned:
    """A sequence's step is over (token, failure or timeout)."""

    rid: str


@dataclass(frozen=True)
class LaneLeft:
    """A sequence steps out of its lane (a prefill travels alone; a finished one is gone)."""

    rid: str


@dataclass(frozen=True)
class LaneExpired:
    """The wait for lane ``index``'s late members, armed at ``departure``, is over."""

    index: int
    departure: int


LaneEvent = LaneAsked | LaneReturned | LaneLeft | LaneExpired


@dataclass(frozen=True)
class Departures:
    book: LaneBook  # the lanes after the event
    batches: tuple[tuple[LaneItem, ...], ...]  # to send now: each of one plan and first worker
    armed: tuple[tuple[int, int], ...]  # (lane, departure): start its wait timer (``wait_s``), then ``LaneExpired``


def departures(book: LaneBook, event: LaneEvent, max_lane: int = MAX_LANE) -> Departures:
    """The lanes after ``event``, the batches it lets go and the timers it starts (pure)."""
    armed: list[tuple[int, int]] = []
    lanes = Lanes(arm=lambda i, d: armed.append((i, d)), max_lane=max_lane)
    lanes.lanes = [Lane(x.index, set(x.members), dict(x.waiting), set(x.flying), x.departures, x.armed) for x in book.lanes]
    lanes.lane_of = dict(book.lane_of)
    match event:
        case LaneAsked(item, n_lanes):
            batches = lanes.submit(item, n_lanes)
        case LaneReturned(rid):
            batches = lanes.returned(rid)
        case LaneLeft(rid):
            batches = lanes.leave(rid)
        case LaneExpired(index, departure):
            batches = lanes.expire(index, departure) if index < len(lanes.lanes) else []
    after = LaneBook(tuple(LaneState(x.index, frozenset(x.members), MappingProxyType(dict(x.waiting)), frozenset(x.flying), x.departures,
                                     x.armed) for x in lanes.lanes), MappingProxyType(dict(lanes.lane_of)))
    return Departures(after, tuple(tuple(b) for b in batches), tuple(armed))


def apply(book: LaneBook, event: LaneEvent) -> LaneBook:
    return departures(book, event).book


def out(book: LaneBook, rid: str) -> bool:
    """``rid``'s lane counts it out (a step of it in flight, or its stage feeding it itself)."""
    i = book.lane_of.get(rid)
    return i is not None and i < len(book.lanes) and rid in book.lanes[i].flying


@dataclass
class Lane:
    index: int
    members: set[str] = field(default_factory=set)
    waiting: dict[str, LaneItem] = field(default_factory=dict)
    flying: set[str] = field(default_factory=set)
    departures: int = 0  # how many times the lane went out
    armed: int = -1  # the departure a wait timer was armed for


class Lanes:
    """Assigns sequences to lanes and decides when a lane's steps go out (the working form of a
    ``LaneBook`` inside ``departures``).

    Every method returns the batches to send now: lists of items of one plan and first worker
    each (a lane whose members use different replicas of the first stage goes out as a frame per
    replica; a stage before a replicated one splits its output by route the same way, so the
    replicas compute at the same time and the stages they share batch the whole lane).
    ``arm(index, departure)`` is called when a lane waits for late members; the caller calls
    :meth:`expire` with both after ``wait_s`` (a stale departure number is ignored).
    """

    def __init__(self, arm: Callable[[int, int], None] = lambda i, d: None, max_lane: int = MAX_LANE):
        self.lanes: list[Lane] = []
        self.lane_of: dict[str, int] = {}
        self.arm = arm
        self.max_lane = max_lane

    def submit(self, item: LaneItem, n_lanes: int) -> list[list[LaneItem]]:
        """A sequence asks for its next decode step."""
        out: list[list[LaneItem]] = []
        lane = self._assign(item.rid, max(1, n_lanes), out)
        lane.waiting[item.rid] = item
        return out + self._try(lane)

    def returned(self, rid: str) -> list[list[LaneItem]]:
        """A sequence's step is over (token, failure or timeout)."""
        i = self.lane_of.get(rid)
        if i is None:
            return []
        lane = self.lanes[i]
        lane.flying.discard(rid)
        lane.waiting.pop(rid, None)  # failed before its lane went out: nothing to send
        return self._try(lane)

    def leave(self, rid: str) -> list[list[LaneItem]]:
        """A sequence ended: its lane stops waiting for it."""
        i = self.lane_of.pop(rid, None)
        if i is None:
            return []
        lane = self.lanes[i]
        lane.members.discard(rid)
        lane.waiting.pop(rid, None)
        lane.flying.discard(rid)
        return self._try(lane)

    def expire(self, index: int, departure: int) -> list[list[LaneItem]]:
        """The wait for a lane's late members is over: send who is there."""
        lane = self.lanes[index]
        if lane.departures != departure:
            return []
        return self._try(lane, force=True)

    def sizes(self) -> list[int]:
        return [len(lane.members) for lane in self.lanes]

    # -- internals --------------------------------------------------------------------------
    def _assign(self, rid: str, n_lanes: int, out: list) -> Lane:
        while len(self.lanes) < n_lanes:
            self.lanes.append(Lane(len(self.lanes)))
        current = self.lane_of.get(rid)
        others = [lane for lane in self.lanes[:n_lanes] if lane.index != current and len(lane.members) < self.max_lane]
        smallest = min(others, key=lambda lane: len(lane.members), default=None)
        if current is not None:
            mine = self.lanes[current]
            # Stay unless the lane is not part of this plan or is clearly the fuller one.
            if current < n_lanes and (smallest is None or len(mine.members) <= len(smallest.members) + 1):
                return mine
            mine.members.discard(rid)
            mine.waiting.pop(rid, None)
            out += self._try(mine)  # it may have waited only for this one
        if smallest is None:
            smallest = next((lane for lane in self.lanes[n_lanes:] if len(lane.members) < self.max_lane), None)
            if smallest is None:
                smallest = Lane(len(self.lanes))
                self.lanes.append(smallest)
        smallest.members.add(rid)
        self.lane_of[rid] = smallest.index
        return smallest

    def _try(self, lane: Lane, force: bool = False) -> list[list[LaneItem]]:
        if lane.flying or not lane.waiting:
            return []
        if not force and not lane.members <= lane.waiting.keys():
            if lane.armed != lane.departures:
                lane.armed = lane.departures
                self.arm(lane.index, lane.departures)
            return []
        by_plan: dict[tuple, list[LaneItem]] = {}
        for item in lane.waiting.values():
            by_plan.setdefault((item.plan, item.route[:1]), []).append(item)
        lane.flying = set(lane.waiting)
        lane.waiting = {}
        lane.departures += 1
        return list(by_plan.values())
