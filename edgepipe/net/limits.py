"""Limits before trust: frame sizes, per-address rate limits, a bounded event log.

Pure bookkeeping (no I/O, clocks passed in). A peer that has not authenticated may send one
small frame (a hello, or nothing at all on a data port); once it has, its frames may be as
large as the plan can legitimately make them, and no larger. Sizes are bytes.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from typing import Iterable, Iterator

HEADER_SLACK_BYTES = 64 << 10  # msgpack header of a frame: batch items, timings, names
HELLO_BASE_BYTES = 64 << 10  # a hello without its list of held files, with room to spare
HELD_HEADROOM = 4  # held files counted as if every file came in this many variants (built on demand)
HELD_ENTRY_BYTES = 80  # one sha256 hex string in msgpack, rounded up
MAX_DECODE_BATCH = 256  # decode lanes carry at most this many sequences per frame
LINK_PROBE_MAX_BYTES = 1 << 22  # the largest uplink probe payload a worker is asked for
LINK_PROBE_DEFAULT_BYTES = 1 << 18  # a link or peer probe's payload when the probe names no size
MAX_TOP_LOGPROBS = 20  # the most alternatives a sampling entry's ``top`` may ask the head for (OpenAI's bound)
KV_RESERVE_TOKENS = 2048  # KV room every stage must keep for one sequence this long (a worker's memory check)


def hello_frame_limit(n_files: int) -> int:
    """The largest hello a worker may send before it is authenticated: tens of KB plus the
    sha256 names of the files it may already hold (the package's files, in a few variants)."""
    return HELLO_BASE_BYTES + HELD_ENTRY_BYTES * HELD_HEADROOM * max(0, n_files)


def activation_frame_limit(max_context: int, hidden: int, max_batch: int = MAX_DECODE_BATCH) -> int:
    """The largest activation frame a stage can receive: a prefill of the whole context
    (prefills travel alone) or a decode lane of ``max_batch`` sequences, float32."""
    rows_by_positions = max(max_context, max_batch)
    return HEADER_SLACK_BYTES + rows_by_positions * hidden * 4


def kv_frame_limit(max_context: int, kv_bytes_per_token: int) -> int:
    """The largest KV move into a stage: the whole context of one sequence for its layers."""
    return HEADER_SLACK_BYTES + max_context * max(0, kv_bytes_per_token)


def control_frame_limit(max_context: int, hidden: int, max_batch: int = MAX_DECODE_BATCH) -> int:
    """The largest frame an authenticated worker sends the coordinator: a relayed activation
    frame (browser neighbours), a link probe payload, or tokens/timings (small)."""
    return max(activation_frame_limit(max_context, hidden, max_batch), HEADER_SLACK_BYTES + LINK_PROBE_MAX_BYTES)


def data_frame_limit(max_context: int, hidden: int, kv_bytes_per_token: int, max_batch: int = MAX_DECODE_BATCH) -> int:
    """The largest frame a stage's authenticated predecessor (or a KV mover) may send it."""
    return max(activation_frame_limit(max_context, hidden, max_batch), kv_frame_limit(max_context, kv_bytes_per_token))


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per key (an address): ``burst`` at once, then ``rate_per_s``.

    ``allow(key, now)`` spends one token if there is one. Keys are forgotten least recently
    used first beyond ``max_keys``, so a flood from many addresses cannot grow it."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 4096):
        if not (rate_per_s > 0 and burst >= 1):
            raise ValueError(f"rate {rate_per_s}/s and burst {burst} must be positive")
        self.rate, self.burst, self.max_keys = float(rate_per_s), float(burst), max_keys
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, key: str, now: float) -> bool:
        b = self._buckets.pop(key, None) or _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + max(0.0, now - b.at) * self.rate)
        b.at = now
        allowed = b.tokens >= 1.0
        if allowed:
            b.tokens -= 1.0
        self._buckets[key] = b
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed


class EventLog:
    """The coordinator's event log with a bounded count per kind.

    Behaves like the ``deque`` it replaces (``append``, iteration in arrival order, ``len``),
    but each kind keeps only its latest ``per_kind`` entries, so 600 refused joins keep
    ``per_kind`` of themselves and flush nothing else; ``dropped`` counts what was let go.
    At most ``max_kinds`` kinds are kept (an unknown kind past that is counted, not kept)."""

    def __init__(self, per_kind: int = 200, max_kinds: int = 64, initial: Iterable[dict] = ()):
        self.per_kind, self.max_kinds = per_kind, max_kinds
        self._by_kind: dict[str, deque[tuple[int, dict]]] = {}
        self._order = count()
        self.dropped: dict[str, int] = {}
        for event in initial:
            self.append(event)

    def append(self, event: dict) -> None:
        kind = str(event.get("kind", "?"))[:64]
        entries = self._by_kind.get(kind)
        if entries is None:
            if len(self._by_kind) >= self.max_kinds:
                self.dropped["(other kinds)"] = self.dropped.get("(other kinds)", 0) + 1
                return
            entries = self._by_kind[kind] = deque()
        entries.append((next(self._order), event))
        if len(entries) > self.per_kind:
            entries.popleft()
            self.dropped[kind] = self.dropped.get(kind, 0) + 1

    def __iter__(self) -> Iterator[dict]:
        merged = sorted((entry for entries in self._by_kind.values() for entry in entries), key=lambda e: e[0])
        return iter([event for _, event in merged])

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_kind.values())

    def __getitem__(self, index):
        return list(self)[index]


def json_safe(value, depth: int = 0):
    """A copy of ``value`` that strict JSON can carry: non-finite floats become ``None``,
    tuples lists, unknown objects their ``str``; nesting deeper than 32 is cut."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if depth > 32:
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    if isinstance(value, bytes):
        return value.hex()[:128]
    return str(value)
