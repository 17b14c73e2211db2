"""Roofline compute emulation: a worker posing as a device with a compute rate and a memory bandwidth.

A real edge device running a small model is compute-bound at 8-16 rows (its arithmetic rate
is low), while the dev box is memory-bound (a batched decode step costs about the same for 1
or 16 rows). A plain slowdown factor (``slowdown.SlowdownPolicy``) scales the host's step
cost, so the emulated device inherits the host's "batches for free"; this policy instead
prices each call as the emulated device would take it:

    step = overhead + max(weight_bytes / bandwidth, rows * flops_per_row / flops)

where ``rows`` are the positions the call computes (decode rows, or prompt tokens of a
prefill) and ``flops_per_row = 2 * parameters`` of the stage, its parameters counted from its
weight bytes at ``bytes_per_parameter`` (the Q4_1 the bundled model ships: 20 bytes per 32
weights). The worker waits out the difference after its real compute; the emulation is
honest only while the real compute stays well below the step (benchmarks check busy shares).

Pure: the worker does the waiting. Everything here says "emulated" (``emulated``, ``label()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .slowdown import format_bytes, parse_bytes

Q4_1_BYTES_PER_PARAMETER = 20 / 32  # a Q4_1 block: 32 four-bit weights, an fp16 scale and an fp16 minimum


@dataclass(frozen=True)
class RooflinePolicy:
    """An emulated device: ``flops`` FLOP/s of arithmetic, ``bandwidth`` bytes/s of weight
    streaming, ``overhead_s`` per call (dispatch, synchronisation)."""

    flops: float  # FLOP/s the device sustains on the stage's matrix products
    bandwidth: float  # bytes/s it streams weights from memory
    overhead_s: float = 0.0
    bytes_per_parameter: float = Q4_1_BYTES_PER_PARAMETER

    emulated: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("flops", "bandwidth", "bytes_per_parameter"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"roofline {name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError(f"roofline overhead must be a finite number of seconds >= 0, got {self.overhead_s!r}")

    @classmethod
    def parse(cls, spec: str) -> "RooflinePolicy":
        """From ``"FLOPS,BANDWIDTH[,OVERHEAD_MS]"``, e.g. ``"20e9,8GB,2"`` (20 GFLOP/s, 8 GB/s, 2 ms);
        the bandwidth takes ``parse_bytes`` units (per second). Raises ``ValueError`` saying the form."""
        parts = [p.strip() for p in str(spec).split(",")]
        if len(parts) not in (2, 3):
            raise ValueError(f"roofline {spec!r}: expected 'FLOPS,BANDWIDTH[,OVERHEAD_MS]', e.g. '20e9,8GB,2'")
        try:
            flops = float(parts[0])
        except ValueError:
            raise ValueError(f"roofline {spec!r}: FLOPS {parts[0]!r} is not a number (e.g. 20e9)") from None
        bandwidth = parse_bytes(parts[1])
        try:
            overhead_ms = float(parts[2]) if len(parts) == 3 else 0.0
        except ValueError:
            raise ValueError(f"roofline {spec!r}: OVERHEAD_MS {parts[2]!r} is not a number") from None
        return cls(flops, float(bandwidth), overhead_ms / 1e3)

    def spec(self) -> str:
        """The form ``parse`` reads back."""
        return f"{self.flops:g},{int(self.bandwidth)},{self.overhead_s * 1e3:g}"

    def as_dict(self) -> dict:
        return {"flops": self.flops, "bandwidth": self.bandwidth, "overhead_s": self.overhead_s,
                "bytes_per_parameter": self.bytes_per_parameter}

    def flops_per_row(self, weight_bytes: int) -> float:
        """FLOPs one row (one position) costs on a stage of ``weight_bytes``: two per parameter."""
        return 2.0 * weight_bytes / self.bytes_per_parameter

    def step_s(self, weight_bytes: int, rows: int, head_bytes: int = 0, head_rows: int | None = None) -> float:
        """Seconds the emulated device takes for a call over ``rows`` positions of a stage of ``weight_bytes``.

        ``head_bytes`` (part of ``weight_bytes``): the head's, which computes ``head_rows`` positions
        (a sequence's last; None: every one of ``rows``), not all the positions the layers do."""
        if weight_bytes < 0 or rows < 0 or not 0 <= head_bytes <= weight_bytes or (head_rows is not None and head_rows < 0):
            raise ValueError(f"roofline step: weight bytes {weight_bytes}, head bytes {head_bytes}, rows {rows} "
                             f"and head rows {head_rows} must be >= 0 (head bytes at most the weight bytes)")
        flops = rows * self.flops_per_row(weight_bytes - head_bytes) + (rows if head_rows is None else head_rows) * self.flops_per_row(head_bytes)
        return self.overhead_s + max(weight_bytes / self.bandwidth, flops / self.flops)

    def knee_rows(self) -> float:
        """Rows at which a step turns from memory-bound to compute-bound (the same for every stage)."""
        return self.flops * self.bytes_per_parameter / (2.0 * self.bandwidth)

    def extra_wait(self, compute_s: float, weight_bytes: int, rows: int, head_bytes: int = 0, head_rows: int | None = None) -> float:
        """Seconds to wait after a call whose real compute took ``compute_s`` (0 if it already took longer)."""
        if compute_s < 0:
            raise ValueError(f"compute time must be >= 0, got {compute_s}")
        return max(0.0, self.step_s(weight_bytes, rows, head_bytes, head_rows) - compute_s)

    def label(self) -> str:
        return (f"emulated roofline {self.flops / 1e9:g} GFLOP/s, {format_bytes(int(self.bandwidth))}/s, "
                f"{self.overhead_s * 1e3:g} ms per call")
