"""The event log in words: the dashboard's entry for each logged event, and its line.

``entry(event, state, profile, wall)`` is the dashboard's record of one logged event (a state
event, a measurement or a ``Noted`` line): its kind and fields, read from the event and the
state and profile right after it, or None where the event gets no line (heartbeats, steps). It
is the only way the dashboard gets a line, so the lines are a function of the event log and a
replayed log gives the same lines.

``describe(event)`` says what changed, why, and the numbers that matter, rounded: times in ms or
s, sizes in MB/GB, ratios to three figures. Known kinds get a sentence of their own; any other
kind is written as its name and its fields flattened (never JSON: no braces, no quoted keys), so
a new event is readable on the dashboard before anyone writes its sentence. Pure: the events
route adds the line to each event it serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ...net.limits import json_safe
from ..state import checkpoints as K, events as E, measurements as M
from ..state.prefix_book import PrefixDone

Event = Mapping[str, object]


def describe(event: Event) -> str:
    kind = str(event.get("kind", "event"))
    fields = {k: v for k, v in event.items() if k not in ("t", "kind")}
    sentence = SENTENCES.get(kind)
    if sentence is not None:
        try:
            return sentence(fields)
        except (KeyError, TypeError, ValueError):
            pass  # an event without the fields its sentence reads: the generic line below
    return _generic(kind.replace("_", " "), fields)


def value(v: object, key: str = "") -> str:
    """One field's value in words: rounded numbers, seconds as ms or s, bytes as MB / GB, lists
    comma-separated, mappings as ``name value`` pairs."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        if key == "mb_s" or key.endswith("_mb_s"):
            return f"{number(v)} MB/s"
        if key.endswith("bytes_per_s"):
            return size(float(v)) + "/s"
        if key.endswith("_ms"):
            return f"{number(v)} ms"
        if key.endswith("_s") or key in ("tpot", "ttft"):
            return seconds(float(v))
        if key.endswith("bytes") or key.endswith("_b"):
            return size(float(v))
        return number(v)
    if isinstance(v, Mapping):
        return ", ".join(f"{label(k)} {value(x, k)}" for k, x in v.items() if x is not None)
    if isinstance(v, (list, tuple)):
        if len(v) == 3 and isinstance(v[0], str) and all(isinstance(x, int) for x in v[1:]):
            return f"{v[0]} [{v[1]}, {v[2]})"  # a stage: worker, first unit, one past the last
        return ", ".join(value(x, key) for x in v) if v else "none"
    return str(v)


def number(v: int | float) -> str:
    if isinstance(v, int) or (math.isfinite(v) and v == int(v) and abs(v) < 1e15):
        return str(int(v))
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def seconds(s: float) -> str:
    if not math.isfinite(s):
        return str(s)
    return f"{s * 1e3:.3g} ms" if abs(s) < 1 else f"{s:.3g} s"


