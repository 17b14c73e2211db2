"""Cluster views and the worker-facing endpoints: status, plan, events, blobs, worker socket.

Routes that change the cluster (rebalance, emulation) are privileged (:func:`require_admin`);
the worker socket reads one small hello before anything else (:func:`worker_socket`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import re
import time

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.websockets import WebSocket

from ..cluster.state.events import NoteKind
from ..cluster.shells.narrate import describe
from ..net import auth, limits
from ..net.channel import ChannelClosed, StarletteChannel
from ..net.messages import parse
from ..net.protocol import MessageType, ProtocolError, decode, error_frame
from .errors import APIError
from .routing import Guard, get, post, websocket

SHA = re.compile(r"[0-9a-f]{64}")
MAX_SLOWDOWN = 1000.0  # emulated slowdown factors beyond this are typing mistakes


async def status(request: Request) -> JSONResponse:
    app = request.app.state
    body = app.coordinator.status()
    body["tokens_per_s"] = round(app.metrics.live_tokens_per_s(), 2)
    ttft = app.metrics.recent_ttft_s()
    body["ttft_s"] = None if ttft is None else round(ttft, 4)
    body["admission"] = {"active": app.admission.active, "queued": app.admission.queued, "max_active": app.admission.max_active,
                         "limit": app.admission.limit}
    return JSONResponse(body)


async def plan(request: Request) -> JSONResponse:
    """The live plan: what the planner predicted next to what the cluster measured."""
    from ..cluster.shells.views import replica_fields

    coord = request.app.state.coordinator
    dep = coord.active
    if dep is None:
        return JSONResponse({"state": coord.state.value, "plan": None})
    decode = sorted(w for n, w in coord.recent_steps if n == 1)
    measured_stages = []
    group_of = {s.worker_id: g for g, group in enumerate(dep.groups) for s in group}  # the planner prices a stage per group
    for s in dep.stages:
        times = coord.profile.of(s.worker_id).stage_times.get((s.start, s.end))
        measured_stages.append(None if times is None or times.median is None else times.median)
    predicted = dep.predicted or {}
    return JSONResponse({
        "state": coord.state.value, "plan": dep.plan_id, "reason": dep.reason,
        "stages": [{"worker": s.worker_id, "start": s.start, "end": s.end,
                    "precision": coord.deployer.precision(s.worker_id) or coord.manifest.precision,
                    "predicted_s": (predicted.get("stage_times_s") or [None] * len(dep.groups))[group_of[s.worker_id]], "measured_s": measured_stages[i],
                    **replica_fields(dep, coord.cluster.requests, s.worker_id),
                    "speed": coord.profile.of(s.worker_id).speed, "overhead_s": coord.profile.of(s.worker_id).overhead_s}
                   for i, s in enumerate(dep.stages)],
        "predicted": predicted,
        "running_predicted": coord.running_prediction,
        "profiles": {wid: {"speed": m.speed, "overhead_s": m.overhead_s, "rtt_s": coord.profile.link_of(wid)[0],
                           "uplink_bytes_per_s": coord.profile.link_of(wid)[1]} for wid, m in coord.profile.devices.items()},
        "measured": {"tpot_s": decode[len(decode) // 2] if decode else None, "decode_steps": len(decode)},
        "spare": [[s.worker_id, s.start, s.end] for s in coord.spare] if coord.spare else None,
    })


async def events(request: Request) -> JSONResponse:
    log = request.app.state.coordinator.events
    events = [{**e, "text": describe(e)} for e in log]  # each with its line in words (cluster.narrate)
    return JSONResponse(limits.json_safe({"events": events, "dropped": getattr(log, "dropped", {})}))


async def blob(request: Request) -> Response:
    sha = request.path_params["sha"]
    app = request.app.state
    if app.join_token and not auth.bearer_matches(_raw_header(request.scope, b"authorization"), app.join_token):
        raise APIError(401, "unit files need the join token", type_="authentication_error", code="invalid_join_token")
    path = app.package.blob(sha) if SHA.fullmatch(sha) else None
    drafting = getattr(app.coordinator, "drafting", None)
    if path is not None and not path.is_file() and drafting is not None:  # the draft model's files, for drafter workers
        path = drafting.blob(sha)
    if path is None or not path.is_file():
        raise APIError(404, f"no blob {sha[:70]}", code="blob_not_found")
    return FileResponse(path, media_type="application/octet-stream", headers={"Cache-Control": "public, max-age=31536000, immutable"})


def _raw_header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value
    return None


def _set_frame_limit(ws: WebSocket, max_bytes: int) -> bool:
    """Set the largest frame the server will read from this socket from now on.

    uvicorn parses frames with ``websockets``: a frame whose header announces more than the
    limit is refused (close 1009) before its payload is read. The ASGI ``receive`` callable is
    a method of uvicorn's protocol object, which holds the parser; with another server this
    returns False and the server-wide ``ws_max_size`` is the only limit."""
    protocol = getattr(getattr(ws, "_receive", None), "__self__", None)
    conn = getattr(protocol, "conn", None)
    if conn is not None and hasattr(conn, "max_message_size"):  # websockets-sansio
        conn.max_message_size = max_bytes
        return True
    if protocol is not None and hasattr(protocol, "max_size") and hasattr(protocol, "read_message"):  # legacy websockets
        protocol.max_size = max_bytes
        return True
    return False


class _Replayed:
    """A channel whose first ``recv`` returns the hello already read (the coordinator reads it again)."""

    def __init__(self, inner: StarletteChannel, first: bytes):
        self.inner, self.peer, self._first = inner, inner.peer, first

    async def send(self, frame: bytes) -> None:
        await self.inner.send(frame)

    async def recv(self):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self.inner.recv()

    async def close(self, reason: str = "") -> None:
        await self.inner.close(reason)


class WorkerGate:
    """What a peer must get past before the coordinator sees it: a join rate per address, a
    hello of at most ``hello_limit`` bytes within ``hello_timeout_s``, and the join token
    (constant-time); only then may its frames grow to ``frame_limit``."""

    def __init__(self, join_token: str | None, hello_limit: int, frame_limit: int, hello_timeout_s: float = 5.0,
                 joins_per_s: float = 1.0, join_burst: int = 20):
        self.join_token, self.hello_limit, self.frame_limit, self.hello_timeout_s = join_token, hello_limit, frame_limit, hello_timeout_s
        self.attempts = limits.RateLimiter(joins_per_s, join_burst)
        self.throttled = 0

    def check_hello(self, raw) -> str | None:
        """Why this first frame is not an acceptable hello, or None."""
        if not isinstance(raw, (bytes, bytearray)):
            return "expected a binary hello frame"
        if len(raw) > self.hello_limit:
            return f"hello of {len(raw)} bytes exceeds {self.hello_limit}"
        try:
            hello = decode(raw)
            if hello.type is not MessageType.HELLO:
                return f"expected hello, got {hello.type.value}"
            token = parse(hello).token
        except ProtocolError as exc:
            return f"bad hello: {str(exc)[:160]}"
        if self.join_token and not (isinstance(token, str) and auth.same_secret(token, self.join_token)):
            return "wrong or missing join token" if token else "missing join token"
        return None


async def worker_socket(ws: WebSocket) -> None:
    """Workers' control channel: limits before trust, then the coordinator."""
    app = ws.app.state
    gate: WorkerGate = app.worker_gate
    coord = app.coordinator
    peer = ws.client.host if ws.client else "?"
    if not gate.attempts.allow(peer, time.monotonic()):
        gate.throttled += 1
        if gate.throttled % 100 == 1:  # one event per hundred, not one per attempt
            coord.event(NoteKind.THROTTLED, peer=peer, attempts_refused=gate.throttled)
        if "websocket.http.response" in ws.scope.get("extensions", {}):  # a 429 says "later" (a worker retries; a 403 stops it)
            await ws.send_denial_response(APIError(429, "too many join attempts", code="rate_limited").response())
        else:
            await ws.close(code=1008, reason="too many join attempts")
        return
    _set_frame_limit(ws, gate.hello_limit)
    await ws.accept()
    channel = StarletteChannel(ws)
    try:
        raw = await asyncio.wait_for(channel.recv(), timeout=gate.hello_timeout_s)
        problem = gate.check_hello(raw)
    except asyncio.TimeoutError:
        problem = f"no hello within {gate.hello_timeout_s:g} s"
    except ChannelClosed:  # includes a first frame over the limit: the server closed with 1009
        coord.event(NoteKind.REFUSED, peer=peer, reason=f"closed before a hello (frame limit {gate.hello_limit} bytes)")
        return
    if problem:
        coord.event(NoteKind.REFUSED, peer=peer, reason=problem)
        try:
            await channel.send(error_frame(problem))
        except ChannelClosed:
            pass
        await channel.close(problem)
        return
    _set_frame_limit(ws, gate.frame_limit)
    await coord.attach(_Replayed(channel, bytes(raw)))


