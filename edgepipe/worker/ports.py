"""A worker's I/O as ports: everything ``worker.shell`` reaches the world through.

The shell's receive loop, queue, ``_execute``, peers cache and reconnect are the same code in
a real worker and in the simulation; only these ports differ, as TigerBeetle's simulator swaps
only its message bus. ``WorkerPorts.real(settings)`` is what ``edgepipe worker`` runs on
(WebSockets, the data port, HTTP downloads into the blob cache, ONNX Runtime stages,
``asyncio.sleep`` and the monotonic clock); ``cluster.sim_worker`` gives fakes of the same.

Contracts (what the shell relies on, real or fake):

- ``connect()`` -> a ``Channel`` to the coordinator (send/recv/close; ``ChannelClosed`` when it ends).
- ``peers.open(url, plan, secret, fingerprint)`` -> a ``Channel`` to another worker's data port
  for ``plan``; any failure to reach it raises (``ChannelClosed``, ``OSError``, ...).
  ``peers.measure(url, secret, fingerprint, most_bytes)`` -> (RTT s, bytes/s) of that path.
- ``data.start(admit, receive, shape)`` serves this worker's data port: ``admit(plan, check)`` is
  ``core.admit_data`` on the current state, ``receive(typed)`` takes each accepted frame; it
  returns something with ``close()`` (or None), and sets ``data.url`` / ``data.fingerprint``.
- ``blobs.fetch(load)`` -> (bytes downloaded, weight bytes, repaired shas); ``blobs.path(sha)``;
  ``blobs.held()`` (the shas a hello declares).
- ``compute``: build / run / export / import / time a stage and drop or keep its sequences, each
  returning the core event that reports it (``worker.runners`` on ONNX Runtime).
- ``sleep(s)``, ``clock()`` (seconds, for durations), ``draw()`` (a uniform [0, 1) for the
  reconnect jitter), ``lag_tick_s`` (None: no event-loop lag watch).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..net.channel import Channel, ChannelClosed, WebSocketChannel
from ..net.messages import PROBE_PLAN, plan_label
from ..runtime.devices import ExecutionDevice, resolve as resolve_device
from . import connect, links
from .blobcache import BlobCache
from .settings import WorkerSettings, default_cache, gguf_kernel

log = logging.getLogger("edgepipe.worker")


def websocket_errors() -> type[Exception]:
    from websockets.exceptions import WebSocketException  # the submodule itself: ``import websockets`` loads it lazily

    return WebSocketException


@dataclass(frozen=True)
class Host:
    """What the hello says of the machine: the device stages compute on, the kernel library, the pid."""

    device: ExecutionDevice
    native_kernel: str | None = None
    native_kernel_note: str | None = None
    pid: int | None = None

    @classmethod
    def probe(cls, settings: WorkerSettings) -> "Host":
        device = resolve_device(settings.device)
        if device.note and settings.device != "cpu":
            # a GPU asked for by name and not had is a warning; under auto the CPU is a fine answer
            auto = (settings.device or "auto").strip().lower() == "auto"
            (log.info if auto else log.warning)("computing on the CPU: %s", device.note)
        elif device.is_gpu:
            log.info("computing on %s", device.describe())
        kernel, note = gguf_kernel(device.is_gpu)
        return cls(device, kernel, note, os.getpid())


@dataclass
class WorkerPorts:
    host: Host
    connect: Callable[[], Awaitable[Channel]]
    peers: Any  # open / measure
    data: Any  # start / url / fingerprint
    blobs: Any  # fetch / path / held
    compute: Any  # worker.runners.Runners' methods
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    clock: Callable[[], float] = time.monotonic
    draw: Callable[[], float] = random.random
    lag_tick_s: float | None = 0.1
    loopback: Callable[[Any], None] | None = None  # where a stage's own next step goes (None: its compute queue; the simulation's may lose it)

    @classmethod
    def real(cls, settings: WorkerSettings) -> "WorkerPorts":
        from .dataport import DataPort
        from .runners import Runners

        host = Host.probe(settings)
        blobs = Downloads(BlobCache(settings.cache_dir or default_cache()), settings)
        control = WebSocketControl(settings, blobs.cache)
        return cls(host, control.connect, WebSocketPeers(), DataPort(settings, blobs.cache.root), blobs,
                   Runners(settings.threads, settings.spin, host.device))


class DownloadMeter:
    """A line every ``every_s`` seconds while a plan's files download (a large model takes minutes)."""

    def __init__(self, label: str, started: float, every_s: float = 5.0):
        self.label, self.started, self.last, self.every_s, self.done = label, started, started, every_s, 0

    def add(self, nbytes: int) -> None:  # from the download's thread
        self.done += nbytes
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("%s: downloading, %.0f MB so far (%.1f MB/s)", self.label, self.done / 1e6, self.done / (now - self.started) / 1e6)


