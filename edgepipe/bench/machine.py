"""Where a benchmark ran and under what load: the one machine description and load line that
every result under ``benchmarks/results`` carries, and the machine's own speed limits
(memory read bandwidth) that some results are read against.

A benchmark takes its conditions when it starts and closes them when it ends::

    run = Conditions.start()
    ...                                   # measure
    run.finish()
    data = {**run.as_dict(), ...}         # "date", "machine", "load_average": {"before", "after"}
    markdown = f"{run.line()} · ..."      # 2026-11-26 20:15 UTC · 2 cores (…), 7.8 GiB · load average …
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


def _proc_lines(name: str) -> list[str]:
    path = Path("/proc") / name
    return path.read_text().splitlines() if path.exists() else []


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    return next((line.split(":", 1)[1].strip() for line in _proc_lines("cpuinfo") if line.startswith("model name")),
                platform.processor() or platform.machine())


def memory_mib() -> int | None:
    """Total RAM in MiB (``/proc/meminfo``), None where unknown."""
    return next((int(line.split()[1]) // 1024 for line in _proc_lines("meminfo") if line.startswith("MemTotal")), None)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, as ``uptime`` shows them."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """This machine, JSON-ready: cores, CPU, RAM, architecture, OS, Python."""
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "memory_mib": memory_mib(), "arch": platform.machine(),
            "os": platform.platform(), "python": platform.python_version()}


def machine_line(info: dict | None = None) -> str:
    """``2 cores (AMD EPYC 7B13), 7.8 GiB RAM``: the machine part of a result's header."""
    info = info or machine()
    memory = f", {info['memory_mib'] / 1024:.1f} GiB RAM" if info.get("memory_mib") else ""
    return f"{info['nproc']} cores ({info['cpu']}){memory}"


def load_text(load: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class Conditions:
    """The date, the machine and the load average at the start and at the end of one run."""

    date: str
    machine: dict
    load_before: list[float]
    load_after: list[float] | None = None
    started: float = field(default_factory=time.monotonic, repr=False)

    @classmethod
    def start(cls) -> Conditions:
        return cls(now_utc(), machine(), load_average())

    def finish(self) -> Conditions:
        """Take the load at the end (again, if called again) and return self."""
        self.load_after = load_average()
        return self

    @property
    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def as_dict(self) -> dict:
        return {"date": self.date, "machine": self.machine,
                "load_average": {"before": self.load_before, "after": self.load_after}}

    def line(self) -> str:
        """``date · machine · load average before[, after]`` (``uptime``'s three figures each)."""
        load = f"load average {load_text(self.load_before)} at start"
        if self.load_after is not None:
            load += f", {load_text(self.load_after)} at end"
        return f"{self.date} · {machine_line(self.machine)} · {load}"

    @classmethod
    def from_dict(cls, data: dict) -> Conditions:
        """Conditions as ``as_dict`` wrote them (a report rebuilt from saved results)."""
        load = data.get("load_average") or {}
        return cls(data["date"], data["machine"], load.get("before") or [], load.get("after"))


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, None if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def memory_bandwidth_gb_s(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """Best read bandwidth of ``threads`` numpy threads summing disjoint parts of one array.

    Allocates ``gib`` GiB: run it in a child process where a parent's peak RSS matters."""
    import numpy as np

    data = np.ones(int(gib * (1 << 30)) // 8, np.float64)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(reps):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]  # numpy releases the GIL
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return round(best, 2)


if __name__ == "__main__":  # python -m edgepipe.bench.machine 2: the bandwidth probe, in a process of its own
    import sys

    print(memory_bandwidth_gb_s(int(sys.argv[1])))