def require_admin(request: Request) -> None:
    """Routes that change the cluster: the admin token when one is set, else the API key (the
    middleware has checked it), else only from this machine (loopback)."""
    app = request.app.state
    if getattr(app, "admin_token", None):
        if not auth.bearer_matches(_raw_header(request.scope, b"authorization"), app.admin_token):
            raise APIError(401, "this route changes the cluster: send 'Authorization: Bearer <admin token>'",
                           type_="authentication_error", code="invalid_admin_token")
        return
    if getattr(app, "api_key", None):
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise APIError(403, "this route changes the cluster: without --api-key or --admin-token it is open only from "
                            "the coordinator's own machine", type_="permission_error", code="admin_only")


MAX_PIN_S = 7 * 24 * 3600


async def rebalance(request: Request) -> JSONResponse:
    """Deploy a given placement now (operators; tests forcing a KV move). ``pin_s`` keeps the
    re-planner from replacing it for that long (it still goes if one of its workers is lost)."""
    from ..cluster.state.placement import StageAssignment, check_stages, stage_groups
    from .errors import read_json

    require_admin(request)
    coord = request.app.state.coordinator
    body = await read_json(request)
    try:
        if not isinstance(body.get("stages"), list) or len(body["stages"]) > 1024:
            raise ValueError("'stages' must be a list")
        for s in body["stages"]:
            if not isinstance(s, dict) or not all(isinstance(s.get(k), int) and not isinstance(s.get(k), bool) for k in ("start", "end")):
                raise ValueError("each stage needs integer 'start' and 'end'")
        stages = [StageAssignment(str(s["worker"]), int(s["start"]), int(s["end"])) for s in body.get("stages", [])]
        if not stages or stages[0].start != 0 or stages[-1].end != coord.n_units:
            raise ValueError(f"stages must cover units [0, {coord.n_units})")
        unknown = [s.worker_id for s in stages if s.worker_id not in coord.workers]
        if unknown:
            raise ValueError(f"unknown worker {unknown[0]}")
        check_stages(stages, "the rebalance")  # a stage listed twice with its range: replicas on both workers
        relayed = [s.worker_id for s in stages if coord.workers[s.worker_id].relay]
        if relayed and len(stage_groups(stages)) != len(stages):
            raise ValueError(f"worker {relayed[0]} relays through the coordinator: a plan with replicas needs direct data ports")
    except (KeyError, TypeError, ValueError) as exc:
        raise APIError(400, f"bad rebalance: {exc}", param="stages") from None
    pin_s = body.get("pin_s", 0)
    if isinstance(pin_s, bool) or not isinstance(pin_s, (int, float)) or not 0 <= pin_s <= MAX_PIN_S:
        raise APIError(400, f"bad rebalance: 'pin_s' must be seconds from 0 to {MAX_PIN_S}", param="pin_s")
    try:
        dep = await coord.deploy(stages, reason="manual rebalance", pin_s=float(pin_s))
    except RuntimeError as exc:
        raise APIError(409, str(exc), code="plan_failed") from None
    return JSONResponse(limits.json_safe({"plan": dep.plan_id, "pinned_s": float(pin_s),
                                          "events": [e for e in coord.events if e.get("plan") == dep.plan_id]}))