def size(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB" if b >= 1e6 else f"{b / 1e3:.3g} kB"


def label(key: str) -> str:
    """A field's name in words: its unit suffix goes (the value carries the unit)."""
    for suffix in ("_bytes_per_s", "_mb_s", "_bytes", "_ms", "_s", "_b"):
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")


def _pairs(fields: Mapping[str, object], skip: tuple[str, ...] = ()) -> str:
    return "; ".join(f"{label(k)} {value(v, k)}" for k, v in fields.items() if k not in skip and v is not None)


def _generic(name: str, fields: Mapping[str, object]) -> str:
    parts = [_pairs(fields)] if _pairs(fields) else []
    return name + (": " + "; ".join(parts) if parts else "")


def _why(f: Mapping[str, object]) -> str:
    reason = f.get("reason") or f.get("why") or f.get("error")
    return f" ({value(reason)})" if reason else ""


def _predicted(p: object) -> str:
    if not isinstance(p, Mapping):
        return ""
    out = []
    if p.get("tpot_s") is not None:
        out.append(f"{seconds(float(p['tpot_s']))}/token predicted")
    if p.get("objective"):
        out.append(f"objective {p['objective']}")
    return ", ".join(out)


def _variant(f: Mapping) -> str:
    """A weight variant's build (``cluster.variants``): what, for which units and worker, and how it went."""
    from ..rules.variant_rules import _span

    units = f.get("units")
    where = (f" of {_span(units)}" if isinstance(units, list) and units else "") + (f" for {f['worker']}" if f.get("worker") else "")
    size = f" (~{value(f['estimated_bytes'], 'estimated_bytes')})" if f.get("estimated_bytes") else ""
    took = f" in {seconds(float(f['seconds']))}" if f.get("seconds") is not None else ""
    reason = f": {f['reason']}" if f.get("reason") else ""
    return f"{f.get('precision')} variant{where} {f.get('status')}{size}{took}{reason}"


SENTENCES: dict[str, Callable[[Mapping[str, object]], str]] = {
    "join": lambda f: f"{f['worker']} joined" + (f" ({value(m, 'memory_bytes')})" if (m := f.get("memory_bytes") or f.get("memory")) else ""),
    "leave": lambda f: f"{f['worker']} left" + _why(f),
    "draft_site": lambda f: f"drafts now made on {'the coordinator' if f['site'] == 'coordinator' else f['site']}" + _why(f),
    "drafter": lambda f: f"drafter {f['worker']} {f['status']}: " + _pairs(f, ("worker", "status")),
    "state": lambda f: f"cluster {f['state']}" + _why(f),
    "prepare": lambda f: f"preparing plan {f['plan']}: {value(f.get('stages'))}" + _why(f),
    "up": lambda f: f"plan {f['plan']} serving" + (f": {_predicted(f.get('predicted'))}" if _predicted(f.get("predicted")) else "")
                    + (f" ({value(f.get('reason'))})" if f.get("reason") else ""),
    "calibrated": lambda f: f"{f['worker']} calibrated" + (" (recalled)" if f.get("reused") else "") + ": " + _pairs(f, ("worker", "reused")),
    "recovered": lambda f: "recovered" + (f" request {f['request']}" if f.get("request") else "") + ": " + _pairs(f, ("request",)),
    "quarantine": lambda f: f"{f['worker']} quarantined" + (f" for {seconds(float(f['for_s']))}" if f.get("for_s") is not None else "") + _why(f),
    "suspect": lambda f: f"{f['worker']} suspected" + _why(f),
    "plan_failed": lambda f: "a plan failed to deploy" + _why(f),
    "variant": lambda f: _variant(f),
    "link_measured": lambda f: f"link {f['src']} to {f['dst']} measured: rtt {value(f.get('rtt_ms'), 'rtt_ms')}, "
                               f"{value(f.get('mb_s'), 'mb_s')}",
    "spare": lambda f: f"spare plan ready: {value(f.get('stages'))}",
    "plan_kept": lambda f: str(f["why"]),
    "prefix_dropped": lambda f: f"prefix cache dropped ({number(f['blocks'])} blocks)" + _why(f),
}


def entry(event, state, profile, wall: float) -> dict | None:
    """The dashboard's record of a logged event (``{"t", "kind", ...fields}``), None for no line."""
    if type(event) in SILENT:  # a token's events: no line (asked first, they skip the match below)
        return None
    fields = _fields(event, state, profile)
    return None if fields is None else json_safe({"t": wall, **fields})


def _silent() -> frozenset[type]:
    from ..state import step_book as SB

    return frozenset({SB.StepSent, SB.StepEnded, SB.LaneAsked, SB.LaneReturned, SB.LaneLeft, SB.LaneExpired, SB.DirectFed,
                      SB.DirectHeard, SB.DirectEnded, E.StepPlanned, E.Heard, E.Ponged, M.StageStep, M.StepObserved, M.HeartbeatRtt})


SILENT = _silent()  # the events of every step and heartbeat: ``_fields`` has no case for them (a test checks it)


def _calibrated(worker_id: str, profile) -> dict | None:
    m = profile.devices.get(worker_id)
    if m is None:
        return None
    return {"kind": "calibrated", "worker": worker_id, "speed": round(m.speed, 3), "overhead_ms": round(m.overhead_s * 1e3, 3),
            "uplink_mb_s": round((m.bandwidth_bytes_per_s or 0) / 1e6, 3)}


def _fields(event, state, profile) -> dict | None:
    from .calibration import spread

    match event:
        case E.Noted(kind, fields, _):
            return {"kind": kind.value, **fields}
        case PrefixDone(_, False) if state.prefix.last_drop:
            blocks, why = state.prefix.last_drop
            return {"kind": "prefix_dropped", "blocks": blocks, "why": why}
        case E.RequestPaused(rid, step, why, now) if (q := state.requests.get(rid)) is not None and q.paused == (now, step):
            return {"kind": "pause", "request": rid, "step": step, "why": why}
        case E.RequestFed(rid, _, plan, _, now) if now is not None and (q := state.requests.get(rid)) is not None and q.recovered:
            since, step = q.recovered
            return {"kind": "recovered", "request": rid, "step": step, "seconds": round(now - since, 3), "plan": plan}
        case E.Committed(dep, _, timings) if timings is not None:
            return {"kind": "up", "plan": dep.plan_id, "prepare_s": timings.prepare_s, "paused_s": timings.paused_s,
                    "fetched_bytes": timings.fetched_bytes, "predicted": dep.predicted, "replaced": timings.replaced, **timings.moved}
        case E.WorkerJoined(wid, _, hello, _):
            return {"kind": "join", "worker": wid, "memory": hello.memory_bytes, "memory_budget": hello.memory_budget,
                    "emulation": hello.declared_emulation, "device_kind": hello.kind}
        case E.WorkerLost(wid, why, _):
            return {"kind": "leave", "worker": wid, "why": why}
        case E.Suspected(wid, now) if wid in state.workers:
            return {"kind": "suspect", "worker": wid, "silent_s": round(now - state.workers[wid].last_seen, 2)}
        case E.Misbehaved(wid, why, now) if wid in state.workers:
            q = state.quarantine.get(state.workers[wid].identity)
            return {"kind": "quarantine", "worker": wid, "why": why, "seconds": round(q.until - now, 1), "strikes": q.strikes}
        case E.PlanAbandoned(plan, why, _):
            return {"kind": "abandon", "plan": plan, "why": why}
        case E.EmulationChanged(wid, slowdown):
            return {"kind": "emulation", "worker": wid, "slowdown": float(slowdown)}
        case E.Preparing(dep, _):
            return {"kind": "prepare", "plan": dep.plan_id, "stages": [[s.worker_id, s.start, s.end] for s in dep.stages], "reason": dep.reason}
        case E.PlanFailed(why, True):
            return {"kind": "plan_failed", "error": why}
        case M.PeerLink(src, dst, rtt, bandwidth):
            return {"kind": "link_measured", "src": src, "dst": dst, "rtt_ms": round(rtt * 1e3, 3), "mb_s": round(bandwidth / 1e6, 4)}
        case E.SpareLoaded(plan, _, wid, _, error) if error is not None:
            return {"kind": "spare_unbuilt", "worker": wid, "plan": plan, "error": error}
        case E.SpareLoaded(_, stages, _, True, _) if stages == state.spare and {s.worker_id for s in stages} <= state.spare_built:
            # ready once every stage's session is built (the last answer), not when it is chosen
            return {"kind": "spare", "stages": [[s.worker_id, s.start, s.end] for s in stages]}
        case K.CheckpointStored(rid, _, _, needs, wid, position, nbytes) if needs and wid == max(needs) and _whole(state, rid, position):
            return {"kind": "checkpoint", "request": rid, "position": position, "bytes": nbytes}
        case M.Distrusted(wid, (start, end), reported, measured):
            return {"kind": "probe_overruled", "worker": wid, "units": [start, end], "reported_ms": round(reported * 1e3, 3),
                    "measured_ms": round(measured * 1e3, 3)}
        case M.Recalled(wid, _) if profile is not None and (line := _calibrated(wid, profile)):
            return {**line, "reused": True}
        case M.Calibrated(wid, samples, _, rounds) if profile is not None and (line := _calibrated(wid, profile)):
            return {**line, "rounds": rounds, "spread": round(spread(list(samples)), 3)}
    return None


def _whole(state, rid: str, position: int) -> bool:
    """Every holder of ``rid``'s checkpoint holds ``position`` (the round's last acknowledgement)."""
    ck = state.checkpoints.get(rid)
    return ck is not None and ck.position() == position
