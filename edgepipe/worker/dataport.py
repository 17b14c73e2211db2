"""A worker's data port: the WebSocket server its predecessor sends activations (and KV movers
send KV) to. Nothing is read from a peer before its handshake names a plan this worker holds
and presents that stage's secret (``core.admit_data``); only then is its frame limit raised to
the plan's. Frames are checked with ``net.messages.parse`` (``data_loop``) and handed to the
``receive`` the shell gives ``start``; admission asks the shell's ``admit`` (``core.admit_data``
on its current state) and ``feeds`` (``core.admit_feed``). The port holds no reference to the shell.

Token ids come in on one connection only: from the plan's last stage feeding its first stage the
next step of a direct run (``cluster.rules.direct``), presenting the feed secret the first stage's
LOAD named. Such a connection carries nothing else, and a token-id FORWARD on any other is refused
with an error frame: closed by default."""

from __future__ import annotations

import logging
import time

import numpy as np

from ..net import auth, limits
from ..net.channel import Channel, ChannelClosed, WebSocketChannel
from ..net.messages import PROBE_PLAN, Forward, parse
from ..net.protocol import MessageType as T, ProtocolError, decode, error_frame
from . import links

log = logging.getLogger("edgepipe.worker")


class DataPort:
    def __init__(self, settings, tls_root):
        self.s, self.tls_root = settings, tls_root  # tls_root: where its self-signed certificate is kept (TLS clusters)
        self.admit = self.receive = self.feeds = None  # given by ``start``
        self.shape = lambda channel: channel
        self.url: str | None = None
        self.fingerprint: str | None = None  # sha256 of this port's certificate (TLS clusters)
        self._plans: dict[int, tuple[int, bool]] = {}  # connection -> the plan its handshake was admitted for, and whether it feeds
        self._refusals = limits.RateLimiter(rate_per_s=2.0, burst=20)

    async def start(self, admit, receive, shape=lambda channel: channel, feeds=lambda plan, check: False):
        """Serve the port: ``admit(plan, check)`` -> the plan's frame limit or None, ``receive(typed)``
        takes each accepted frame, ``shape`` wraps a probe's echo channel (the worker's link),
        ``feeds(plan, check)``: the connection is the plan's last stage feeding this first stage."""
        import websockets

        self.admit, self.receive, self.shape, self.feeds = admit, receive, shape, feeds
        s = self.s
        server_tls = None
        if s.tls_fingerprint:  # a cluster on TLS: activations go over wss too, with this worker's own certificate
            from ..net import tls

            cert, key = tls.make_self_signed(self.tls_root / ".tls", ("127.0.0.1", "localhost", s.data_host,
                                                                               s.advertise_host or s.data_host))
            server_tls, self.fingerprint = tls.server_context(cert, key), tls.fingerprint_pem(cert.read_text())
        # compression=None here and on every connection: activations and KV are float tensors that
        # permessage-deflate (the library default) cannot shrink, and it ran at 5 MB/s on a loaded core.
        server = await websockets.serve(self._handler, s.data_host, s.data_port, max_size=limits.HEADER_SLACK_BYTES, compression=None,
                                        ping_interval=None, process_request=self._authorize, ssl=server_tls,
                                        close_timeout=1)  # a peer cut for an oversized frame is dropped, not drained
        port = server.sockets[0].getsockname()[1]
        self.url = f"{'wss' if server_tls else 'ws'}://{s.advertise_host or s.data_host}:{port}"
        return server

    async def _handler(self, ws) -> None:
        plan, feed = self._plans.pop(id(ws), (None, False))
        if plan == PROBE_PLAN:  # a peer timing this link: answers leave through this worker's own (shaped) link
            await links.echo_loop(self.shape(WebSocketChannel(ws)))
        elif plan is not None:
            await data_loop(WebSocketChannel(ws), plan, self.receive, feed)

    def _authorize(self, connection, request):
        """Handshake check: the plan's stage secret, else 401 (or 429 once an address has been
        refused too often); on success the frame limit becomes the plan's."""
        peer = str((connection.remote_address or ("?",))[0])
        try:
            plan = int(request.headers.get(auth.PLAN_HEADER, ""))
        except ValueError:
            plan = None
        check = lambda secret: auth.bearer_matches(request.headers.get("Authorization"), secret)  # noqa: E731
        limit = self.admit(plan, check)
        if limit is not None:
            connection.protocol.max_message_size = limit
            self._plans[id(connection)] = (plan, plan != PROBE_PLAN and bool(self.feeds(plan, check)))
            return None
        if not self._refusals.allow(peer, time.monotonic()):
            return connection.respond(429, "too many refused connections\n")
        log.warning("data port: refused %s (no valid credentials for a plan this worker holds)", peer)
        return connection.respond(401, "data port: this stage's credentials are required\n")


async def data_loop(channel: Channel, plan: int, receive, feed: bool = False) -> None:
    """Frames from the authenticated predecessor (or KV mover) of ``plan``: only FORWARD and
    KV, and only for that plan; token ids only on a ``feed`` connection (``feed_problem``)."""
    while True:
        try:
            raw = await channel.recv()
        except ChannelClosed:
            return
        try:
            msg = decode(raw)
            if msg.type not in (T.FORWARD, T.KV):
                raise ProtocolError(f"{msg.type.value} is not accepted on the data port")
            typed = parse(msg)
            if typed.plan != plan:
                raise ProtocolError(f"frame for plan {typed.plan!r} on a connection for plan {plan}")
            problem = feed_problem(typed, feed)
            if problem:
                raise ProtocolError(f"plan {plan}: {problem}")
        except ProtocolError as exc:
            log.warning("rejected frame from %s: %s", channel.peer, exc)
            try:
                await channel.send(error_frame(str(exc)))
                await channel.close("protocol error")
            except ChannelClosed:
                pass
            return
        await receive(typed)


def feed_problem(typed, feed: bool) -> str | None:
    """Why a frame may not arrive on this data connection (None: it may). A ``feed`` connection (the
    plan's last stage, ``core.admit_feed``) carries only the next steps of direct runs: FORWARDs of
    one token id per sequence, each entry ``direct``. Any other connection carries no token ids."""
    ids = isinstance(typed, Forward) and typed.x is not None and np.issubdtype(typed.x.dtype, np.integer)
    if not feed:
        return ("token ids are taken on the data port only from the plan's last stage feeding a direct run "
                "(with the feed credentials the first stage was given)") if ids else None
    if not (ids and typed.x.ndim == 2 and typed.x.shape[1] == 1 and typed.relay_to is None
            and all(type(item) is dict and item.get("direct") is True for item in typed.batch)):
        return "a feed connection carries only the next steps of direct runs (one token id per direct entry)"
    return None
