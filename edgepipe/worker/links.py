"""A worker's links to its peers: timing a data-port path (peer probes and their echo side),
and TLS contexts for the coordinator and peers."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from ..net import auth, limits
from ..net.channel import Channel, ChannelClosed, WebSocketChannel
from ..net.messages import PROBE_PLAN, Probe, Probed, Wire, parse
from ..net.protocol import MessageType as T, ProtocolError, decode, encode
from .core import PROBE_PLAN_FRAME_LIMIT

log = logging.getLogger("edgepipe.worker")
PEER_PINGS = 5  # small round trips of a peer probe (the least is the link's RTT)
PEER_SMALL_BYTES = 16 << 10  # first transfer of a peer probe: sizes the second
PEER_TRANSFER_S = 0.15  # the second transfer is sized to take about this long (within [small, asked])
PEER_PROBE_TIMEOUT_S = 10.0  # per frame of a peer probe


def peer_link(round_trips: list[float], small_bytes: int, small_s: float, large_bytes: int, large_s: float) -> tuple[float, float]:
    """(RTT, bandwidth) of a data-port path from a peer probe: the least round trip of empty
    frames, and the extra bytes of the large transfer over the small one divided by the extra
    seconds (the round trip and per-frame costs cancel). Where noise leaves no positive
    difference, the large transfer's own time bounds the bandwidth from below."""
    if not round_trips:
        raise ValueError("a peer probe needs at least one round trip")
    extra_s = large_s - small_s
    bandwidth = (large_bytes - small_bytes) / extra_s if extra_s > 0 and large_bytes > small_bytes else large_bytes / max(large_s, 1e-9)
    return min(round_trips), bandwidth


def incompressible(nbytes: int) -> np.ndarray:
    """Random bytes for a link probe: zeros would time a compressing path (permessage-deflate) as far
    faster. Seeded by the size, so the same probe gets the same bytes (golden frames)."""
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


async def measure_peer(channel: Channel, most_bytes: int) -> tuple[float, float]:
    """Time the data-port path over ``channel`` (opened on PROBE_PLAN), as activations travel it
    (the sender's shaping included): ``PEER_PINGS`` empty round trips, then two timed transfers."""
    count = iter(range(1 << 30))

    async def round_trip(nbytes: int) -> float:
        probe = next(count)
        tensors = {"payload": incompressible(nbytes)} if nbytes else {}
        frame = encode(Probe(probe, kind="echo").to_message(tensors))
        t0 = time.perf_counter()
        await channel.send(frame)
        reply = parse(decode(await asyncio.wait_for(channel.recv(), PEER_PROBE_TIMEOUT_S)))
        if not isinstance(reply, Probed) or reply.probe != probe:
            raise ProtocolError(f"peer answered {reply.TYPE.value if isinstance(reply, Wire) else 'an unknown frame'} to a probe")
        return time.perf_counter() - t0

    pings = [await round_trip(0) for _ in range(PEER_PINGS)]
    small = min([await round_trip(PEER_SMALL_BYTES) for _ in range(2)])
    rough = PEER_SMALL_BYTES / max(small - min(pings), 1e-6)
    large_bytes = int(min(max(rough * PEER_TRANSFER_S, 4 * PEER_SMALL_BYTES), most_bytes, PEER_PROBE_FRAME_BYTES))
    large = min([await round_trip(large_bytes) for _ in range(2)])
    return peer_link(pings, PEER_SMALL_BYTES, small, large_bytes, large)


PEER_PROBE_FRAME_BYTES = PROBE_PLAN_FRAME_LIMIT - limits.HEADER_SLACK_BYTES


async def echo_loop(channel: Channel) -> None:
    """A peer probing this link (authenticated with the probe secret): each ``probe`` frame of
    kind ``echo`` is answered with an empty ``probed`` at once; anything else ends it."""
    while True:
        try:
            msg = decode(await channel.recv())
            if msg.type is not T.PROBE:
                raise ProtocolError(f"{msg.type.value} is not accepted on a probe connection")
            probe = parse(msg)
            if probe.kind != "echo":
                raise ProtocolError(f"a {probe.kind or 'timing'} probe is not accepted on a probe connection")
            await channel.send(encode(Probed(probe.probe, True).to_message()))
        except ChannelClosed:
            return
        except ProtocolError as exc:
            log.warning("rejected probe frame from %s: %s", channel.peer, exc)
            try:
                await channel.close("protocol error")
            except ChannelClosed:
                pass
            return


async def open_peer(url: str, plan: int, secret: str | None, tls_context) -> WebSocketChannel:
    """A connection to another worker's data port for ``plan``, presenting its stage secret."""
    import websockets

    ws = await websockets.connect(url, max_size=limits.HEADER_SLACK_BYTES, ping_interval=None, open_timeout=5, compression=None,
                                  additional_headers=auth.data_headers(secret, plan), ssl=tls_context)
    return WebSocketChannel(ws, url)


class PeerTls:
    """TLS for wss data ports: pinned when the coordinator named the peer's certificate, else
    encrypted only (the stage secret still decides who may send). Contexts are made once."""

    def __init__(self):
        self._contexts: dict[str, object] = {}

    async def context(self, url: str, fingerprint: str | None):
        from urllib.parse import urlsplit

        from ..net import tls

        if not url.startswith("wss://"):
            return None
        if not fingerprint:
            return tls.unpinned_context()
        key = f"{url}|{fingerprint}"
        if key not in self._contexts:
            where = urlsplit(url)
            self._contexts[key] = await asyncio.get_running_loop().run_in_executor(None, tls.pinned_context, where.hostname, where.port,
                                                                                   fingerprint)
        return self._contexts[key]


__all__ = ["PROBE_PLAN", "PeerTls", "echo_loop", "incompressible", "measure_peer", "open_peer", "peer_link"]