async def emulation(request: Request) -> JSONResponse:
    """Change a worker's emulated slowdown while it runs (labelled emulation; benchmarks)."""
    from .errors import read_json

    require_admin(request)
    coord = request.app.state.coordinator
    worker = coord.workers.get(request.path_params["worker"])
    if worker is None:
        raise APIError(404, f"no worker {request.path_params['worker'][:64]}", code="worker_not_found")
    body = await read_json(request)
    factor = body.get("slowdown") if isinstance(body, dict) else None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or not 1 <= factor <= MAX_SLOWDOWN:
        raise APIError(400, f"'slowdown' must be a finite number in [1, {MAX_SLOWDOWN:g}]", param="slowdown")
    await coord.set_emulation(worker.id, float(factor))  # sends it and records it in the cluster state
    return JSONResponse({"worker": worker.id, "slowdown": float(factor)})


async def metrics(request: Request) -> Response:
    app = request.app.state
    return Response(app.metrics.render(app.coordinator), media_type="text/plain; version=0.0.4")


routes = [
    get("/v1/cluster/status", status, guard=Guard.API_KEY),
    get("/v1/cluster/plan", plan, guard=Guard.API_KEY),
    get("/v1/cluster/events", events, guard=Guard.API_KEY),
    post("/v1/cluster/rebalance", rebalance, guard=Guard.API_KEY),  # and require_admin
    post("/v1/cluster/workers/{worker}/emulation", emulation, guard=Guard.API_KEY),  # and require_admin
    get("/v1/blobs/{sha}", blob, guard=Guard.JOIN_TOKEN),  # workers fetch unit files with the join token
    get("/metrics", metrics, guard=Guard.OPEN),  # Prometheus scrapes without the key (counters, no content)
    websocket("/v1/worker", worker_socket, guard=Guard.JOIN_TOKEN),  # the hello carries the token (WorkerGate)
]
