"""User-space link shaping: one-way delay, rate and loss, with no root needed.

Owns the arithmetic of a shaped link (``TokenBucket``, ``LinkShape``, ``parse_rate``), a
byte-level TCP relay that applies a shape to every connection through it (``DelayRelay``), and
``shaped_send`` for transports that shape their own sends. The kernel here has no ``netem``, so
this is where delay and loss come from even when ``netns`` caps the rate.

Loss on a byte stream cannot drop bytes (TCP would resend them), so it is modelled as what a
lost segment costs a TCP sender: with probability ``loss`` a chunk, and everything queued behind
it, arrives one retransmission timeout late.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

MIN_RETRANSMIT_TIMEOUT_S = 0.2  # Linux's TCP_RTO_MIN

_RATE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([A-Za-z]*)(/s)?\s*$")
_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_RATE_FORMS = (
    "expected a positive number and a unit such as '128KB/s', '1.5MB/s', '512KiB/s', '10Mbit' "
    "or '10Mbit/s' (B = bytes, bit = bits; K/M/G are powers of 1000, Ki/Mi/Gi of 1024)"
)


def parse_rate(rate: str | float | int) -> float:
    """A link rate in bytes per second, from ``"128KB/s"``, ``"10Mbit"``, ``"1.5MB/s"``...

    A bare number is bytes per second. Raises ``ValueError`` naming the accepted forms.
    """
    if isinstance(rate, bool):
        raise ValueError(f"cannot parse rate {rate!r}: {_RATE_FORMS}")
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = _RATE_PATTERN.match(rate) if isinstance(rate, str) else None
        if match is None:
            raise ValueError(f"cannot parse rate {rate!r}: {_RATE_FORMS}")
        mantissa, exponent, unit, _per_second = match.groups()
        number = float(mantissa) * 10 ** int(exponent or 0)
        if unit.lower().endswith("bit"):
            prefix, bits_per_unit = unit[:-3], 1
        elif unit.endswith("B"):
            prefix, bits_per_unit = unit[:-1], 8
        elif unit == "":
            prefix, bits_per_unit = "", 8
        else:
            # A lowercase 'b' could mean bits or bytes; better to refuse than guess by 8x.
            raise ValueError(f"cannot parse rate {rate!r}: unit {unit!r} is ambiguous; {_RATE_FORMS}")
        multiplier = _PREFIXES.get(prefix.lower())
        if multiplier is None:
            raise ValueError(f"cannot parse rate {rate!r}: unknown prefix {prefix!r}; {_RATE_FORMS}")
        value = number * multiplier * bits_per_unit / 8
    if not value > 0 or value == float("inf"):
        raise ValueError(f"rate must be positive and finite, got {rate!r}")
    return value


def format_rate(bytes_per_s: float) -> str:
    """A human-readable rate, decimal units, for labels and reports."""
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= size:
            return f"{bytes_per_s / size:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


class TokenBucket:
    """Rate pacing: how long to wait before ``nbytes`` more may leave.

    Starts full (``burst_bytes`` tokens) and refills at ``rate_bytes_per_s`` up to the burst.
    ``delay_for`` reserves the bytes at once, going into debt when it must, so successive calls
    queue behind each other and a chunk larger than the burst still passes after its wait.
    Time comes from ``now`` when given, else from the injected ``clock``.
    """

    emulated: ClassVar[bool] = True

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(f"token bucket rate must be positive, got {rate_bytes_per_s}")
        if not burst_bytes > 0:
            raise ValueError(f"token bucket burst must be positive, got {burst_bytes}")
        self.rate_bytes_per_s = float(rate_bytes_per_s)
        self.burst_bytes = float(burst_bytes)
        self._clock = clock
        self._tokens = float(burst_bytes)
        self._updated_at: float | None = None

    def delay_for(self, nbytes: int, now: float | None = None) -> float:
        """Seconds from ``now`` until the last of ``nbytes`` may be sent; reserves them."""
        if nbytes < 0:
            raise ValueError(f"cannot send a negative number of bytes ({nbytes})")
        now = self._clock() if now is None else now
        if self._updated_at is not None:
            elapsed = max(0.0, now - self._updated_at)  # a clock that steps back adds nothing
            self._tokens = min(self.burst_bytes, self._tokens + elapsed * self.rate_bytes_per_s)
        self._updated_at = now if self._updated_at is None else max(now, self._updated_at)
        self._tokens -= nbytes
        if self._tokens >= 0:
            return 0.0
        return self._updated_at - now - self._tokens / self.rate_bytes_per_s

    def label(self) -> str:
        return f"emulated token bucket {format_rate(self.rate_bytes_per_s)}, burst {self.burst_bytes:.0f} B"


@dataclass(frozen=True)
class LinkShape:
    """What an emulated link does to the bytes on it, in one direction."""

    delay_ms: float = 0  # one-way propagation delay added to every chunk
    rate_bytes_per_s: float | None = None  # None: as fast as the host allows
    loss: float = 0  # probability a chunk pays one retransmission timeout, in [0, 1)
    burst_bytes: float | None = None  # None: default_burst() for the rate

    emulated: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if self.rate_bytes_per_s is not None and not self.rate_bytes_per_s > 0:
            raise ValueError(f"rate_bytes_per_s must be positive or None, got {self.rate_bytes_per_s}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.burst_bytes is not None and not self.burst_bytes > 0:
            raise ValueError(f"burst_bytes must be positive or None, got {self.burst_bytes}")

    @classmethod
    def of(cls, delay_ms: float = 0, rate: str | float | None = None, loss: float = 0) -> "LinkShape":
        """A shape from a rate string such as ``"10Mbit"`` (see ``parse_rate``)."""
        return cls(delay_ms=delay_ms, rate_bytes_per_s=None if rate is None else parse_rate(rate), loss=loss)

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000

    @property
    def retransmit_penalty_s(self) -> float:
        """What one lost chunk costs: an RTO, at least Linux's minimum and about two RTTs."""
        return max(MIN_RETRANSMIT_TIMEOUT_S, 4 * self.delay_s)

    def default_burst(self) -> float:
        """The burst the bucket gets when none is set: 10 ms at the rate, at least 16 KiB."""
        assert self.rate_bytes_per_s is not None
        return self.burst_bytes or max(16 * 1024, self.rate_bytes_per_s * 0.01)

    def new_bucket(self, clock: Callable[[], float] = time.monotonic) -> TokenBucket | None:
        """A fresh token bucket for this shape, or None when the rate is unlimited."""
        if self.rate_bytes_per_s is None:
            return None
        return TokenBucket(self.rate_bytes_per_s, self.default_burst(), clock)

    def label(self) -> str:
        rate = "unlimited rate" if self.rate_bytes_per_s is None else format_rate(self.rate_bytes_per_s)
        return f"emulated link: {self.delay_ms:g} ms one-way, {rate}, {self.loss:.1%} loss"


