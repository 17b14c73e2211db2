"""Compute emulation: a slowdown factor and a memory budget for a worker posing as a weaker device.

Pure helpers only; the worker does the waiting and the refusing. Everything here is emulation
and says so (``emulated``, ``label()``) so that reports can mark it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

_BYTES_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_BYTE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_BYTES_FORMS = "expected a non-negative integer or a number with a unit such as '800MB', '1.5GB' or '512MiB'"


def parse_bytes(size: str | int) -> int:
    """A byte count from an int or ``"1.5GB"``, ``"800MB"``, ``"512MiB"`` (KB = 1000, KiB = 1024).

    Unit prefixes are case-insensitive ("kb" = "KB"); fractional results round to the nearest
    byte. Raises ``ValueError`` naming the accepted forms.
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"cannot parse byte size {size!r}: {_BYTES_FORMS}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"byte size must be >= 0, got {size}")
        return size
    match = _BYTES_PATTERN.match(size)
    if match is None:
        raise ValueError(f"cannot parse byte size {size!r}: {_BYTES_FORMS}")
    number, unit = match.groups()
    canonical = {name.lower(): name for name in _BYTE_UNITS}.get(unit.lower())
    if canonical is None:
        raise ValueError(f"cannot parse byte size {size!r}: unknown unit {unit!r}; {_BYTES_FORMS}")
    return round(float(number) * _BYTE_UNITS[canonical])


def format_bytes(nbytes: int) -> str:
    """A human-readable size, decimal units, for messages and reports."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class SlowdownPolicy:
    """Make a worker ``factor`` times slower than the host by waiting after each compute call."""

    factor: float  # 1.0 = host speed; 3.0 = a device three times slower

    emulated: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.factor >= 1 or self.factor == float("inf"):
            raise ValueError(f"slowdown factor must be a finite number >= 1, got {self.factor}")

    def extra_wait(self, compute_seconds: float, cpu_seconds: float | None = None) -> float:
        """Seconds to wait after a call that took ``compute_seconds`` of wall time.

        Without ``cpu_seconds``: ``(factor - 1) * compute``. With the call's CPU time (single-
        threaded compute), the emulated device takes ``factor * cpu`` in all: on a host shared
        with other workers the wall time includes waiting for a core, which a real device of
        its own would not do, and multiplying it would emulate that contention ``factor`` times.
        """
        if compute_seconds < 0 or (cpu_seconds is not None and cpu_seconds < 0):
            raise ValueError(f"compute time must be >= 0, got {compute_seconds} (cpu {cpu_seconds})")
        if cpu_seconds is None:
            return (self.factor - 1) * compute_seconds
        if self.factor == 1:
            return 0.0
        return max(0.0, self.factor * cpu_seconds - compute_seconds)

    def label(self) -> str:
        return f"emulated compute slowdown x{self.factor:g}"


class MemoryBudgetExceeded(MemoryError):
    """A device was asked to hold more than its memory budget (``--memory``: a budget the user chose, emulated or not)."""

    def __init__(self, what: str, requested_bytes: int, in_use_bytes: int, budget_bytes: int) -> None:
        self.what = what
        self.requested_bytes = requested_bytes
        self.in_use_bytes = in_use_bytes
        self.budget_bytes = budget_bytes
        free = max(0, budget_bytes - in_use_bytes)
        super().__init__(
            f"{what} needs {format_bytes(requested_bytes)} ({requested_bytes} bytes) but only "
            f"{format_bytes(free)} ({free} bytes) of the {format_bytes(budget_bytes)} "
            f"memory budget is free ({in_use_bytes} bytes in use)"
        )


@dataclass(frozen=True)
class MemoryBudget:
    """The most memory a device will admit to having: a budget the user chose (``worker --memory``), enforced
    on a real device as on an emulated one, so it is not labelled emulation (issue 42)."""

    budget_bytes: int

    emulated: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes < 0:
            raise ValueError(f"memory budget must be a non-negative int of bytes, got {self.budget_bytes!r}")

    @classmethod
    def of(cls, size: str | int) -> "MemoryBudget":
        """A budget from ``"1.5GB"``, ``"512MiB"`` or an int (see ``parse_bytes``)."""
        return cls(parse_bytes(size))

    def fits(self, requested_bytes: int, in_use_bytes: int = 0) -> bool:
        return in_use_bytes + requested_bytes <= self.budget_bytes

    def check(self, requested_bytes: int, what: str, in_use_bytes: int = 0) -> None:
        """Raise ``MemoryBudgetExceeded`` naming ``what`` unless it fits beside ``in_use_bytes``."""
        if requested_bytes < 0 or in_use_bytes < 0:
            raise ValueError(f"byte counts must be >= 0, got {requested_bytes} requested, {in_use_bytes} in use")
        if not self.fits(requested_bytes, in_use_bytes):
            raise MemoryBudgetExceeded(what, requested_bytes, in_use_bytes, self.budget_bytes)

    def label(self) -> str:
        return f"memory budget {format_bytes(self.budget_bytes)}"
