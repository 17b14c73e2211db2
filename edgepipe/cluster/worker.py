"""A worker: holds one stage of the pipeline and runs it for whatever sequences arrive.

It keeps one control channel to the coordinator (hello, load, heartbeats, sampled tokens)
and serves a data endpoint where its predecessor sends activations directly. Compute runs
in one thread so the event loop stays free for heartbeats and I/O. Needs only onnxruntime,
numpy, msgpack and websockets.

Emulation (always labelled as such in what the worker reports): ``slowdown`` makes each
compute call last ``f`` times its CPU time (single-threaded decode; else ``f`` times its wall
time); ``memory_bytes`` is a hard budget for weights
plus KV; ``link`` shapes every frame the worker sends; ``drop_work`` makes it a faulty device
that answers heartbeats but silently drops every activation frame, and ``misreport`` one that
reports its compute times divided by a factor (the coordinator must find both by what they do).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import PROTOCOL_VERSION
from ..emulate.slowdown import MemoryBudget, MemoryBudgetExceeded, SlowdownPolicy
from ..native import native_library
from ..net import auth, limits, validate
from ..net.channel import Channel, ChannelClosed, ShapedChannel, WebSocketChannel
from ..net.messages import PROBE_PLAN, Bye, ErrorCode
from ..net.protocol import Message, MessageType as T, ProtocolError, decode, encode, error_frame
from ..runtime.devices import resolve as resolve_device
from ..runtime.prefix_store import PrefixMiss, PrefixStore, prefix_entry
from ..runtime.stage_runner import ContextOverflow, SamplingBatch, StageRunner, spin_by_default
from .blobcache import BlobCache

log = logging.getLogger("edgepipe.worker")
KV_RESERVE_TOKENS = limits.KV_RESERVE_TOKENS  # KV room a stage must leave for at least one sequence this long
RECONNECT_FIRST_S, RECONNECT_CAP_S = 0.2, 5.0  # backoff between attempts to reach the coordinator
RECONNECT_SHARE = 0.1  # ... at most this share of the time it has been gone (1 s at least)
STABLE_SESSION_S = 10.0  # a membership that lasted this long resets the backoff
WELCOME_TIMEOUT_S = 120.0  # the coordinator may build a weight variant before it welcomes
INLINE_STEP_S = 0.02  # decode steps faster than this run on the event loop (no thread hand-off)
LOOP_LAG_WARN_S = 1.0  # the event loop held up this long (a PONG would have waited as long): log it
PEER_PINGS = 5  # small round trips of a peer probe (the least is the link's RTT)
PEER_SMALL_BYTES = 16 << 10  # first transfer of a peer probe: sizes the second
PEER_TRANSFER_S = 0.15  # the second transfer is sized to take about this long (within [small, asked])
PEER_PROBE_TIMEOUT_S = 10.0  # per frame of a peer probe
PEER_FRAME_LIMIT = (1 << 20) + limits.HEADER_SLACK_BYTES  # largest frame a probe connection may send


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


def reconnect_delay(attempt: int, draw: float, gone_s: float = 0.0) -> float:
    """Seconds before reconnect ``attempt`` (0, 1, ...) when the coordinator has been out of
    reach for ``gone_s``: exponential from 0.2 s, capped at a tenth of ``gone_s`` (at least 1 s,
    at most 5 s) so a coordinator that restarts in seconds is found again within about a
    second, and jittered over the upper half (``draw`` in [0, 1)) so the workers of a
    restarted coordinator do not all come back in the same instant."""
    cap = min(RECONNECT_CAP_S, max(1.0, RECONNECT_SHARE * gone_s))
    ceiling = min(cap, RECONNECT_FIRST_S * 2 ** min(attempt, 30))
    return ceiling * (0.5 + 0.5 * draw)


def _websocket_errors() -> type[Exception]:
    import websockets

    return websockets.exceptions.WebSocketException


@dataclass
class WorkerSettings:
    coordinator: str  # http(s)://host:port of the coordinator
    name: str = field(default_factory=socket.gethostname)
    memory_bytes: int | None = None
    threads: int | None = None
    spin: bool | None = None  # pool threads spin between ops (None: stage_runner.spin_by_default)
    slowdown: float = 1.0
    link_delay_ms: float = 0.0
    link_rate: str | None = None
    data_host: str = "127.0.0.1"
    data_port: int = 0
    advertise_host: str | None = None
    join_token: str | None = None
    tls_fingerprint: str | None = None  # sha256 of the coordinator's certificate: pin it, serve the data port over wss
    cache_dir: Path | None = None
    activation_dtype: str = "float32"  # "float16" halves the bytes on the wire
    silence_s: float = 10.0  # no frame from the coordinator for this long: reconnect
    power_busy_w: float | None = None  # declared power draw, for the energy objective
    power_idle_w: float | None = None
    drop_work: bool = False
    misreport: float = 1.0  # reported compute times are divided by this
    device: str = "cpu"  # where stages compute: auto | cpu | gpu | gpu:N (runtime.devices.resolve)

    @property
    def emulated(self) -> bool:
        return self.slowdown != 1.0 or bool(self.link_delay_ms) or bool(self.link_rate) or self.drop_work or self.misreport != 1.0


class CorruptInput(ValueError):
    """What a predecessor sent this stage cannot be used (non-finite, wrong shape)."""


@dataclass
class Slot:
    """A built stage for one plan: units ``[start, end)`` and where their output goes."""

    plan: int
    start: int
    end: int
    runner: StageRunner
    next: dict  # {"kind": "worker", "id", "url", "relay"[, "secret"]} | {"kind": "coordinator"}
    weight_bytes: int
    secret: str | None = None  # what this stage's predecessor must present on the data port
    frame_limit: int = limits.HEADER_SLACK_BYTES  # largest frame accepted on the data port for this plan
    max_context: int | None = None
    prefix: PrefixStore = field(default_factory=PrefixStore)  # cached prompt blocks of this plan's stage (cluster.prefix)


class Worker:
    def __init__(self, settings: WorkerSettings):
        self.s = settings
        self.device = resolve_device(settings.device)
        if self.device.note and settings.device != "cpu":
            log.warning("computing on the CPU: %s", self.device.note)
        elif self.device.is_gpu:
            log.info("computing on %s", self.device.describe())
        self.native_kernel, self.native_kernel_note = _gguf_kernel(self.device.is_gpu)
        self.cache = BlobCache(settings.cache_dir or _default_cache())
        self.slowdown = SlowdownPolicy(settings.slowdown)
        self.budget = MemoryBudget(settings.memory_bytes) if settings.memory_bytes else None
        self.id: str | None = None
        self.slots: dict[int, Slot] = {}
        self.sessions: dict[str, StageRunner] = {}  # built sessions by graph sha (active slots + a warm spare)
        self.warm: set[str] = set()
        self.control: Channel | None = None
        self.peers: dict[str, Channel] = {}
        self.data_fingerprint: str | None = None  # sha256 of this worker's data-port certificate (TLS clusters)
        self._tls_coordinator = None
        self._tls_peers: dict = {}
        self.data_url: str | None = None
        self.queue: asyncio.Queue[Message] = asyncio.Queue()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.link = None
        if settings.link_delay_ms or settings.link_rate:
            from ..emulate.shaper import LinkShape, ShapedLink, parse_rate

            rate = parse_rate(settings.link_rate) if settings.link_rate else None
            self.link = ShapedLink(LinkShape(delay_ms=settings.link_delay_ms, rate_bytes_per_s=rate))
        self.busy_s = 0.0
        self.computed = 0
        self._background: set[asyncio.Task] = set()
        self.joins = 0  # memberships so far (1 + rejoins)
        self.fetched_bytes = 0  # blob bytes downloaded by this process
        self._step_s: dict[int, float] = {}  # last decode step time per runner: inline or in the thread
        self.loop_lag_s = 0.0  # worst event-loop hold-up since the last PONG reported it
        self._probe_secret: str | None = None  # what a peer probing this data port presents (Probe kind "accept")

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, control: Channel | None = None) -> None:
        """Join the coordinator and serve until it says a final bye (or the process is stopped).

        A dropped control connection does not end the worker: it reconnects with jittered
        exponential backoff, keeping its data port, blob cache and built sessions, and joins
        again as a new member (the coordinator recalls its calibration by name and hardware).
        With a ``control`` channel given (in-memory use) it serves that one channel only."""
        server = await self._serve_data()
        compute = asyncio.create_task(self._compute_loop())
        lag = asyncio.create_task(self._watch_loop_lag())
        try:
            if control is not None:
                await self._session(control)
                return
            attempt, gone_since = 0, time.monotonic()
            while True:
                started = time.monotonic()
                try:
                    channel = await self._connect_control()
                except (OSError, asyncio.TimeoutError, _websocket_errors()) as exc:
                    why = f"cannot reach {self.s.coordinator}: {str(exc) or type(exc).__name__}"
                else:
                    joins = self.joins
                    if await self._session(channel):
                        return
                    why = "control connection lost"
                    if self.joins > joins:  # it was a member: the coordinator is gone from now
                        gone_since = time.monotonic()
                        if gone_since - started > STABLE_SESSION_S:
                            attempt = 0  # it served a while: the backoff starts afresh
                delay = reconnect_delay(attempt, random.random(), time.monotonic() - gone_since)
                attempt += 1
                log.warning("%s; reconnecting in %.1f s (attempt %d)", why, delay, attempt)
                await asyncio.sleep(delay)
        finally:
            compute.cancel()
            lag.cancel()
            if server is not None:
                server.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def serve_until_terminated(self) -> None:
        """``run``, with SIGTERM cancelling it as Ctrl-C does: the worker then says a final bye."""
        import signal
        import threading

        task = asyncio.current_task()

        def terminate() -> None:
            task.cancel()
            # asyncio.run joins executor threads on the way out (a compute or a download in
            # flight): never let that keep a stopped worker alive for more than a moment
            timer = threading.Timer(3.0, os._exit, (0,))
            timer.daemon = True
            timer.start()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
        await self.run()

    async def _watch_loop_lag(self, tick: float = 0.1) -> None:
        """Measure how late the event loop wakes up: what a heartbeat would have waited."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(tick)
            held = time.monotonic() - t0 - tick
            self.loop_lag_s = max(self.loop_lag_s, held)
            if held > LOOP_LAG_WARN_S:
                log.warning("event loop held up for %.2f s (heartbeats waited as long)", held)

    async def _session(self, channel: Channel) -> bool:
        """One membership: hello, welcome, then control frames until the channel ends.
        True when the coordinator said a final bye (the worker should exit)."""
        self.control = self._shape(channel)
        try:
            await self.control.send(encode(Message(T.HELLO, self._hello())))
            reply = decode(await asyncio.wait_for(self.control.recv(), timeout=WELCOME_TIMEOUT_S))
        except (ChannelClosed, ProtocolError, asyncio.TimeoutError) as exc:
            log.warning("no welcome from the coordinator: %s", str(exc) or type(exc).__name__)
            await self._close_control()
            return False
        if reply.type is T.ERROR:
            raise PermissionError(f"coordinator refused this worker: {reply.get('message')}")
        self._rejoin()
        self.id = reply["worker_id"]
        self.joins += 1
        log.info("joined as %s (pid %d, %d blobs held, %d sessions kept, %d bytes downloaded so far)",
                    self.id, os.getpid(), len(self.cache.held()), len(self.sessions), self.fetched_bytes)
        try:
            return await self._control_loop()
        except asyncio.CancelledError:  # the process is stopping for good: the coordinator drops it at once
            await self._final_bye()
            raise
        finally:
            await self._close_control()

    async def _final_bye(self) -> None:
        try:
            await asyncio.wait_for(self.control.send(encode(Bye(final=True).to_message())), timeout=1.0)
        except (ChannelClosed, OSError, asyncio.TimeoutError, _websocket_errors()):
            pass

    def _rejoin(self) -> None:
        """Forget what belonged to the previous membership: plan ids are the coordinator's (a
        restarted one counts from 1 again) and its sequences are rebuilt elsewhere by replay.
        Built sessions stay, as warm spares, so a rejoin that gets the same range builds nothing."""
        kept = {id(slot.runner) for slot in self.slots.values()}
        self.warm |= {sha for sha, runner in self.sessions.items() if id(runner) in kept}
        self.slots.clear()
        while not self.queue.empty():  # frames of the previous membership's plans
            self.queue.get_nowait()
        for runner in self.sessions.values():
            for seq in runner.sequences():
                runner.drop(seq)
        for channel in self.peers.values():
            self._spawn(channel.close())
        self.peers.clear()

    async def _close_control(self) -> None:
        """Close the control channel without waiting long on a coordinator that cannot answer."""
        try:
            await asyncio.wait_for(self.control.close(), timeout=1.0)
        except (ChannelClosed, OSError, asyncio.TimeoutError, _websocket_errors()):
            ws = getattr(getattr(self.control, "inner", self.control), "ws", None)
            if getattr(ws, "transport", None) is not None:
                ws.transport.abort()

    def _hello(self) -> dict:
        return {
            "name": self.s.name, "token": self.s.join_token, "protocol": PROTOCOL_VERSION, "kind": "native",
            "memory_bytes": self.s.memory_bytes or self.device.memory_bytes or _system_memory(), "threads": self.s.threads or os.cpu_count(),
            "device": self.device.kind, "adapter": self.device.adapter,
            "device_note": self.device.note if self.s.device != "cpu" else None,
            "native_kernel": self.native_kernel, "native_kernel_note": self.native_kernel_note,
            "data_url": self.data_url, "held": self.cache.held(), "pid": os.getpid(), "data_fingerprint": self.data_fingerprint,
            "power_busy_w": self.s.power_busy_w, "power_idle_w": self.s.power_idle_w,
            "emulation": {"slowdown": self.s.slowdown, "link_delay_ms": self.s.link_delay_ms, "link_rate": self.s.link_rate,
                          **({"drop_work": True} if self.s.drop_work else {}),
                          **({"misreport": self.s.misreport} if self.s.misreport != 1.0 else {}),
                          "memory_budget": self.s.memory_bytes} if self.s.emulated or self.s.memory_bytes else None,
        }

    async def _connect_control(self) -> Channel:
        import websockets

        url = self.s.coordinator.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/v1/worker"
        ssl_context = await self._coordinator_tls() if url.startswith("wss://") else None
        ws = await websockets.connect(url, max_size=None, ping_interval=None, open_timeout=10, ssl=ssl_context, compression=None)
        return WebSocketChannel(ws, "coordinator")

    async def _serve_data(self):
        import websockets

        async def handler(ws):
            plan = self._data_plans.pop(id(ws), None)
            if plan == PROBE_PLAN:  # a peer timing this link: answers leave through this worker's own (shaped) link
                await self._echo_loop(self._shape(WebSocketChannel(ws)))
            elif plan is not None:
                await self._data_loop(WebSocketChannel(ws), plan)

        # Nothing is read from a peer before its handshake names a plan this worker holds and
        # presents that stage's secret; only then is its frame limit raised to the plan's.
        self._data_plans: dict[int, int] = {}
        self._data_refusals = limits.RateLimiter(rate_per_s=2.0, burst=20)
        server_tls = None
        if self.s.tls_fingerprint:  # a cluster on TLS: activations go over wss too, with this worker's own certificate
            from ..net import tls

            cert, key = tls.make_self_signed(self.cache.root / ".tls", ("127.0.0.1", "localhost", self.s.data_host,
                                                                        self.s.advertise_host or self.s.data_host))
            server_tls, self.data_fingerprint = tls.server_context(cert, key), tls.fingerprint_pem(cert.read_text())
        # compression=None here and on every connection: activations and KV are float tensors that
        # permessage-deflate (the library default) cannot shrink, and it ran at 5 MB/s on a loaded core.
        server = await websockets.serve(handler, self.s.data_host, self.s.data_port, max_size=limits.HEADER_SLACK_BYTES, compression=None,
                                        ping_interval=None, process_request=self._authorize_data, ssl=server_tls,
                                        close_timeout=1)  # a peer cut for an oversized frame is dropped, not drained
        port = server.sockets[0].getsockname()[1]
        self.data_url = f"{'wss' if server_tls else 'ws'}://{self.s.advertise_host or self.s.data_host}:{port}"
        return server

    async def _coordinator_tls(self):
        """The client TLS context for the coordinator: its certificate, checked against the
        pinned fingerprint once, then trusted for the control channel and file downloads."""
        if self._tls_coordinator is None:
            from urllib.parse import urlsplit

            from ..net import tls

            if not self.s.tls_fingerprint:
                raise ValueError("the coordinator serves TLS: start the worker with --tls-fingerprint (printed by serve)")
            where = urlsplit(self.s.coordinator)
            self._tls_coordinator = await asyncio.get_running_loop().run_in_executor(
                None, tls.pinned_context, where.hostname, where.port or 443, self.s.tls_fingerprint)
            self.cache.ssl_context = self._tls_coordinator
        return self._tls_coordinator

    async def _peer_tls(self, url: str, fingerprint: str | None):
        """TLS for a wss data port: pinned when the coordinator named its certificate, else
        encrypted only (the stage secret still decides who may send)."""
        from urllib.parse import urlsplit

        from ..net import tls

        if not fingerprint:
            return tls.unpinned_context()
        key = f"{url}|{fingerprint}"
        if key not in self._tls_peers:
            where = urlsplit(url)
            self._tls_peers[key] = await asyncio.get_running_loop().run_in_executor(None, tls.pinned_context, where.hostname, where.port,
                                                                                    fingerprint)
        return self._tls_peers[key]

    def _authorize_data(self, connection, request):
        """Handshake check of the data port: the plan's stage secret, else 401 (or 429 once an
        address has been refused too often); on success the frame limit becomes the plan's."""
        peer = str((connection.remote_address or ("?",))[0])
        slot = None
        try:
            plan = int(request.headers.get(auth.PLAN_HEADER, ""))
            slot = self.slots.get(plan)
        except ValueError:
            plan = None
        if plan == PROBE_PLAN and auth.bearer_matches(request.headers.get("Authorization"), self._probe_secret):
            connection.protocol.max_message_size = PEER_FRAME_LIMIT
            self._data_plans[id(connection)] = PROBE_PLAN
            return None
        if slot is not None and (slot.secret is None or auth.bearer_matches(request.headers.get("Authorization"), slot.secret)):
            connection.protocol.max_message_size = slot.frame_limit
            self._data_plans[id(connection)] = slot.plan
            return None
        if not self._data_refusals.allow(peer, time.monotonic()):
            return connection.respond(429, "too many refused connections\n")
        log.warning("data port: refused %s (no valid credentials for a plan this worker holds)", peer)
        return connection.respond(401, "data port: this stage's credentials are required\n")

    def _data_secret(self, url: str, plan: int, given: str | None) -> str | None:
        """The secret of the stage at ``url`` for ``plan``: as issued by the coordinator, else
        derived from the join token, else none (a cluster without a join token is open)."""
        if given:
            return given
        return auth.derived_secret(self.s.join_token, url, plan) if self.s.join_token and url else None

    def _shape(self, channel: Channel) -> Channel:
        return ShapedChannel(channel, self.link) if self.link else channel

    # -- receiving --------------------------------------------------------------------------
    async def _control_loop(self) -> bool:
        """Handle control frames; True on a final bye. A coordinator silent for longer than
        ``silence_s`` (it pings every half second) is taken as a dead connection."""
        while True:
            try:
                raw = await asyncio.wait_for(self.control.recv(), timeout=self.s.silence_s)
            except ChannelClosed:
                log.warning("the coordinator closed the control channel")
                return False
            except asyncio.TimeoutError:
                log.warning("nothing from the coordinator for %.0f s", self.s.silence_s)
                return False
            try:
                msg = decode(raw)
            except ProtocolError as exc:
                log.warning("bad frame from coordinator: %s", exc)
                continue
            if msg.type is T.BYE:
                # A bye is final only when it says so (a coordinator leaving for good); a plain one
                # is a coordinator stopping, perhaps to restart: come back when it is there again.
                log.warning("the coordinator said bye%s", " (final)" if msg.get("final") else "")
                return bool(msg.get("final"))
            try:  # a reply (a PONG) that cannot leave for this long: the connection is dead
                await asyncio.wait_for(self._handle(msg), timeout=self.s.silence_s)
            except asyncio.TimeoutError:
                log.warning("could not send to the coordinator for %.0f s", self.s.silence_s)
                return False

    async def _data_loop(self, channel: Channel, plan: int) -> None:
        """Frames from the authenticated predecessor (or KV mover) of ``plan``: only FORWARD
        and KV, and only for that plan."""
        while True:
            try:
                raw = await channel.recv()
            except ChannelClosed:
                return
            try:
                msg = decode(raw)
                if msg.type not in (T.FORWARD, T.KV):
                    raise ProtocolError(f"{msg.type.value} is not accepted on the data port")
                if msg.get("plan") != plan:
                    raise ProtocolError(f"frame for plan {msg.get('plan')!r} on a connection for plan {plan}")
            except ProtocolError as exc:
                log.warning("rejected frame from %s: %s", channel.peer, exc)
                try:
                    await channel.send(error_frame(str(exc)))
                    await channel.close("protocol error")
                except ChannelClosed:
                    pass
                return
            await self._handle(msg)

    async def _echo_loop(self, channel: Channel) -> None:
        """A peer probing this link (authenticated with the probe secret): each ``probe`` frame
        of kind ``echo`` is answered with an empty ``probed`` at once; anything else ends it."""
        while True:
            try:
                msg = decode(await channel.recv())
                if msg.type is not T.PROBE or msg.get("kind") != "echo":
                    raise ProtocolError(f"{msg.type.value} is not accepted on a probe connection")
                await channel.send(encode(Message(T.PROBED, {"probe": msg.get("probe"), "ok": True})))
            except ChannelClosed:
                return
            except ProtocolError as exc:
                log.warning("rejected probe frame from %s: %s", channel.peer, exc)
                try:
                    await channel.close("protocol error")
                except ChannelClosed:
                    pass
                return

    async def _measure_peer(self, url: str, secret: str | None, fingerprint: str | None, most_bytes: int) -> tuple[float, float]:
        """Time the data-port path to the worker at ``url``, as activations travel it (this
        worker's shaping included): ``PEER_PINGS`` empty round trips, then two timed transfers."""
        import websockets

        ws = await websockets.connect(url, max_size=limits.HEADER_SLACK_BYTES, ping_interval=None, open_timeout=5, compression=None,
                                      additional_headers=auth.data_headers(secret, PROBE_PLAN),
                                      ssl=await self._peer_tls(url, fingerprint) if url.startswith("wss://") else None)
        channel = self._shape(WebSocketChannel(ws, url))
        count = iter(range(1 << 30))

        async def round_trip(nbytes: int) -> float:
            probe = next(count)
            tensors = {"payload": incompressible(nbytes)} if nbytes else {}
            frame = encode(Message(T.PROBE, {"probe": probe, "kind": "echo"}, tensors))
            t0 = time.perf_counter()
            await channel.send(frame)
            reply = decode(await asyncio.wait_for(channel.recv(), PEER_PROBE_TIMEOUT_S))
            if reply.type is not T.PROBED or reply.get("probe") != probe:
                raise ProtocolError(f"peer answered {reply.type.value} to a probe")
            return time.perf_counter() - t0

        try:
            pings = [await round_trip(0) for _ in range(PEER_PINGS)]
            small = min([await round_trip(PEER_SMALL_BYTES) for _ in range(2)])
            rough = PEER_SMALL_BYTES / max(small - min(pings), 1e-6)
            large_bytes = int(min(max(rough * PEER_TRANSFER_S, 4 * PEER_SMALL_BYTES), most_bytes, PEER_FRAME_LIMIT - limits.HEADER_SLACK_BYTES))
            large = min([await round_trip(large_bytes) for _ in range(2)])
            return peer_link(pings, PEER_SMALL_BYTES, small, large_bytes, large)
        finally:
            try:
                await asyncio.wait_for(channel.close(), timeout=1.0)
            except (ChannelClosed, OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException):
                pass

    async def _handle(self, msg: Message) -> None:
        if msg.type is T.FORWARD or msg.type is T.KV:
            await self.queue.put(msg)
        elif msg.type is T.PING:
            await self._send_control(Message(T.PONG, {"t": msg.get("t"), "kv_bytes": self._kv_bytes(), "queue": self.queue.qsize(),
                                                      "busy_s": self.busy_s, "computed": self.computed,
                                                      "fetched_bytes": self.fetched_bytes, "joins": self.joins,
                                                      "loop_lag_s": round(self.loop_lag_s, 3),
                                                      "prefix_bytes": sum(s.prefix.nbytes for s in self.slots.values())}))
            self.loop_lag_s = 0.0
        elif msg.type is T.LOAD:
            self._spawn(self._load(msg))
        elif msg.type is T.ACTIVATE:
            keep = set(msg["keep"])
            for plan in [p for p in self.slots if p not in keep]:
                del self.slots[plan]
            self._prune_sessions()
        elif msg.type is T.DROP:
            await self.queue.put(msg)  # in order with the forwards: never while that sequence computes
        elif msg.type is T.PROBE:
            self._spawn(self._probe(msg))
        elif msg.type is T.KV_EXPORT:
            await self.queue.put(msg)
        elif msg.type is T.EMULATE:
            self.slowdown = SlowdownPolicy(float(msg["slowdown"]))
            self.s.slowdown = float(msg["slowdown"])
        elif msg.type is T.ERROR:
            log.warning("coordinator: %s", msg.get("message"))

    # -- loading ----------------------------------------------------------------------------
    async def _load(self, msg: Message) -> None:
        t0 = time.perf_counter()
        plan, start, end = msg["plan"], msg["start"], msg["end"]
        try:
            files = list(msg["files"])
            fetched = 0
            loop = asyncio.get_running_loop()
            headers = {"Authorization": f"Bearer {self.s.join_token}"} if self.s.join_token else {}
            for sha in [msg["graph"], *files]:
                got = await loop.run_in_executor(None, self.cache.fetch, self.s.coordinator, sha, headers)
                fetched += got
                self.fetched_bytes += got
            if fetched:
                log.info("plan %s: downloaded %d bytes (%d in all)", plan, fetched, self.fetched_bytes)
            if msg.get("prefetch"):  # spare plan: hold the files, build nothing yet
                await self._send_control(Message(T.LOADED, {"plan": plan, "ok": True, "prefetched": True, "fetched_bytes": fetched}))
                return
            weight_bytes = sum(self.cache.path(f).stat().st_size for f in files)
            if self.budget:
                in_use = sum(s.weight_bytes for p, s in self.slots.items() if p in msg.get("keep", ()))
                if msg.get("warm"):  # a warm spare may use only what the running stage leaves free
                    in_use = sum({id(s.runner): s.weight_bytes for s in self.slots.values()}.values())
                kv = msg.get("kv_bytes_per_token", 0) * KV_RESERVE_TOKENS
                self.budget.check(weight_bytes + kv, f"units [{start}, {end}) weights + KV for {KV_RESERVE_TOKENS} tokens", in_use)
            if not msg.get("warm") and plan >= 0 and msg["graph"] not in self.warm:
                # The real stage takes the memory a warm spare held (calibration's small ranges,
                # with negative plan ids, leave it: it may be this worker's stage again).
                self.warm.clear()
                self._prune_sessions()
            runner = self.sessions.get(msg["graph"])
            reused = runner is not None
            if runner is None:  # a session already built for this graph (kept range, warm spare) is reused
                runner = await loop.run_in_executor(
                    None, lambda: StageRunner(self.cache.path(msg["graph"]), threads=self.s.threads, max_context=msg.get("max_context"),
                                              spin=spin_by_default(self.s.threads) if self.s.spin is None else self.s.spin,
                                              device=self.device))
                self.sessions[msg["graph"]] = runner
            if msg.get("warm"):
                self.warm = {msg["graph"]}
                self._prune_sessions()
            else:
                hidden = 0 if runner.takes_token_ids else self._hidden_of(runner)
                self.slots[plan] = Slot(plan, start, end, runner, msg["next"], weight_bytes,
                                        secret=self._data_secret(self.data_url, plan, msg.get("data_secret")),
                                        frame_limit=limits.data_frame_limit(int(msg.get("max_context") or 4096), hidden,
                                                                            int(msg.get("kv_bytes_per_token") or 0)),
                                        max_context=msg.get("max_context"))
            reply = {"plan": plan, "ok": True, "load_s": time.perf_counter() - t0, "fetched_bytes": fetched, "weight_bytes": weight_bytes,
                     "reused_session": reused}
            if self.cache.repaired:  # cached files that failed their hash and were fetched again
                reply["repaired"], self.cache.repaired = list(self.cache.repaired), []
        except (MemoryBudgetExceeded, OSError, ValueError, RuntimeError) as exc:
            reply = {"plan": plan, "ok": False, "error": str(exc).splitlines()[0]}
        except Exception as exc:  # onnxruntime raises its own types
            reply = {"plan": plan, "ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        await self._send_control(Message(T.LOADED, reply))

    async def _probe(self, msg: Message) -> None:
        """Time decode steps of a loaded stage, or send a payload back to time the uplink."""
        if msg.get("kind") == "link":
            payload = incompressible(int(msg.get("bytes", 1 << 18)))
            await self._send_control(Message(T.PROBED, {"probe": msg.get("probe"), "ok": True}, {"payload": payload}))
            return
        if msg.get("kind") == "accept":  # peers presenting this secret on plan 0 may time this data port
            secret = msg.get("secret")
            self._probe_secret = secret if isinstance(secret, str) and secret else None
            await self._send_control(Message(T.PROBED, {"probe": msg.get("probe"), "ok": self._probe_secret is not None}))
            return
        if msg.get("kind") == "peer":
            import websockets

            try:
                url = msg.get("url")
                if not (isinstance(url, str) and url.startswith(("ws://", "wss://"))):
                    raise ValueError(f"peer probe: bad url {url!r}"[:200])
                rtt, bandwidth = await self._measure_peer(url, msg.get("secret"), msg.get("fingerprint"),
                                                          int(msg.get("bytes") or 1 << 18))
                reply = {"probe": msg.get("probe"), "ok": True, "rtt_s": rtt, "bandwidth_bytes_per_s": bandwidth}
            except (ChannelClosed, OSError, ValueError, ProtocolError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
                reply = {"probe": msg.get("probe"), "ok": False, "error": (str(exc) or type(exc).__name__).splitlines()[0][:200]}
            await self._send_control(Message(T.PROBED, reply))
            return
        slot = self.slots.get(msg["plan"])
        reps = int(msg.get("reps", 8))
        result = {"probe": msg.get("probe"), "ok": slot is not None}
        if slot is not None:
            loop = asyncio.get_running_loop()
            times = await loop.run_in_executor(self.pool, self._time_slot, slot, reps, int(msg.get("context", 64)))
            result["times"] = [t / self.s.misreport for t in times]
        await self._send_control(Message(T.PROBED, result))

    def _time_slot(self, slot: Slot, reps: int, context: int) -> list[float]:
        runner, seq = slot.runner, f"probe-{time.monotonic_ns()}"
        rng = np.random.default_rng(0)
        make = (lambda n: rng.integers(0, 1000, (1, n))) if runner.takes_token_ids else (
            lambda n: rng.standard_normal((1, n, self._hidden(slot))).astype(np.float32))
        sampling = SamplingBatch.greedy(1) if runner.emits_tokens else None
        times = []
        try:
            runner.run(seq, make(context), sampling)
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.run(seq, make(1), sampling)
                dt = time.perf_counter() - t0
                time.sleep(self.slowdown.extra_wait(dt))
                times.append(time.perf_counter() - t0)
        finally:
            runner.drop(seq)
        return times

    @staticmethod
    def _hidden(slot: Slot) -> int:
        shape = slot.runner.session.get_inputs()[0].shape
        return int(shape[-1])

    @staticmethod
    def _hidden_of(runner: StageRunner) -> int:
        shape = next(i for i in runner.session.get_inputs() if i.name == runner.input_name).shape
        return int(shape[-1]) if isinstance(shape[-1], int) else 0

    # -- computing --------------------------------------------------------------------------
    async def _compute_loop(self) -> None:
        """Run what arrives in order; a forward frame (one lane of sequences) is one batch.

        Two frames waiting here are not merged: run one after the other, their lanes spread
        over the stages again instead of travelling bunched (see ``cluster.batching``)."""
        loop = asyncio.get_running_loop()
        while True:
            msg = await self.queue.get()
            if msg.type is T.FORWARD:
                await self._guarded(msg, self._forward(msg, loop))
            elif msg.type is T.KV_EXPORT:
                try:
                    await self._export_kv(msg)
                except (KeyError, ChannelClosed, ValueError) as exc:
                    await self._send_control(Message(T.LOADED, {"kv_received": msg["move"], "ok": False, "error": str(exc)}))
            elif msg.type is T.KV:
                await self._guarded(msg, self._import_kv(msg))
            elif msg.type is T.DROP:
                for runner in {id(s.runner): s.runner for s in self.slots.values()}.values():
                    runner.drop(msg["seq"])

    async def _guarded(self, msg: Message, work) -> None:
        """Run one unit of work; failures are reported per sequence, never kill the worker."""
        try:
            await work
        except ChannelClosed as exc:
            text, code = f"next hop unreachable: {exc}", ErrorCode.UNREACHABLE
        except (ContextOverflow, KeyError, ValueError, RuntimeError) as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            code = {ContextOverflow: ErrorCode.CONTEXT, KeyError: ErrorCode.NO_STAGE,
                    CorruptInput: ErrorCode.CORRUPT_INPUT, PrefixMiss: ErrorCode.PREFIX_MISS}.get(type(exc), ErrorCode.BAD_INPUT)
        except Exception as exc:  # noqa: BLE001 - onnxruntime errors must not kill the worker
            text, code = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", ErrorCode.INTERNAL
        else:
            return
        await self._report_error(msg, text, code)

    async def _forward(self, msg: Message, loop) -> None:
        if self.s.drop_work:
            return
        plan, batch, x = msg["plan"], list(msg["batch"]), msg.tensors["x"]
        slot = self.slots.get(plan)
        if slot is None:
            raise KeyError(f"worker {self.id} holds no stage for plan {plan}")
        if x.shape[0] != len(batch) or not batch:
            raise ValueError(f"forward frame: x has {x.shape[0]} rows for {len(batch)} sequences")
        if not slot.runner.takes_token_ids:  # a stage checks what its predecessor sent before using it
            hidden = self._hidden_of(slot.runner)
            problem = validate.activation_problem(x, hidden or None, slot.max_context)
            if problem:
                raise CorruptInput(f"plan {plan}: {problem}")
        prefixes = [(item["seq"], entry) for item in batch if (entry := prefix_entry(item)) is not None]
        for seq, entry in prefixes:  # install cached prompt blocks first: the frame starts after them
            await loop.run_in_executor(self.pool, slot.prefix.before, slot.runner, seq, entry)
        for item in batch:  # a frame must start where the sequence's cache ends: a lost frame leaves a hole
            pos = item.get("pos")
            # A stage without decoder layers (embedding or head alone) keeps no KV: nothing to check
            # (and no KV moves to it, so after a switch it has not heard of the sequence).
            if isinstance(pos, int) and slot.runner.layers and pos != slot.runner.length(item["seq"]):
                raise CorruptInput(f"plan {plan}: {item['seq']} holds {slot.runner.length(item['seq'])} positions, "
                                   f"the frame starts at {pos} (a frame was lost)")
        if x.dtype == np.float16:
            x = x.astype(np.float32)
        sampling = None
        if slot.runner.emits_tokens:  # logit controls and logprob requests too (stage_runner.SamplingBatch.from_wire)
            sampling = SamplingBatch.from_wire(batch, slot.runner.vocab)
        seqs = [item["seq"] for item in batch]
        membership = self.joins
        t0 = time.perf_counter()
        if x.shape[1] == 1 and self._step_s.get(id(slot.runner), 0.0) < INLINE_STEP_S:
            # A fast decode step runs on the loop, skipping two thread hand-offs per hop (a
            # heartbeat waits at most one such step). Slow steps and prefills use the thread,
            # so the loop stays free to answer heartbeats.
            out, cpu = self._run_timed(slot.runner, seqs, x, sampling)
        else:
            out, cpu = await loop.run_in_executor(self.pool, self._run_timed, slot.runner, seqs, x, sampling)
        compute = time.perf_counter() - t0
        if x.shape[1] == 1:
            self._step_s[id(slot.runner)] = compute
        for seq, entry in prefixes:
            await loop.run_in_executor(self.pool, slot.prefix.after, slot.runner, seq, entry)
        if self.joins != membership:  # rejoined meanwhile: that step belonged to the previous membership
            return
        extra = self.slowdown.extra_wait(compute, cpu)
        if extra > 0:
            await asyncio.sleep(extra)
        self.busy_s += compute + extra
        self.computed += len(batch)
        elem = 2 if self.s.activation_dtype == "float16" else 4
        fields = {"plan": plan, "batch": batch,
                  "timings": list(msg.get("timings", [])) + [[self.id, (compute + extra) / self.s.misreport, int(x.shape[1]), elem, len(batch)]]}
        if slot.next["kind"] == "coordinator":
            if not all(item.get("partial") for item in batch):  # replay frames before the last: no token wanted
                await self._send_control(Message(T.TOKEN, {**fields, "tokens": [int(t) for t in out], **slot.runner.logprobs_field(batch)}))
            return
        y = out.astype(np.float16) if self.s.activation_dtype == "float16" else out
        if slot.next.get("relay"):
            await self._send_control(Message(T.FORWARD, {**fields, "relay_to": slot.next["id"]}, {"x": y}))
        else:
            await self._send_peer(slot.next["url"], encode(Message(T.FORWARD, fields, {"x": y})), plan,
                                  self._data_secret(slot.next["url"], plan, slot.next.get("secret")), slot.next.get("fingerprint"))

    def _run_timed(self, runner: StageRunner, seqs: list[str], x: np.ndarray, sampling) -> tuple[np.ndarray, float | None]:
        """Run a batch; with one ORT thread (it is the calling one) also return its CPU time."""
        c0 = time.thread_time()
        out = runner.run_batch(seqs, x, sampling)
        return out, (time.thread_time() - c0 if self.s.threads == 1 else None)

    async def _send_peer(self, url: str, frame: bytes, plan: int, secret: str | None, fingerprint: str | None = None) -> None:
        """Send to another worker's data port, one connection per (port, plan), presenting
        that stage's secret; any failure to reach it is ChannelClosed."""
        import websockets

        key = f"{url}#{plan}"
        try:
            channel = self.peers.get(key)
            if channel is None:
                for stale in [k for k in self.peers if int(k.rsplit("#", 1)[1]) not in self.slots and k != key]:
                    self._spawn(self.peers.pop(stale).close())  # plans this worker no longer runs
                ws = await websockets.connect(url, max_size=limits.HEADER_SLACK_BYTES, ping_interval=None, open_timeout=5, compression=None,
                                              additional_headers=auth.data_headers(secret, plan),
                                              ssl=await self._peer_tls(url, fingerprint) if url.startswith("wss://") else None)
                channel = self.peers[key] = self._shape(WebSocketChannel(ws, url))
            await channel.send(frame)
        except (ChannelClosed, OSError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as exc:
            self.peers.pop(key, None)  # a dead peer must not poison later sends
            raise ChannelClosed(f"{url}: {exc}") from None

    async def _export_kv(self, msg: Message) -> None:  # noqa: D401
        """Send a sequence's KV for layers in [start, end) to the worker at ``url``."""
        slot = self.slots[msg["plan"]]

        def pack() -> bytes:  # copies and encodes hundreds of MB for long sequences: off the loop (heartbeats)
            tensors = {k: v for k, v in slot.runner.export_kv(msg["seq"]).items()
                       if msg["start"] <= int(k.split(".")[1]) < msg["end"]}
            return encode(Message(T.KV, {"seq": msg["seq"], "plan": msg["to_plan"], "length": slot.runner.length(msg["seq"]),
                                         "move": msg["move"]}, tensors))

        frame = await asyncio.get_running_loop().run_in_executor(self.pool, pack)
        await self._send_peer(msg["url"], frame, msg["to_plan"], self._data_secret(msg["url"], msg["to_plan"], msg.get("secret")),
                              msg.get("fingerprint"))

    async def _import_kv(self, msg: Message) -> None:
        """Install moved KV, then tell the coordinator (it resumes the sequence only after)."""
        slot = self.slots[msg["plan"]]
        mine = {k: v for k, v in msg.tensors.items() if int(k.split(".")[1]) in slot.runner.layers}
        length = msg.get("length")  # window layers' KV travels trimmed: the length says where it ends
        await asyncio.get_running_loop().run_in_executor(  # a copy into the pool, maybe a regrowth: off the loop
            self.pool, slot.runner.import_kv, msg["seq"], mine, int(length) if isinstance(length, int) else None)
        await self._send_control(Message(T.LOADED, {"kv_received": msg["move"], "plan": msg["plan"], "ok": True,
                                                    "bytes": int(sum(v.nbytes for v in mine.values()))}))

    async def _report_error(self, msg: Message, text: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        # a frame for a plan just replaced is routine during a switch (every frame of a replay hits it)
        log.log(logging.DEBUG if code is ErrorCode.NO_STAGE else logging.WARNING, "%s failed: %s", msg.type.value, text)
        if msg.type is not T.FORWARD:
            return
        batch = msg.get("batch")
        for item in batch if isinstance(batch, list) else [{}]:
            item = item if isinstance(item, dict) else {}
            try:
                await self._send_control(Message(T.ERROR, {"message": text, "code": code.value, "seq": item.get("seq"), "step": item.get("step"),
                                                           "rid": item.get("rid")}))
            except ChannelClosed:
                return

    async def _send_control(self, msg: Message) -> None:
        await self.control.send(encode(msg))

    def _prune_sessions(self) -> None:
        """Keep only sessions a slot uses or the warm spare; the rest give their memory back."""
        used = {id(slot.runner) for slot in self.slots.values()}
        for sha, runner in list(self.sessions.items()):
            if id(runner) not in used and sha not in self.warm:
                del self.sessions[sha]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)
        return task

    def _kv_bytes(self) -> int:
        return sum(s.runner.kv_bytes for s in self.slots.values())


def _default_cache() -> Path:
    if os.environ.get("EDGEPIPE_HOME"):
        return Path(os.environ["EDGEPIPE_HOME"]) / "worker-cache"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgepipe")) / "blobs"


def _gguf_kernel(on_gpu: bool) -> tuple[str | None, str | None]:
    """What the hello says of the GGUF kernel library: ("gguf", None) when it loaded here,
    (None, why) when not (the worker is then sent the MatMulNBits graphs), (None, None) on a GPU
    (its stages run on ONNX Runtime's WebGPU provider, which runs no custom ops)."""
    if on_gpu:
        return None, None
    library = native_library()  # built on first use where bootstrap did not build it
    if library.path is None:
        log.warning("no GGUF kernel library (%s): falling back to the MatMulNBits graphs", library.reason)
        return None, library.reason
    return "gguf", None


def _system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30