@dataclass
class ShapedLink:
    """The running state of one shaped direction: a shape, its token bucket, a seeded RNG."""

    shape: LinkShape
    clock: Callable[[], float] = time.monotonic
    seed: int = 0  # loss draws are deterministic per link
    bucket: TokenBucket | None = field(init=False)
    _rng: random.Random = field(init=False, repr=False)

    emulated: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.bucket = self.shape.new_bucket(self.clock)
        self._rng = random.Random(self.seed)

    def pacing_delay(self, nbytes: int, now: float | None = None) -> float:
        """Seconds until ``nbytes`` have been serialised onto the link (rate only); reserves them."""
        return 0.0 if self.bucket is None else self.bucket.delay_for(nbytes, now)

    def transit_delay(self) -> float:
        """Seconds from leaving the sender to arriving: one-way delay, plus an RTO if 'lost'."""
        lost = self.shape.loss > 0 and self._rng.random() < self.shape.loss
        return self.shape.delay_s + (self.shape.retransmit_penalty_s if lost else 0.0)

    def send_delay(self, nbytes: int, now: float | None = None) -> float:
        """Seconds from ``now`` until ``nbytes`` sent now have arrived at the far end."""
        return self.pacing_delay(nbytes, now) + self.transit_delay()

    def label(self) -> str:
        return self.shape.label()


async def shaped_send(link: ShapedLink, nbytes: int) -> float:
    """Sleep as long as sending ``nbytes`` over ``link`` takes to arrive; returns the seconds.

    For transports that shape themselves (no root, no relay): await it before handing a message
    of ``nbytes`` to the real socket. Sends from separate tasks overlap their delays and queue
    only on the rate, as on a real link; sends awaited one after another add up.
    """
    wait = link.send_delay(nbytes)
    await asyncio.sleep(wait)
    return wait


@dataclass(frozen=True)
class ForwardedBytes:
    """Bytes a relay has delivered so far, per direction, over all its connections."""

    to_target: int  # client -> target
    to_client: int  # target -> client


