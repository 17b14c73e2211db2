"""``edgepipe serve``: the coordinator's HTTP server plus, as the embedded default, local
worker processes on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field

from ..api.admission import Admission
from ..api.app import create_app
from ..net.limits import control_frame_limit
from .coordinator import Coordinator, CoordinatorSettings


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8420
    workers: int = 2
    worker_threads: int | None = None
    api_key: str | None = None
    join_token: str | None = None
    admin_token: str | None = None  # required by routes that change the cluster (else the API key, else loopback only)
    max_active: int = 16
    max_queue: int = 64
    worker_args: list[str] = field(default_factory=list)  # extra flags for every local worker
    log_level: str = "warning"
    objective: str = "latency"
    tpot_target_ms: float | None = None
    planner: bool = True  # False: split layers in proportion to memory (the exo / llama.cpp rule)
    advertise: bool = True  # announce the coordinator by mDNS
    cluster: str = "edgepipe"  # the name workers look for


def bind_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(256)
    sock.setblocking(False)
    return sock


def spawn_local_workers(url: str, n: int, threads: int | None, join_token: str | None, extra: list[str]) -> list[subprocess.Popen]:
    threads = threads or max(1, (os.cpu_count() or 2) // max(n, 1))
    procs = []
    for i in range(n):
        argv = [sys.executable, "-m", "edgepipe", "worker", "--coordinator", url, "--name", f"local{i + 1}", "--threads", str(threads), *extra]
        if join_token:
            argv += ["--join-token", join_token]
        procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
    return procs


async def run_server(package, settings: ServeSettings, plan_fn=None, on_ready=None) -> None:
    import uvicorn

    sock = bind_socket(settings.host, settings.port)
    port = sock.getsockname()[1]
    if plan_fn is None and settings.planner:
        from ..plan import Objective
        from .planning import PlannerPolicy

        plan_fn = PlannerPolicy(Objective(settings.objective), settings.tpot_target_ms / 1e3 if settings.tpot_target_ms else None)
    coordinator = Coordinator(package, CoordinatorSettings(min_workers=max(1, settings.workers), join_token=settings.join_token), plan_fn=plan_fn)
    app = create_app(coordinator, package, api_key=settings.api_key, join_token=settings.join_token,
                     admission=Admission(settings.max_active, settings.max_queue), admin_token=settings.admin_token)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        print(f"edgepipe: warning: serving on {settings.host} without --api-key: anyone who can reach this port may use the API",
              file=sys.stderr)
    # The largest frame any authenticated worker sends; the worker socket starts each peer far lower.
    ws_max = control_frame_limit(package.manifest.max_context, package.manifest.hidden_size)
    config = uvicorn.Config(app, log_level=settings.log_level, ws_max_size=ws_max, ws_ping_interval=None, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    await coordinator.start()
    advertiser = None
    if settings.advertise:
        from ..net.discovery import Advertiser

        advertiser = Advertiser(settings.host, port, package.manifest.name, bool(settings.join_token), settings.cluster)
        try:
            await advertiser.start()
        except OSError as exc:  # no multicast here: serve anyway
            coordinator.event("mdns_unavailable", error=str(exc))
            advertiser = None
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    procs = spawn_local_workers(f"http://{host}:{port}", settings.workers, settings.worker_threads, settings.join_token, settings.worker_args)
    if on_ready:
        on_ready(port, coordinator)
    try:
        await server.serve(sockets=[sock])
    finally:
        if advertiser:
            await advertiser.stop()
        await coordinator.stop()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
