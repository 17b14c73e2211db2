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
        held_units: [0, 1, 2]   # unit files it already caches
        relay: false            # true for workers that cannot accept connections (browsers)
        emulated: false         # true when the slowness is injected by the emulator
    network:                    # optional
      default: {rtt_ms: 2, bandwidth: 100Mbit/s}   # pairs not listed below
      links:                    # one direction; the reverse is assumed equal unless listed
        - {src: laptop, dst: coordinator, rtt_ms: 1.5, bandwidth: 1Gbit/s}

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .profiles import (
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
    "held_units", "relay", "emulated",
}
_DEFAULT_KEYS = _DEVICE_KEYS - {"id", "memory", "held_units"}
_LINK_KEYS = {"src", "dst", "rtt_s", "rtt_ms", "bandwidth"}


@dataclass(frozen=True)
class DevicesFile:
    """The parsed document: devices sorted by id, and the network."""

    devices: tuple[DeviceProfile, ...]
    network: NetworkProfile


class DevicesFileError(ValueError):
    """A devices.yaml problem; the message names the entry and the field."""


def parse_size(value: Any, where: str) -> int:
    """Bytes from an int or a string like "8GiB" / "512 MB"."""
    if isinstance(value, bool):
        raise DevicesFileError(f"{where}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _NUMBER.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise DevicesFileError(f"{where}: cannot read size {value!r} (e.g. 8GiB, 512MB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_rate(value: Any, where: str) -> float:
    """Bytes per second from a number or a string like "100Mbit/s" / "12.5MB/s"."""
    if isinstance(value, bool):
        raise DevicesFileError(f"{where}: expected a bandwidth, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    match = _NUMBER.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _RATE_UNITS:
        raise DevicesFileError(f"{where}: cannot read bandwidth {value!r} (e.g. 100Mbit/s, 12.5MB/s)")
    return float(match.group(1)) * _RATE_UNITS[unit]


def _seconds(entry: Mapping[str, Any], stem: str, where: str, default: float | None) -> float | None:
    if f"{stem}_s" in entry and f"{stem}_ms" in entry:
        raise DevicesFileError(f"{where}: give {stem}_s or {stem}_ms, not both")
    if f"{stem}_s" in entry:
        return _number(entry[f"{stem}_s"], f"{where}.{stem}_s")
    if f"{stem}_ms" in entry:
        return _number(entry[f"{stem}_ms"], f"{where}.{stem}_ms") / 1e3
    return default


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DevicesFileError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _check_keys(entry: Any, allowed: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(entry, Mapping):
        raise DevicesFileError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise DevicesFileError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
    return entry


def _link(entry: Any, where: str, default: bool = False) -> LinkProfile:
    keys = _LINK_KEYS - {"src", "dst"} if default else _LINK_KEYS
    entry = _check_keys(entry, keys, where)
    if "bandwidth" not in entry:
        raise DevicesFileError(f"{where}: bandwidth is required")
    rtt = _seconds(entry, "rtt", where, None)
    if rtt is None:
        raise DevicesFileError(f"{where}: rtt_s or rtt_ms is required")
    src = "*" if default else str(entry.get("src", ""))
    dst = "*" if default else str(entry.get("dst", ""))
    if not src or not dst:
        raise DevicesFileError(f"{where}: src and dst are required")
    try:
        return LinkProfile(src, dst, rtt, parse_rate(entry["bandwidth"], f"{where}.bandwidth"))
    except ValueError as error:
        raise DevicesFileError(f"{where}: {error}") from None


def parse_devices(data: Mapping[str, Any]) -> DevicesFile:
    """Validate a loaded devices.yaml document and build the profiles (schema above)."""
    data = _check_keys(data, {"defaults", "devices", "network"}, "devices.yaml")
    defaults = dict(_check_keys(data.get("defaults") or {}, _DEFAULT_KEYS, "defaults"))
    entries = data.get("devices")
    if not isinstance(entries, list) or not entries:
        raise DevicesFileError("devices.yaml: 'devices' must be a non-empty list")
    devices: dict[str, DeviceProfile] = {}
    for position, raw in enumerate(entries):
        where = f"devices[{position}]"
        raw = _check_keys(raw, _DEVICE_KEYS, where)
        entry = {**defaults, **raw}
        device_id = entry.get("id")
        if not isinstance(device_id, str) or not device_id:
            raise DevicesFileError(f"{where}: 'id' must be a non-empty string")
        where = f"device {device_id!r}"
        if device_id in devices:
            raise DevicesFileError(f"{where}: listed twice")
        for required in ("memory", "speed"):
            if required not in entry:
                raise DevicesFileError(f"{where}: '{required}' is required")
        held = entry.get("held_units", [])
        if not isinstance(held, list) or not all(isinstance(u, int) and not isinstance(u, bool) for u in held):
            raise DevicesFileError(f"{where}: held_units must be a list of unit indices")
        try:
            devices[device_id] = DeviceProfile(
                id=device_id,
                memory_bytes=parse_size(entry["memory"], f"{where}.memory"),
                speed=_number(entry["speed"], f"{where}.speed"),
                overhead_s=_seconds(entry, "overhead", where, 0.0) or 0.0,
                power_busy_w=_number(entry.get("power_busy_w", DEFAULT_POWER_BUSY_W), f"{where}.power_busy_w"),
                power_idle_w=_number(entry.get("power_idle_w", DEFAULT_POWER_IDLE_W), f"{where}.power_idle_w"),
                held_units=frozenset(held),
                relay=bool(entry.get("relay", False)),
                emulated=bool(entry.get("emulated", False)),
            )
        except DevicesFileError:
            raise
        except ValueError as error:
            raise DevicesFileError(str(error)) from None

    network_entry = _check_keys(data.get("network") or {}, {"default", "links"}, "network")
    default = DEFAULT_LINK
    if "default" in network_entry:
        default = _link(network_entry["default"], "network.default", default=True)
    links_raw = network_entry.get("links") or []
    if not isinstance(links_raw, list):
        raise DevicesFileError("network.links must be a list")
    links = []
    known = set(devices) | {"coordinator"}
    for position, raw in enumerate(links_raw):
        link = _link(raw, f"network.links[{position}]")
        for end in (link.src, link.dst):
            if end not in known:
                raise DevicesFileError(f"network.links[{position}]: unknown node {end!r}")
        links.append(link)
    try:
        network = NetworkProfile(tuple(links), default)
    except ValueError as error:
        raise DevicesFileError(f"network: {error}") from None
    return DevicesFile(tuple(devices[d] for d in sorted(devices)), network)