class DelayRelay:
    """A TCP relay that applies a ``LinkShape`` to each direction of every connection.

    Every chunk read from one side leaves for the other once the token bucket allows it and
    arrives ``delay_ms`` later. The rate wait holds the reader (so a fast sender feels TCP
    backpressure), while the delay is a timed queue (so delay does not cap throughput: a chunk
    read at t is written at t + delay whatever is queued). Order is preserved; half-closes pass
    through. Byte-level, so WebSocket or any other TCP protocol works through it.
    Create with ``await DelayRelay.start(...)``; ``await close()`` when done.
    """

    emulated: ClassVar[bool] = True
    _QUEUED_CHUNKS_PER_DIRECTION = 4096  # bounds memory if the far side stops reading

    def __init__(self, shape: LinkShape, target_host: str, target_port: int, seed: int) -> None:
        # Use start(); the constructor only stores collaborators.
        self.shape = shape
        self.target_host = target_host
        self.target_port = target_port
        self._seed = seed
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._connection_count = 0
        self._to_target = 0
        self._to_client = 0

    @classmethod
    async def start(
        cls,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        shape: LinkShape,
        seed: int = 0,
    ) -> "DelayRelay":
        """Listen on ``listen_host:listen_port`` (0 picks a free port) and relay to the target."""
        relay = cls(shape, target_host, target_port, seed)
        relay._server = await asyncio.start_server(relay._accept, listen_host, listen_port)
        return relay

    @property
    def port(self) -> int:
        """The port the relay listens on."""
        assert self._server is not None, "use 'await DelayRelay.start(...)'"
        return self._server.sockets[0].getsockname()[1]

    @property
    def bytes_forwarded(self) -> ForwardedBytes:
        return ForwardedBytes(to_target=self._to_target, to_client=self._to_client)

    def label(self) -> str:
        return f"{self.shape.label()} (relay :{self.port} -> {self.target_host}:{self.target_port})"

    async def close(self) -> None:
        """Stop listening and cut every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> "DelayRelay":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _chunk_size(self) -> int:
        rate = self.shape.rate_bytes_per_s
        # About 10 ms of data per chunk keeps the pacing smooth at slow rates.
        return 64 * 1024 if rate is None else int(min(64 * 1024, max(1024, rate * 0.01)))

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # A task of our own rather than a coroutine callback: Python 3.11's stream server logs
        # an error when the task it made for the callback ends cancelled, as close() does.
        task = asyncio.create_task(self._serve_connection(client_reader, client_writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve_connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        connection_index = self._connection_count
        self._connection_count += 1
        target_writer: asyncio.StreamWriter | None = None
        try:
            target_reader, target_writer = await asyncio.open_connection(self.target_host, self.target_port)
            seed = self._seed * 1_000_003 + 2 * connection_index
            upstream: asyncio.Queue = asyncio.Queue(self._QUEUED_CHUNKS_PER_DIRECTION)
            downstream: asyncio.Queue = asyncio.Queue(self._QUEUED_CHUNKS_PER_DIRECTION)
            to_target_link = ShapedLink(self.shape, seed=seed)
            to_client_link = ShapedLink(self.shape, seed=seed + 1)
            sides = [
                asyncio.create_task(self._take_in(client_reader, to_target_link, upstream)),
                asyncio.create_task(self._deliver(upstream, target_writer, to_target=True)),
                asyncio.create_task(self._take_in(target_reader, to_client_link, downstream)),
                asyncio.create_task(self._deliver(downstream, client_writer, to_target=False)),
            ]
            try:
                # A reset on either side ends the connection; a clean EOF only ends its direction.
                done, _pending = await asyncio.wait(sides, return_when=asyncio.FIRST_EXCEPTION)
                for side in done:
                    side.result()
            finally:
                for side in sides:
                    side.cancel()
                await asyncio.gather(*sides, return_exceptions=True)
        except (ConnectionError, OSError):
            pass  # a peer went away; closing both sides below is all there is to do
        finally:
            for writer in (client_writer, target_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(Exception):
                        await writer.wait_closed()

    async def _take_in(self, reader: asyncio.StreamReader, link: ShapedLink, in_flight: asyncio.Queue) -> None:
        """Read chunks at the link's rate and queue each with its arrival time; None marks EOF."""
        loop = asyncio.get_running_loop()
        chunk_size = self._chunk_size()
        last_arrival = 0.0
        while True:
            chunk = await reader.read(chunk_size)
            now = loop.time()
            pacing = link.pacing_delay(len(chunk), now)
            # Planned times, not measured ones, so sleep overshoot does not accumulate.
            arrival = max(last_arrival, now + pacing + link.transit_delay())
            last_arrival = arrival
            if pacing > 0:
                await asyncio.sleep(pacing)
            await in_flight.put((arrival, chunk or None))
            if not chunk:
                return

    async def _deliver(self, in_flight: asyncio.Queue, writer: asyncio.StreamWriter, to_target: bool) -> None:
        """Write each queued chunk at its arrival time; pass EOF on as a half-close."""
        loop = asyncio.get_running_loop()
        while True:
            arrival, chunk = await in_flight.get()
            wait = arrival - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if chunk is None:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()
            if to_target:
                self._to_target += len(chunk)
            else:
                self._to_client += len(chunk)
