"""What the cluster state keeps of one worker (``WorkerInfo``) and of a device caught dropping
work (``Quarantine``), with the pure changes a heartbeat and a strike make to them.

A worker's record holds what it declared (its ``Hello``), when it was last heard, its recent
gaps between frames (what the failure detector, ``membership``, reads) and the long ones among
them (stalls), its round trip and stats from the last pong, whether it is suspected, and whether
the calibrator holds it, and which link-probe secret its data port accepts. A quarantine is kept by device identity, so that reconnecting does not
clear it; each strike doubles the time out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

from ...net.capabilities import Capabilities, capabilities
from ...net.messages import Hello

HEARTBEAT_WINDOW = 32  # inter-arrival times kept per worker for the failure detector
STALL_S = 1.0  # a gap at least this long is also kept among a worker's stalls...
STALL_WINDOW = 8  # ...the last this many (a busy worker's 32 gaps span only seconds)
QUARANTINE_S = 60.0  # a worker caught dropping work sits out this long the first time
QUARANTINE_MAX_S = 1800.0


def _frozen(d: Mapping) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    name: str
    hello: Hello  # what the worker declared
    joined_at: float
    last_seen: float
    intervals: tuple[float, ...] = ()  # recent gaps between frames heard from it (seconds)
    stalls: tuple[float, ...] = ()  # its last gaps of STALL_S or more: how long this machine has been seen to stall
    suspected_since: float | None = None  # silent for too long: probed, not used for new plans
    rtt_s: float | None = None
    stats: Mapping = field(default_factory=lambda: _frozen({}))
    stats_at: float | None = None  # when ``stats`` arrived (the last pong)
    calibrating: bool = False  # the calibrator holds it (timing it or measuring its links): not planned meanwhile
    probe_secret: str | None = field(default=None, repr=False)  # the link-probe secret its data port accepts (``links``)

    alive = True  # a lost worker leaves the state; kept for views that still ask

    @property
    def memory_bytes(self) -> int:
        return self.hello.memory_bytes

    @cached_property
    def caps(self) -> Capabilities:
        """What it can run, derived once from its hello (``net.capabilities``)."""
        return capabilities(self.hello)

    @property
    def relay(self) -> bool:
        return self.caps.relay

    @property
    def identity(self) -> tuple:
        """Name and declared hardware: a device that comes back with these is the same device (a tab
        that found a GPU this time is not the one that computed on the CPU last time; with or without
        the GGUF kernel library a worker runs another form: timed again)."""
        h = self.hello
        emulation = None if h.emulation is None else dict(h.emulation)  # repr'd as the plain map it was sent as
        return (self.name, h.kind, h.memory_bytes, h.threads, repr(emulation), h.precision, h.device or "cpu", h.adapter, h.native_kernel)


@dataclass(frozen=True)
class Quarantine:
    """A device that took work and returned none: kept out of new plans until ``until``."""

    until: float
    strikes: int  # times it was caught: each doubles the time out
    why: str


def heard(w: WorkerInfo, now: float) -> WorkerInfo:
    """``w`` after a frame heard from it at ``now``: the gap joins its window, a long one its
    stalls, and it is no longer suspected."""
    gap = now - w.last_seen
    intervals = (w.intervals + (gap,))[-HEARTBEAT_WINDOW:] if gap > 0 else w.intervals
    stalls = (w.stalls + (gap,))[-STALL_WINDOW:] if gap >= STALL_S else w.stalls
    return _replace(w, last_seen=max(now, w.last_seen), intervals=intervals, stalls=stalls, suspected_since=None)


def struck(before: Quarantine | None, why: str, now: float) -> Quarantine:
    """The quarantine after one more strike at ``now``: each doubles the time out (at most ``QUARANTINE_MAX_S``)."""
    strikes = (before.strikes if before else 0) + 1
    return Quarantine(now + min(QUARANTINE_S * 2 ** (strikes - 1), QUARANTINE_MAX_S), strikes, why)


def _replace(obj, **changes):
    """``dataclasses.replace`` without re-running ``__init__`` (the reducer's hot path; see ``state._replace``)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new
