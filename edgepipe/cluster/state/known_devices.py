"""What is kept about one device: its measurements, its lives, and the calibrations remembered
across coordinator restarts.

``DeviceMeasurements`` holds one worker's speed, per-call overhead, link and step medians;
``DeviceLives`` how long a named device stayed each time and how often it left. ``save`` and
``load`` keep the finished calibrations on disk by device identity (name and declared
hardware), so a device that comes back with the same hardware need not be timed again, even
after the coordinator restarted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ...plan import RollingMedian


@dataclass
class DeviceMeasurements:
    speed: float = 1.0
    overhead_s: float = 0.0
    calibrated: bool = False
    rtt: RollingMedian = field(default_factory=lambda: RollingMedian(16))
    bandwidth_bytes_per_s: float | None = None
    stage_times: dict[tuple[int, int], RollingMedian] = field(default_factory=dict)  # single-sequence steps
    batched_times: dict[tuple[int, int, int], RollingMedian] = field(default_factory=dict)  # (start, end, batch)
    anchors: dict[tuple[int, int, int], tuple[float, float]] = field(default_factory=dict)  # -> (median, speed then)
    trusted: bool = True  # False: its probe times were caught under-reporting; its step timings are not used
    row_speed: float | None = None  # cost units / s of each further row of a batched step (None: not measured)


@dataclass
class DeviceLives:
    """How long a named device stayed each time it joined, and how often it left."""

    alive_s: float = 0.0
    failures: int = 0
    joined_at: float | None = None


def save(known: dict[tuple, DeviceMeasurements], model_name: str, path: Path) -> None:
    """The remembered calibrations as JSON (written atomically)."""
    rows = [{"identity": list(identity), "speed": m.speed, "overhead_s": m.overhead_s, "bandwidth_bytes_per_s": m.bandwidth_bytes_per_s,
             "trusted": m.trusted, "row_speed": m.row_speed} for identity, m in known.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model_name, "devices": rows}))
    os.replace(tmp, path)


def load(path: Path, model_name: str) -> dict[tuple, DeviceMeasurements]:
    """Calibrations saved by an earlier coordinator for ``model_name`` (a missing, foreign or
    unreadable file gives none: devices are simply timed again; a row with impossible figures is skipped)."""
    known: dict[tuple, DeviceMeasurements] = {}
    try:
        data = json.loads(path.read_text())
        if data.get("model") != model_name:
            return {}
        for row in data["devices"]:
            speed, overhead, bandwidth = float(row["speed"]), float(row["overhead_s"]), row.get("bandwidth_bytes_per_s")
            if not (0 < speed < float("inf") and 0 <= overhead < float("inf")):
                continue
            known[tuple(row["identity"])] = DeviceMeasurements(speed, overhead, True, bandwidth_bytes_per_s=(
                float(bandwidth) if isinstance(bandwidth, (int, float)) and bandwidth > 0 else None), trusted=bool(row.get("trusted", True)),
                row_speed=_positive(row.get("row_speed")))
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return known


def _positive(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf") else None
