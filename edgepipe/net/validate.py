"""What a worker says is checked before it is believed: pure validation of worker frames.

Each function takes the decoded fields of one frame (plus what the plan says should be
true) and returns typed, checked values, or raises :class:`InvalidWorkerFrame` with one line
that names the field and the value. Nothing here does I/O; the coordinator and the worker
call these where frames arrive. numpy only (workers use this too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_STEP_SECONDS = 3600.0  # a stage time beyond an hour is not a measurement
ELEM_BYTES = (2, 4)  # float16 or float32 activations on the wire


class InvalidWorkerFrame(ValueError):
    """A frame from a worker that breaks the protocol or the plan; the worker is at fault."""


@dataclass(frozen=True)
class StageTiming:
    """One stage's report in a frame's ``timings``: who ran it, for how long, on what."""

    worker: str
    compute_s: float
    positions: int  # tokens per sequence in this step (prompt length for a prefill, 1 to decode)
    elem_bytes: int  # bytes per activation element it sent on (2 or 4)
    batch: int  # sequences in the frame


@dataclass(frozen=True)
class TokenReply:
    """One sampled token for one pending step."""

    seq: str
    step: int
    token: int


def _int(value, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidWorkerFrame(f"{name} must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value >= hi):
        raise InvalidWorkerFrame(f"{name} {int(value)} is outside [{lo}, {hi if hi is not None else '∞'})")
    return int(value)


def _seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidWorkerFrame(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > MAX_STEP_SECONDS:
        raise InvalidWorkerFrame(f"{name} {value!r} is not a time in [0, {MAX_STEP_SECONDS:.0f}] s")
    return value


def timings(raw, plan_workers: tuple[str, ...] | None = None) -> tuple[StageTiming, ...]:
    """``[[worker_id, compute_s, positions, elem_bytes, batch], ...]`` checked entry by entry.

    With ``plan_workers`` (the plan's stages in order), there is one entry per stage, in order,
    each naming that stage's worker: a worker cannot report times for another."""
    if not isinstance(raw, (list, tuple)):
        raise InvalidWorkerFrame(f"timings must be a list, got {type(raw).__name__}")
    if len(raw) > 1024:
        raise InvalidWorkerFrame(f"timings has {len(raw)} entries")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, (list, tuple)) or len(entry) != 5:
            raise InvalidWorkerFrame(f"timings[{i}] must be [worker, seconds, positions, bytes/elem, batch]")
        worker, seconds, positions, elem, batch = entry
        if not isinstance(worker, str) or not worker or len(worker) > 64:
            raise InvalidWorkerFrame(f"timings[{i}] worker must be a short string")
        out.append(StageTiming(worker, _seconds(seconds, f"timings[{i}] seconds"), _int(positions, f"timings[{i}] positions", 1),
                               _int(elem, f"timings[{i}] bytes/elem", 2, 5), _int(batch, f"timings[{i}] batch", 1)))
        if out[-1].elem_bytes not in ELEM_BYTES:
            raise InvalidWorkerFrame(f"timings[{i}] bytes/elem {out[-1].elem_bytes} is not 2 or 4")
    if plan_workers is not None:
        names = tuple(t.worker for t in out)
        if names != tuple(plan_workers):
            raise InvalidWorkerFrame(f"timings name stages {list(names)[:8]}, the plan has {list(plan_workers)[:8]}")
    return tuple(out)


def token_frame(fields: dict, *, sender: str, last_stage: str, plan_id: int, vocab_size: int) -> list[TokenReply]:
    """A TOKEN frame: only the plan's last stage may send it, for that plan, one token per
    batch item, each id in ``[0, vocab_size)``."""
    if sender != last_stage:
        raise InvalidWorkerFrame(f"token frame from {sender}, but the last stage of plan {plan_id} is {last_stage}")
    if fields.get("plan") != plan_id:
        raise InvalidWorkerFrame(f"token frame for plan {fields.get('plan')!r}, expected {plan_id}")
    batch, tokens = fields.get("batch"), fields.get("tokens")
    if not isinstance(batch, list) or not isinstance(tokens, list) or not batch or len(batch) != len(tokens):
        raise InvalidWorkerFrame("token frame needs equally long non-empty 'batch' and 'tokens' lists")
    out = []
    for i, (item, token) in enumerate(zip(batch, tokens)):
        if not isinstance(item, dict) or not isinstance(item.get("seq"), str):
            raise InvalidWorkerFrame(f"batch[{i}] has no sequence id")
        out.append(TokenReply(item["seq"], _int(item.get("step"), f"batch[{i}] step", 0), _int(token, f"tokens[{i}]", 0, vocab_size)))
    return out


