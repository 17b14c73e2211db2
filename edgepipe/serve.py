"""``edgepipe serve``: the coordinator's HTTP server plus, as the embedded default, local
worker processes on loopback, supervised: one that exits is started again (with backoff), and
all are stopped when serve stops (or dies: they get SIGTERM with their parent on Linux).

Stopping (Ctrl-C or SIGTERM, :class:`StoppingServer`): one line, the open requests end with an
error (a stream with its API's error event), the local workers are stopped, never restarted (they
run in process groups of their own, so a terminal's Ctrl-C reaches serve only), and only then
does uvicorn close the connections. ``run_server`` returns the signal that stopped it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .api.admission import Admission
from .api.app import create_app
from .net.limits import control_frame_limit
from .cluster.shells.coordinator import Coordinator, CoordinatorSettings
from .cluster.state.events import NoteKind
from .cluster.shells.speculation import build_speculation


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8420
    workers: int = 2
    worker_threads: int | None = None
    api_key: str | None = None
    join_token: str | None = None
    data_secrets: str = "issued"  # "derived": data-port secrets from the join token (see net.auth)
    admin_token: str | None = None  # required by routes that change the cluster (else the API key, else loopback only)
    tls: bool = False  # serve https/wss with tls_cert/tls_key, or a self-signed certificate made once in tls_dir
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_dir: str | None = None
    tls_fingerprint: str | None = None  # set when serving: sha256 of the certificate, for workers to pin
    max_active: int = 16
    max_queue: int = 64
    step_timeout_s: float = 60.0
    capacity_wait_s: float = 30.0  # a request waits this long for workers that can hold the model, then 503
    calibration_file: str | None = None  # device calibrations kept across restarts
    worker_args: list[str] = field(default_factory=list)  # extra flags for every local worker
    log_level: str = "warning"
    objective: str = "latency"
    tpot_target_ms: float | None = None
    planner: bool = True  # False: split layers in proportion to memory (the exo / llama.cpp rule)
    advertise: bool = True  # announce the coordinator by mDNS
    cluster: str = "edgepipe"  # the name workers look for
    batch_invariant: bool = False  # a sequence gets the same bits alone as batched (costs lone-stream speed)
    local_device: str = "auto"  # where the first local worker computes (a GPU when found); the others use the CPU
    speculative: str | None = None  # speculative decoding: "ngram" (prompt lookup), a draft model with the same tokenizer, or "ngram+MODEL"
    draft_k: int = 8  # most drafted tokens per verify pass (fewer while the target rejects them)
    draft_threads: int | None = None  # the draft model's threads in this process
    draft_on: str = "auto"  # where the draft model runs: "auto" (cheapest measured site), "coordinator", "workers" (a drafter worker)
    draft_length: str = "timed"  # "timed": k from measured costs (0 where plain is faster) | "acceptance": from the acceptance rate alone
    verify_form: bool = False  # stages run the verify form and a lost sequence is rebuilt by one prefill (experimental)
    prefix_cache_positions: int = 4096  # KV positions of cached prompt prefixes per stage (0: no prefix cache)
    kv_checkpoint_tokens: int = 32  # copy live sequences' KV to the spare plan every this many tokens (0: off)
    direct_steps: int = 8  # a one-stage plan's stage feeds itself up to this many decode steps (cluster.direct; 0: off)
    variant_disk_bytes: int = 4 << 30  # what the browser variants (a tab's fp32 units) may add to the package on disk


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


log = logging.getLogger("edgepipe.serve")
RESTART_FIRST_S, RESTART_CAP_S = 0.5, 10.0  # backoff between restarts of a local worker that keeps exiting
HEALTHY_AFTER_S = 30.0  # a worker that ran this long before exiting is restarted at once


def restart_delay(quick_exits: int) -> float:
    """Seconds to wait before restarting a local worker that exited ``quick_exits`` times in a
    row soon after starting (0: it had run a while, restart now)."""
    return 0.0 if quick_exits <= 0 else min(RESTART_CAP_S, RESTART_FIRST_S * 2 ** (quick_exits - 1))


def _parent_death_signal():
    """A function for the child (between fork and exec) asking for SIGTERM when its parent dies;
    resolved here, in the parent, so the child calls into libc only (no loader locks)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class LocalWorkers:
    """The worker processes serve started on this machine, kept running until ``stop``.

    The join token travels in the environment (``EDGEPIPE_JOIN_TOKEN``), never in argv where
    any local user could read it."""

    def __init__(self, url: str, n: int, threads: int | None, join_token: str | None, extra: list[str], on_event=None,
                 first_device: str = "cpu"):
        self.threads = threads or max(1, (os.cpu_count() or 2) // max(n, 1))
        self.url, self.extra, self.on_event = url, list(extra), on_event or (lambda kind, **fields: None)
        self.first_device = first_device
        self.env = {k: v for k, v in os.environ.items() if k != "EDGEPIPE_JOIN_TOKEN"}
        if join_token:
            self.env["EDGEPIPE_JOIN_TOKEN"] = join_token
        self._preexec = _parent_death_signal()
        self.names = [f"local{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = [self._spawn(name) for name in self.names]
        self.started = [time.monotonic()] * n
        self.quick_exits = [0] * n
        self.restarts = [0] * n
        self._stopping = False

    def _spawn(self, name: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "edgepipe", "worker", "--coordinator", self.url, "--name", name, "--threads", str(self.threads),
                "--no-spin",  # they share this machine with the coordinator (and maybe more workers or a tab): none spins
                # one machine offers its GPU (to the first) and its CPU (to the rest) as devices of their own
                "--device", self.first_device if name == self.names[0] else "cpu",
                *self.extra]
        # A group of its own: a terminal's Ctrl-C goes to serve, which stops its workers itself
        # (they would otherwise exit with it and be restarted while serve is still stopping).
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=self.env, preexec_fn=self._preexec, process_group=0)

    async def supervise(self, poll_s: float = 0.25) -> None:
        """Restart any worker that exits, after ``restart_delay`` (runs until cancelled)."""
        due: dict[int, float] = {}
        while not self._stopping:
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if i not in due and proc.poll() is not None:
                    lived = now - self.started[i]
                    self.quick_exits[i] = 0 if lived >= HEALTHY_AFTER_S else self.quick_exits[i] + 1
                    due[i] = now + restart_delay(self.quick_exits[i])
                    log.warning("local worker %s (pid %d) exited with %s after %.1f s; restarting in %.1f s",
                                self.names[i], proc.pid, proc.returncode, lived, due[i] - now)
                if i in due and now >= due[i] and not self._stopping:
                    del due[i]
                    old = proc
                    self.procs[i] = self._spawn(self.names[i])
                    self.started[i] = now
                    self.restarts[i] += 1
                    self.on_event(NoteKind.WORKER_RESTARTED, name=self.names[i], pid=self.procs[i].pid, old_pid=old.pid,
                                  exit_code=old.returncode, restarts=self.restarts[i])
            await asyncio.sleep(poll_s)

    def terminate(self) -> int:
        """SIGTERM every running worker, restarting none from now on; the number signalled."""
        self._stopping = True
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        return len(running)

    async def exited(self, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait (without holding the loop) until every worker process has exited; False on timeout."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    def stop(self, timeout: float = 5.0) -> None:
        self.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class ProgressLine:
    """A variant build (``cluster.variants.BuildProgress``) as one line on ``stream``: redrawn in
    place on a terminal, else written when the build starts and when it ends."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def __call__(self, progress) -> None:
        text = f"edgepipe: {progress.line()}"
        if self.tty:
            self.stream.write(f"\r\033[K{text}" + ("" if progress.status == "building" else "\n"))
        elif progress.status != "building" or progress.done == 0:
            self.stream.write(text + "\n")
        self.stream.flush()


def stopping_server(config, on_stop):
    """A uvicorn server that, at the first SIGINT or SIGTERM, awaits ``on_stop(signal)`` before
    closing the connections (so the open streams can end with their error event), and keeps the
    signal in ``stopped_by`` instead of raising it again once stopped (uvicorn does, and asyncio's
    runner then cancels the cleanup that follows ``serve``)."""
    import threading

    import uvicorn

    class StoppingServer(uvicorn.Server):
        stopped_by: int | None = None

        def handle_exit(self, sig: int, frame) -> None:
            if self.stopped_by is None:
                self.stopped_by = sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None) -> None:
            if self.stopped_by is not None:
                await on_stop(self.stopped_by)
            await super().shutdown(sockets)

    return StoppingServer(config)


async def run_server(package, settings: ServeSettings, plan_fn=None, on_ready=None) -> int | None:
    """Serve until stopped; the signal that stopped it (None: stopped otherwise). The listening
    socket is closed however it ends: uvicorn closes it only after a shutdown of its own, not when
    the serving task is cancelled or the setup before it fails (the port stayed open, accepting
    into its backlog, until the loop closed)."""
    sock = bind_socket(settings.host, settings.port)
    servers: list = []  # the asyncio servers uvicorn made on ``sock``, closed with it
    try:
        return await _serve_on(sock, servers, package, settings, plan_fn, on_ready)
    finally:
        for listening in servers:
            listening.close()  # stops accepting (the loop's reader on the socket goes) and closes it
        sock.close()


async def _serve_on(sock: socket.socket, servers: list, package, settings: ServeSettings, plan_fn, on_ready) -> int | None:
    port = sock.getsockname()[1]
    if plan_fn is None and settings.planner:
        from .plan import Objective
        from .cluster.rules.planning import PlannerPolicy

        plan_fn = PlannerPolicy(Objective(settings.objective), settings.tpot_target_ms / 1e3 if settings.tpot_target_ms else None)
    coordinator = Coordinator(package, CoordinatorSettings(min_workers=max(1, settings.workers), join_token=settings.join_token,
                                                                 issue_data_secrets=settings.data_secrets != "derived",
                                                                 step_timeout_s=settings.step_timeout_s,
                                                                 capacity_wait_s=settings.capacity_wait_s,
                                                                 calibration_file=settings.calibration_file,
                                                                 batch_invariant=settings.batch_invariant,
                                                                 speculative=settings.speculative is not None or settings.verify_form,
                                                                 replay_in_one_prefill=settings.verify_form,
                                                                 prefix_cache_positions=settings.prefix_cache_positions,
                                                                 kv_checkpoint_tokens=settings.kv_checkpoint_tokens,
                                                                 direct_steps=settings.direct_steps,
                                                                 variant_disk_bytes=settings.variant_disk_bytes), plan_fn=plan_fn,
                              speculation=build_speculation(settings.speculative, package, settings.draft_k, settings.draft_threads,
                                                            timed=settings.draft_length == "timed")
                              if settings.speculative else None)
    coordinator.calibrator.variants.on_progress = ProgressLine(sys.stderr)  # a tab's variant build: one terminal line
    if coordinator.drafting is not None and settings.draft_on != "auto":
        coordinator.drafting.placed.pinned = settings.draft_on
    app = create_app(coordinator, package, api_key=settings.api_key, join_token=settings.join_token,
                     admission=Admission(settings.max_active, settings.max_queue), admin_token=settings.admin_token)
    from .net.discovery import address_for_others, loopback_only

    beyond_loopback = not loopback_only(settings.host)
    if beyond_loopback and not settings.api_key:
        print(f"edgepipe: warning: serving on {settings.host} without --api-key: anyone who can reach this port may use the API",
              file=sys.stderr)
    if beyond_loopback and not settings.join_token:
        print(f"edgepipe: warning: serving on {settings.host} without --join-token: any machine that can reach this port may join "
              f"as a worker and see the prompts it computes", file=sys.stderr)
    # The largest frame any authenticated worker sends; the worker socket starts each peer far lower.
    ws_max = control_frame_limit(package.manifest.max_context, package.manifest.hidden_size)
    tls_files = {}
    if settings.tls or settings.tls_cert:
        from pathlib import Path

        from .net import tls

        cert, key = ((Path(settings.tls_cert), Path(settings.tls_key or settings.tls_cert)) if settings.tls_cert else
                     tls.make_self_signed(Path(settings.tls_dir or "."), ("127.0.0.1", "localhost", settings.host)))
        tls_files = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
        settings.tls_fingerprint = tls.fingerprint_pem(cert.read_text())
        os.environ["EDGEPIPE_TLS_FINGERPRINT"] = settings.tls_fingerprint  # local workers pin it (environment, like the token)
    import uvicorn

    config = uvicorn.Config(app, log_level=settings.log_level, ws_max_size=ws_max, ws_ping_interval=None, ws_per_message_deflate=False, timeout_graceful_shutdown=2,
                            **tls_files)
    local: LocalWorkers | None = None

    async def on_stop(sig: int) -> None:
        open_requests = coordinator.requests_in_flight
        coordinator.halt(f"the server is stopping ({signal.Signals(sig).name})")  # a stream ends with its error event
        stopped = local.terminate() if local is not None else 0
        ended = f"; {open_requests} open request{'s' * (open_requests != 1)} ended with an error" if open_requests else ""
        workers = f" {stopped} local worker{'s' * (stopped != 1)}" if stopped else ""
        print(f"edgepipe: {signal.Signals(sig).name}: stopping{workers}{ended}", file=sys.stderr, flush=True)
        if local is not None:  # gone before the coordinator's bye, which they would answer by reconnecting
            await local.exited(timeout=3.0)

    server = stopping_server(config, on_stop)
    # The tokenizer loads lazily; building it inside the first request's handler held the event
    # loop for seconds on a busy machine, long enough for every worker to look silent.
    await asyncio.get_running_loop().run_in_executor(None, lambda: package.tokenizer)
    await coordinator.start()
    advertiser = None
    if settings.advertise and not beyond_loopback:
        print(f"edgepipe: listening on {settings.host} (loopback) only: not announced by mDNS and no other machine can join "
              f"(--host 0.0.0.0 opens it to the network)", file=sys.stderr)
    if settings.advertise and beyond_loopback:
        from .net.discovery import Advertiser

        advertiser = Advertiser(settings.host, port, package.manifest.name, bool(settings.join_token), settings.cluster)
        try:
            await advertiser.start()
        except OSError as exc:  # no multicast here: serve anyway
            coordinator.event(NoteKind.MDNS_UNAVAILABLE, error=str(exc))
            advertiser = None
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    local = LocalWorkers(f"{'https' if tls_files else 'http'}://{host}:{port}", settings.workers, settings.worker_threads, settings.join_token, settings.worker_args,
                         on_event=coordinator.event, first_device=settings.local_device)
    supervisor = asyncio.create_task(local.supervise())
    if on_ready:
        on_ready(port, coordinator)
    joining = None
    if beyond_loopback:  # the pip and worker lines for another machine, once the wheel it installs is built
        from .api.dist_routes import print_join_commands

        joining = asyncio.create_task(print_join_commands(app.state, f"{'https' if tls_files else 'http'}://{address_for_others(settings.host)}:{port}",
                                                          settings.join_token, settings.tls_fingerprint))
    try:
        await server.serve(sockets=[sock])
    finally:
        servers.extend(getattr(server, "servers", ()))
        supervisor.cancel()
        if joining is not None:
            joining.cancel()
        local._stopping = True
        if advertiser:
            await advertiser.stop()
        if not coordinator.stopped:
            await coordinator.stop()
        local.stop()
    return server.stopped_by