class Downloads:
    """The blob fetcher: a plan's files from the coordinator over HTTP into the blob cache."""

    def __init__(self, cache: BlobCache, settings: WorkerSettings):
        self.cache, self.s = cache, settings
        self.fetched_total = 0

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.s.join_token}"} if self.s.join_token else {}

    async def fetch(self, load) -> tuple[int, int, tuple[str, ...]]:
        loop = asyncio.get_running_loop()
        fetched, started = 0, time.monotonic()
        meter = DownloadMeter(plan_label(load.plan), started)
        for sha in [load.graph, *load.files]:
            fetched += await loop.run_in_executor(None, self.cache.fetch, self.s.coordinator, sha, self.headers(), 120, meter.add)
        self.fetched_total += fetched
        if fetched:
            took = max(time.monotonic() - started, 1e-6)
            log.info("%s: downloaded %d bytes in %.1f s (%.1f MB/s; %d in all)", plan_label(load.plan), fetched, took,
                     fetched / took / 1e6, self.fetched_total)
        weight_bytes = sum(self.cache.path(f).stat().st_size for f in load.files)
        repaired, self.cache.repaired = tuple(self.cache.repaired), []
        return fetched, weight_bytes, repaired

    def path(self, sha: str):
        return self.cache.path(sha)

    def held(self) -> list[str]:
        return self.cache.held()


class WebSocketPeers:
    """Other workers' data ports over WebSockets (wss with pinned or encrypted-only TLS)."""

    def __init__(self):
        self.tls = links.PeerTls()

    async def open(self, url: str, plan: int, secret: str | None, fingerprint: str | None) -> Channel:
        return await links.open_peer(url, plan, secret, await self.tls.context(url, fingerprint))

    async def measure(self, url: str, secret: str | None, fingerprint: str | None, most_bytes: int, shape=lambda c: c) -> tuple[float, float]:
        channel = shape(await self.open(url, PROBE_PLAN, secret, fingerprint))
        try:
            return await links.measure_peer(channel, most_bytes)
        finally:
            try:
                await asyncio.wait_for(channel.close(), timeout=1.0)
            except (ChannelClosed, OSError, asyncio.TimeoutError, websocket_errors()):
                pass


class WebSocketControl:
    """The control channel: a WebSocket to the coordinator's /v1/worker, its TLS certificate
    pinned when the coordinator serves TLS (then trusted for the file downloads too)."""

    def __init__(self, settings: WorkerSettings, cache: BlobCache):
        self.s, self.cache = settings, cache
        self._tls = None

    async def connect(self) -> Channel:
        import websockets

        url = connect.control_url(self.s.coordinator)
        ssl_context = await self._coordinator_tls() if url.startswith("wss://") else None
        ws = await websockets.connect(url, max_size=None, ping_interval=None, open_timeout=10, ssl=ssl_context, compression=None)
        return WebSocketChannel(ws, "coordinator")

    async def _coordinator_tls(self):
        """The client TLS context for the coordinator: its certificate, checked against the
        pinned fingerprint once, then trusted for the control channel and file downloads."""
        if self._tls is None:
            from urllib.parse import urlsplit

            from ..net import tls

            where = urlsplit(self.s.coordinator)
            host, port, loop = where.hostname, where.port or 443, asyncio.get_running_loop()
            try:
                if not self.s.tls_fingerprint:
                    await loop.run_in_executor(None, tls.server_certificate, host, port)
                    raise connect.CannotJoin(f"{where.netloc} serves TLS: start the worker with --tls-fingerprint "
                                             f"(the sha256 `serve --tls` prints) to pin its certificate")
                self._tls = await loop.run_in_executor(None, tls.pinned_context, host, port, self.s.tls_fingerprint)
            except ssl.SSLError:  # it answered, but not in TLS: say what it does speak
                if await loop.run_in_executor(None, tls.answers_plain_http, host, port):
                    raise connect.CannotJoin(connect.plain_http_instead(self.s.coordinator)) from None
                raise
            self.cache.ssl_context = self._tls
        return self._tls