def relay_frame(fields: dict, *, sender: str, stages: tuple[str, ...], plan_id: int) -> str:
    """A FORWARD a worker asks the coordinator to relay (browser neighbours): only for this plan,
    only from a stage to the stage right after it. Returns the worker to relay to."""
    if fields.get("plan") != plan_id:
        raise InvalidWorkerFrame(f"relay for plan {fields.get('plan')!r}, expected {plan_id}")
    target = fields.get("relay_to")
    pairs = set(zip(stages, stages[1:]))
    if (sender, target) not in pairs:
        raise InvalidWorkerFrame(f"{sender} may not relay to {str(target)[:64]!r} in plan {plan_id}")
    return target


def probe_times(raw, reps: int) -> tuple[float, ...]:
    """A PROBED frame's ``times``: ``reps`` finite, positive seconds (calibration input)."""
    if not isinstance(raw, (list, tuple)) or len(raw) != reps:
        raise InvalidWorkerFrame(f"probe times must be a list of {reps} numbers")
    out = tuple(_seconds(t, f"probe times[{i}]") for i, t in enumerate(raw))
    if any(t <= 0 for t in out):
        raise InvalidWorkerFrame("probe times must be positive")
    return out


def pong_stats(fields: dict) -> dict[str, float | int | None]:
    """A PONG's load figures, each a finite non-negative number or absent (None)."""
    out = {}
    for key in ("kv_bytes", "queue", "busy_s", "computed"):
        value = fields.get(key)
        if value is None:
            out[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise InvalidWorkerFrame(f"pong {key} {value!r} is not a finite non-negative number")
        out[key] = value
    return out


def activation_problem(x: np.ndarray, hidden: int | None = None, max_positions: int | None = None) -> str | None:
    """Why an activation tensor arriving at a stage cannot be used, or None if it can.

    Shape ``[batch, positions, hidden]``, float16/float32, every element finite."""
    if x.dtype not in (np.float32, np.float16):
        return f"activations are {x.dtype}, expected float32 or float16"
    if x.ndim != 3 or x.shape[0] < 1 or x.shape[1] < 1:
        return f"activations have shape {list(x.shape)}, expected [batch, positions, hidden]"
    if hidden is not None and x.shape[2] != hidden:
        return f"activations have hidden size {x.shape[2]}, this stage takes {hidden}"
    if max_positions is not None and x.shape[1] > max_positions:
        return f"activations cover {x.shape[1]} positions, the context is {max_positions}"
    if not np.isfinite(x).all():
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        return f"non-finite activations: {bad} of {x.size} values are NaN or infinite"
    return None


def prefix_entry(item: dict) -> dict | None:
    """A FORWARD item's ``prefix`` entry (``cluster.prefix``), checked (None: it has none); ``ValueError`` in one line."""
    entry = item.get("prefix")
    if entry is None:
        return None

    def names(v) -> bool:
        return isinstance(v, list) and all(isinstance(n, str) and 0 < len(n) <= 64 for n in v)

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not (isinstance(entry, dict) and count(entry.get("epoch")) and count(entry.get("block")) and entry["block"] > 0
            and names(entry.get("reuse", [])) and names(entry.get("evict", []))
            and isinstance(entry.get("save", []), list)
            and all(isinstance(s, list) and len(s) == 2 and count(s[0]) and names(s[1:]) for s in entry.get("save", []))):
        raise ValueError("prefix entry must be {epoch, block > 0, reuse: [names], save: [[index, name]], evict: [names]}")
    return entry
