"""The event log in words: one line a person reads for each coordinator event.

``describe(event)`` says what changed, why, and the numbers that matter, rounded: times in ms or
s, sizes in MB/GB, ratios to three figures. Known kinds get a sentence of their own; any other
kind is written as its name and its fields flattened (never JSON: no braces, no quoted keys), so
a new event is readable on the dashboard before anyone writes its sentence. Pure: the events
route adds the line to each event it serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

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


SENTENCES: dict[str, Callable[[Mapping[str, object]], str]] = {
    "join": lambda f: f"{f['worker']} joined" + (f" ({value(f.get('memory_bytes'), 'memory_bytes')})" if f.get("memory_bytes") else ""),
    "leave": lambda f: f"{f['worker']} left" + _why(f),
    "state": lambda f: f"cluster {f['state']}" + _why(f),
    "prepare": lambda f: f"preparing plan {f['plan']}: {value(f.get('stages'))}" + _why(f),
    "up": lambda f: f"plan {f['plan']} serving" + (f": {_predicted(f.get('predicted'))}" if _predicted(f.get("predicted")) else "")
                    + (f" ({value(f.get('reason'))})" if f.get("reason") else ""),
    "calibrated": lambda f: f"{f['worker']} calibrated" + (" (recalled)" if f.get("reused") else "") + ": " + _pairs(f, ("worker", "reused")),
    "recovered": lambda f: "recovered" + (f" request {f['request']}" if f.get("request") else "") + ": " + _pairs(f, ("request",)),
    "quarantine": lambda f: f"{f['worker']} quarantined" + (f" for {seconds(float(f['for_s']))}" if f.get("for_s") is not None else "") + _why(f),
    "suspect": lambda f: f"{f['worker']} suspected" + _why(f),
    "plan_failed": lambda f: "a plan failed to deploy" + _why(f),
    "link_measured": lambda f: f"link {f['src']} to {f['dst']} measured: rtt {value(f.get('rtt_ms'), 'rtt_ms')}, "
                               f"{value(f.get('mb_s'), 'mb_s')}",
    "spare": lambda f: f"spare plan ready: {value(f.get('stages'))}",
    "prefix_dropped": lambda f: f"prefix cache dropped ({number(f['blocks'])} blocks)" + _why(f),
}
