"""What the coordinator measures, as events: each changes ``profiling.ClusterProfile`` through
its one ``apply`` and is kept in the coordinator's event log beside the state events, so what
the planner decided from can be rebuilt (``event_log.EventLog.replay``).

They are facts as measured (seconds, bytes, samples); turning them into speeds, medians and
link matrices is the profile's business."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class DeviceJoined:
    name: str
    now: float


@dataclass(frozen=True)
class DeviceLeft:
    worker_id: str
    name: str
    identity: tuple
    now: float
    failure: bool = True  # False: it said a final bye


@dataclass(frozen=True)
class Recalled:
    """A device seen before with the same declared hardware: its last calibration is reused."""

    worker_id: str
    identity: tuple


@dataclass(frozen=True)
class Calibrated:
    worker_id: str
    samples: tuple[tuple[float, float], ...]  # (unit cost, seconds) of timed ranges
    identity: tuple | None = None  # remembered under it (a reconnect with the same hardware is not timed again)
    rounds: int = 1  # timing rounds it took (the steadiest was kept: ``samples``)


@dataclass(frozen=True)
class Distrusted:
    """Its probe times were caught under-reporting: its own timings are not believed from now on.
    ``units``, ``reported_s``, ``measured_s``: the range probed, the step time it reported and the
    one measured (the dashboard's ``probe_overruled`` line)."""

    worker_id: str
    units: tuple[int, int] | None = None
    reported_s: float | None = None
    measured_s: float | None = None


@dataclass(frozen=True)
class RangeTimed:
    worker_id: str
    start: int
    end: int
    seconds: float


@dataclass(frozen=True)
class Uploaded:
    """``nbytes`` more took ``seconds`` more to arrive from it (two probe sizes)."""

    worker_id: str
    nbytes: int
    seconds: float
    round_trip: float | None = None


@dataclass(frozen=True)
class HeartbeatRtt:
    worker_id: str
    rtt_s: float


@dataclass(frozen=True)
class PeerLink:
    src: str
    dst: str
    rtt_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class StageStep:
    """A decode step's compute time on a stage, as its worker reported it."""

    worker_id: str
    start: int
    end: int
    compute_s: float
    batch: int = 1


@dataclass(frozen=True)
class RowsTimed:
    """Decode steps of one range timed at 1 row and at ``rows`` rows stepped together (medians):
    what each further row of a batched step costs on the device."""

    worker_id: str
    start: int
    end: int
    rows: int
    single_s: float
    batched_s: float


@dataclass(frozen=True)
class StepObserved:
    """A single-sequence decode step's wall time at the coordinator, with each stage's timing."""

    stages: tuple[tuple[str, int, int], ...]
    wall_s: float
    timings: tuple


Measurement = Union[DeviceJoined, DeviceLeft, Recalled, Calibrated, Distrusted, RangeTimed, Uploaded, HeartbeatRtt, PeerLink, StageStep,
                    StepObserved, RowsTimed]
