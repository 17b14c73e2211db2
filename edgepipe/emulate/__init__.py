"""Labelled emulation of slower devices and links on one machine, for tests and benchmarks.

- ``shaper``   user-space link shaping (delay, rate, loss): a TCP relay and ``shaped_send``.
- ``netns``    kernel rate caps: a network namespace + veth + ``tbf`` per device (root only).
- ``slowdown`` compute slowdown factor and memory budget.
- ``roofline`` a device with a compute rate and a memory bandwidth (memory-bound at one row, compute-bound at many).

Every object here has ``emulated = True`` and a ``label()`` saying "emulated", so that reports
never pass emulated numbers off as measured on real devices; except ``MemoryBudget``: a memory
budget is one the user chose (``worker --memory``), a real cap on a real device too, not emulation.
"""

from edgepipe.emulate.netns import EmulationUnavailable, NetnsCommandFailed, NetnsHost
from edgepipe.emulate.shaper import (
    DelayRelay,
    ForwardedBytes,
    LinkShape,
    ShapedLink,
    TokenBucket,
    parse_rate,
    shaped_send,
)
from edgepipe.emulate.roofline import RooflinePolicy
from edgepipe.emulate.slowdown import MemoryBudget, MemoryBudgetExceeded, SlowdownPolicy, parse_bytes

__all__ = [
    "DelayRelay",
    "EmulationUnavailable",
    "ForwardedBytes",
    "LinkShape",
    "MemoryBudget",
    "MemoryBudgetExceeded",
    "NetnsCommandFailed",
    "NetnsHost",
    "RooflinePolicy",
    "ShapedLink",
    "SlowdownPolicy",
    "TokenBucket",
    "parse_bytes",
    "parse_rate",
    "shaped_send",
]
