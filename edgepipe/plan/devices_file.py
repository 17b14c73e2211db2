"""Declared devices and links: a devices.yaml document (already loaded) -> profiles.

This module owns the schema of devices.yaml and its validation; reading the file is the
caller's job (`yaml.safe_load`), so this stays pure. Example: `examples/devices.yaml`.

Schema (every size may be an int of bytes or a string such as "8GiB", "512MB";
every bandwidth an int/float of bytes per second or a string such as "100Mbit/s",
"12.5MB/s"; every time a number of seconds in a `_s` key or of milliseconds in a `_ms` key)::

    defaults:                   # optional; applied to every device that omits the key
      power_busy_w: 15          # watts while computing (default 15, see profiles.py)
      power_idle_w: 3           # watts while idle (default 3)
      overhead_ms: 1.0
    devices:                    # required, non-empty list
      - id: laptop              # required, unique, not "coordinator"
        memory: 8GiB            # required: memory the worker may use
        speed: 1.0              # required: cost units per second (1.0 = reference device)
        overhead_ms: 2.0        # per-call session overhead (or overhead_s); default 0
        power_busy_w: 28
        power_idle_w: 4
        held_units: [0, 1, 2]   # unit files it already caches (indices < the model's units)
        relay: false            # true for workers that cannot accept connections (browsers)
        emulated: false         # true when the slowness is injected by the emulator
        prefill_speed: 6.0      # cost units/s on prompt tokens (default: 6 x speed, see profiles.py)
        precision: fp32         # weight variant it runs (browsers: fp32); default: the package's
        activation_dtype: float16   # what it sends on the wire (default float32)
        kind: gpu               # where it computes: cpu (default) or gpu (memory: the GPU's)
        adapter: NVIDIA RTX 4060  # the GPU, for reports
    network:                    # optional
      default: {rtt_ms: 2, bandwidth: 100Mbit/s}   # pairs not listed below
      links:                    # one direction; the reverse is assumed equal unless listed
        - {src: laptop, dst: coordinator, rtt_ms: 1.5, bandwidth: 1Gbit/s}

Unknown keys are errors (a typo must not silently fall back to a default); booleans must be
YAML booleans (`relay: "false"` is refused, not read as true); idle power may not exceed busy
power. `load_devices` parses the text and names `file:line` in every error, with a hint.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .profiles import (
    COORDINATOR,
    DEFAULT_LINK,
    DEFAULT_POWER_BUSY_W,
    DEFAULT_POWER_IDLE_W,
    DeviceProfile,
    LinkProfile,
    NetworkProfile,
)

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_RATE_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*$")

_DEVICE_KEYS = {
    "id", "memory", "speed", "overhead_s", "overhead_ms", "power_busy_w", "power_idle_w",
    "held_units", "relay", "emulated", "prefill_speed", "precision", "activation_dtype", "kind", "adapter",
}
_PRECISIONS = ("int4", "int8", "fp32", "native")
_DTYPES = ("float32", "float16")
_DEFAULT_KEYS = _DEVICE_KEYS - {"id", "memory", "held_units"}
_LINK_KEYS = {"src", "dst", "rtt_s", "rtt_ms", "bandwidth"}


@dataclass(frozen=True)
class DevicesFile:
    """The parsed document: devices sorted by id, and the network."""

    devices: tuple[DeviceProfile, ...]
    network: NetworkProfile


class DevicesFileError(ValueError):
    """A devices.yaml problem; the message names the entry and the field.

    `path` locates the offending node in the document (keys and list positions), so that
    `load_devices` can name its line."""

    def __init__(self, message: str, path: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.path = path


Where = tuple[str | int, ...]
"""Location in the document: keys and list positions, e.g. ("devices", 2, "relay")."""


def _label(path: Where) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or "devices.yaml"


def _fail(path: Where, message: str, hint: str = "") -> DevicesFileError:
    return DevicesFileError(f"{_label(path)}: {message}" + (f" (hint: {hint})" if hint else ""), path)


def parse_size(value: Any, where: str | Where) -> int:
    """Bytes from an int or a string like "8GiB" / "512 MB"."""
    path = (where,) if isinstance(where, str) else where
    if isinstance(value, bool):
        raise _fail(path, f"expected a size, got {value!r}", "e.g. 8GiB")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _NUMBER.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise _fail(path, f"cannot read size {value!r}", "e.g. 8GiB, 512MB, 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_rate(value: Any, where: str | Where) -> float:
    """Bytes per second from a number or a string like "100Mbit/s" / "12.5MB/s"."""
    path = (where,) if isinstance(where, str) else where
    if isinstance(value, bool):
        raise _fail(path, f"expected a bandwidth, got {value!r}", "e.g. 100Mbit/s")
    if isinstance(value, (int, float)):
        if not value > 0:
            raise _fail(path, f"bandwidth {value!r} must be > 0")
        return float(value)
    match = _NUMBER.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _RATE_UNITS:
        raise _fail(path, f"cannot read bandwidth {value!r}", "e.g. 100Mbit/s, 12.5MB/s")
    rate = float(match.group(1)) * _RATE_UNITS[unit]
    if not rate > 0:
        raise _fail(path, f"bandwidth {value!r} must be > 0")
    return rate


def _number(value: Any, path: Where, minimum: float = 0.0, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = "write the number without quotes" if isinstance(value, str) else ""
        raise _fail(path, f"expected a number, got {value!r}", hint)
    number = float(value)
    if not math.isfinite(number) or number < minimum or (strict and number == minimum):
        raise _fail(path, f"{value!r} must be {'>' if strict else '>='} {minimum:g}")
    return number


def _boolean(value: Any, path: Where) -> bool:
    if not isinstance(value, bool):
        hint = f"write {str(value).lower()} without quotes" if str(value).lower() in ("true", "false") else ""
        raise _fail(path, f"expected true or false, got {value!r}", hint or "true or false")
    return value


def _choice(value: Any, path: Where, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _fail(path, f"{value!r} is not one of {', '.join(choices)}")
    return value


def _seconds(entry: Mapping[str, Any], stem: str, path: Where, default: float | None) -> float | None:
    if f"{stem}_s" in entry and f"{stem}_ms" in entry:
        raise _fail(path, f"give {stem}_s or {stem}_ms, not both")
    if f"{stem}_s" in entry:
        return _number(entry[f"{stem}_s"], (*path, f"{stem}_s"))
    if f"{stem}_ms" in entry:
        return _number(entry[f"{stem}_ms"], (*path, f"{stem}_ms")) / 1e3
    return default


def _check_keys(entry: Any, allowed: set[str], path: Where) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping):
        raise _fail(path, f"expected a mapping, got {type(entry).__name__}")
    unknown = sorted((str(k) for k in set(entry) - allowed))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(allowed))}"
        raise _fail((*path, unknown[0]), f"unknown key(s) {', '.join(unknown)}", hint)
    return entry


def _link(entry: Any, path: Where, default: bool = False) -> LinkProfile:
    keys = _LINK_KEYS - {"src", "dst"} if default else _LINK_KEYS
    entry = _check_keys(entry, keys, path)
    if "bandwidth" not in entry:
        raise _fail(path, "bandwidth is required", "e.g. bandwidth: 100Mbit/s")
    rtt = _seconds(entry, "rtt", path, None)
    if rtt is None:
        raise _fail(path, "rtt_s or rtt_ms is required", "e.g. rtt_ms: 2")
    src = "*" if default else entry.get("src")
    dst = "*" if default else entry.get("dst")
    for name, end in (("src", src), ("dst", dst)):
        if not isinstance(end, str) or not end:
            raise _fail(path, f"{name} must be a device id or 'coordinator'")
    try:
        return LinkProfile(src, dst, rtt, parse_rate(entry["bandwidth"], (*path, "bandwidth")))
    except DevicesFileError:
        raise
    except ValueError as error:
        raise _fail(path, str(error)) from None


def _held(value: Any, path: Where, units: int | None) -> frozenset[int]:
    if not isinstance(value, list) or not all(isinstance(u, int) and not isinstance(u, bool) for u in value):
        raise _fail(path, "held_units must be a list of unit indices", "e.g. held_units: [0, 1, 2]")
    for position, unit in enumerate(value):
        if unit < 0 or (units is not None and unit >= units):
            bound = f"0..{units - 1}" if units is not None else ">= 0"
            raise _fail((*path, position), f"unit {unit} is out of range {bound}")
    return frozenset(value)


def parse_devices(data: Mapping[str, Any], units: int | None = None) -> DevicesFile:
    """Validate a loaded devices.yaml document and build the profiles (schema above).

    `units`, when given, is the model's unit count: `held_units` must lie below it."""
    data = _check_keys(data, {"defaults", "devices", "network"}, ())
    defaults = dict(_check_keys(data.get("defaults") or {}, _DEFAULT_KEYS, ("defaults",)))
    entries = data.get("devices")
    if not isinstance(entries, list) or not entries:
        raise _fail(("devices",), "'devices' must be a non-empty list", "devices:\n  - id: laptop ...")
    devices: dict[str, DeviceProfile] = {}
    for position, raw in enumerate(entries):
        path: Where = ("devices", position)
        raw = _check_keys(raw, _DEVICE_KEYS, path)

        def at(key: str) -> Where:
            # A value the device does not give comes from `defaults`: point there.
            return (*path, key) if key in raw else ("defaults", key)

        entry = {**defaults, **raw}
        device_id = entry.get("id")
        if not isinstance(device_id, str) or not device_id:
            raise _fail((*path, "id"), "'id' must be a non-empty string")
        if device_id == COORDINATOR:
            raise _fail((*path, "id"), f"{COORDINATOR!r} is reserved for the coordinator")
        if device_id in devices:
            raise _fail((*path, "id"), f"device {device_id!r} is listed twice")
        for required in ("memory", "speed"):
            if required not in entry:
                raise _fail(path, f"device {device_id!r}: '{required}' is required")
        try:
            busy = _number(entry.get("power_busy_w", DEFAULT_POWER_BUSY_W), at("power_busy_w"))
            idle = _number(entry.get("power_idle_w", DEFAULT_POWER_IDLE_W), at("power_idle_w"))
        except DevicesFileError as error:
            raise DevicesFileError(f"device {device_id!r}: {error}", error.path) from None
        if idle > busy:
            error = _fail(
                at("power_idle_w"),
                f"idle power {idle:g} W exceeds busy power {busy:g} W",
                "idle power is what the device draws when not computing; it cannot exceed busy power",
            )
            raise DevicesFileError(f"device {device_id!r}: {error}", error.path)
        prefill = entry.get("prefill_speed")
        try:
            devices[device_id] = DeviceProfile(
                id=device_id,
                memory_bytes=parse_size(entry["memory"], at("memory")),
                speed=_number(entry["speed"], at("speed"), strict=True),
                overhead_s=_seconds(entry, "overhead", path, 0.0) or 0.0,
                power_busy_w=busy,
                power_idle_w=idle,
                held_units=_held(entry.get("held_units", []), at("held_units"), units),
                relay=_boolean(entry.get("relay", False), at("relay")),
                emulated=_boolean(entry.get("emulated", False), at("emulated")),
                prefill_speed=None if prefill is None else _number(prefill, at("prefill_speed"), strict=True),
                precision=None if entry.get("precision") is None
                else _choice(entry["precision"], at("precision"), _PRECISIONS),
                activation_dtype=_choice(entry.get("activation_dtype", "float32"), at("activation_dtype"), _DTYPES),
                kind=_choice(entry.get("kind", "cpu"), at("kind"), ("cpu", "gpu")),
                adapter=None if entry.get("adapter") is None else str(entry["adapter"]),
            )
        except DevicesFileError as error:
            raise DevicesFileError(f"device {device_id!r}: {error}", error.path) from None
        except ValueError as error:
            raise _fail(path, str(error)) from None

    network_entry = _check_keys(data.get("network") or {}, {"default", "links"}, ("network",))
    default = DEFAULT_LINK
    if "default" in network_entry:
        default = _link(network_entry["default"], ("network", "default"), default=True)
    links_raw = network_entry.get("links") or []
    if not isinstance(links_raw, list):
        raise _fail(("network", "links"), "network.links must be a list")
    links = []
    known = set(devices) | {COORDINATOR}
    for position, raw in enumerate(links_raw):
        path = ("network", "links", position)
        link = _link(raw, path)
        for key, end in (("src", link.src), ("dst", link.dst)):
            if end not in known:
                close = difflib.get_close_matches(end, sorted(known), n=1)
                raise _fail((*path, key), f"unknown node {end!r}", f"did you mean {close[0]!r}?" if close else "")
        links.append(link)
    try:
        network = NetworkProfile(tuple(links), default)
    except ValueError as error:
        raise _fail(("network", "links"), str(error)) from None
    return DevicesFile(tuple(devices[d] for d in sorted(devices)), network)


def _line_of(root: Any, path: Where) -> int | None:
    """1-based line of the deepest node along `path` in a composed YAML tree."""
    import yaml

    node, line = root, None
    if node is not None:
        line = node.start_mark.line + 1
    for part in path:
        child = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == part:
                    child = value
                    line = key.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
        if not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            line = node.start_mark.line + 1
    return line


def load_devices(text: str, filename: str = "devices.yaml", units: int | None = None) -> DevicesFile:
    """Parse devices.yaml text; every error reads `file:line: where: what (hint: ...)`."""
    import yaml

    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{filename}:{mark.line + 1}" if mark is not None else filename
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise DevicesFileError(f"{where}: not valid YAML: {problem}") from None
    if data is None:
        raise DevicesFileError(f"{filename}:1: the file is empty (hint: see examples/devices.yaml)")
    try:
        return parse_devices(data, units)
    except DevicesFileError as error:
        line = _line_of(root, error.path)
        where = f"{filename}:{line}" if line is not None else filename
        raise DevicesFileError(f"{where}: {error}", error.path) from None
