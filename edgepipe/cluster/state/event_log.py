"""The coordinator's indexed, bounded event log: every state event and measurement, in order.

``EventLog`` keeps the last ``size`` of them with the state and the profile as they stood before
the oldest kept, so ``replay()`` rebuilds what the planner decided from (a test checks that it
does), and ``since(index)`` hands a reader what it has not yet seen. Each event is kept with the
wall-clock time it was logged at: ``walk()`` gives every event with that time and the state and
profile right after it, from which the dashboard's lines are derived (``narrate.entry``; a test
checks a walk gives the lines the coordinator showed).
"""

from __future__ import annotations

import copy
from collections import deque

from . import measurements
from .state import ClusterState, apply


class EventLog:
    """The last ``size`` events, numbered from 0: the state events (applied with ``apply``) and
    the measurements (``cluster.measurements``, applied to the profile), with the state and the
    profile as they stood before the oldest kept. ``replay()`` folds the kept events over those
    and gives the state and profile they produced, so what the planner decided from can be
    rebuilt from the log (and a test checks that it is)."""

    def __init__(self, initial: ClusterState, profile=None, size: int = 4096):
        self.base, self.first, self.size = initial, 0, size  # the state before event number ``first``
        self.base_profile = copy.deepcopy(profile)  # the profile before it (advanced in place as events drop off)
        self.events: deque = deque()
        self.walls: deque = deque()  # the wall-clock time each was logged at (what the dashboard shows)

    def append(self, event, wall: float = 0.0) -> int:
        """Record an applied event or measurement; its index."""
        self.events.append(event)
        self.walls.append(wall)
        if len(self.events) > self.size:
            self.base = self._fold(self.base, self.base_profile, self.events.popleft())
            self.walls.popleft()
            self.first += 1
        return self.first + len(self.events) - 1

    def since(self, index: int) -> list[tuple[int, object]]:
        """The kept events numbered ``index`` and later (the earliest kept if those are gone)."""
        start = max(index, self.first)
        return [(i, e) for i, e in enumerate(self.events, self.first) if i >= start]

    def replay(self):
        """(state, profile) after the kept events."""
        state, profile = self.base, copy.deepcopy(self.base_profile)
        for event in self.events:
            state = self._fold(state, profile, event)
        return state, profile

    def walk(self):
        """Each kept event with its wall time and the state and profile right after it, folded
        from the base (the profile is one copy, advanced in place: read it before the next)."""
        state, profile = self.base, copy.deepcopy(self.base_profile)
        for event, wall in zip(self.events, self.walls):
            state = self._fold(state, profile, event)
            yield event, wall, state, profile

    @staticmethod
    def _fold(state: ClusterState, profile, event) -> ClusterState:
        if isinstance(event, MEASUREMENTS):
            if profile is not None:
                profile.apply(event)
            return state
        return apply(state, event)


MEASUREMENTS = tuple(getattr(measurements, n) for n in measurements.__dict__ if isinstance(getattr(measurements, n), type)
                     and getattr(measurements, n).__module__ == measurements.__name__)
