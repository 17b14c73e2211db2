"""Cluster views and the worker-facing endpoints: status, plan, events, blobs, worker socket."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from ..net.channel import StarletteChannel
from .errors import APIError

SHA = re.compile(r"[0-9a-f]{64}")


async def status(request: Request) -> JSONResponse:
    app = request.app.state
    body = app.coordinator.status()
    body["tokens_per_s"] = round(app.metrics.live_tokens_per_s(), 2)
    body["admission"] = {"active": app.admission.active, "queued": app.admission.queued, "max_active": app.admission.max_active,
                         "limit": app.admission.limit}
    return JSONResponse(body)


async def plan(request: Request) -> JSONResponse:
    """The live plan: what the planner predicted next to what the cluster measured."""
    coord = request.app.state.coordinator
    dep = coord.active
    if dep is None:
        return JSONResponse({"state": coord.state.value, "plan": None})
    decode = sorted(w for n, w in coord.recent_steps if n == 1)
    measured_stages = []
    for s in dep.stages:
        times = coord.profile.of(s.worker_id).stage_times.get((s.start, s.end))
        measured_stages.append(None if times is None or times.median is None else times.median)
    predicted = dep.predicted or {}
    return JSONResponse({
        "state": coord.state.value, "plan": dep.plan_id, "reason": dep.reason,
        "stages": [{"worker": s.worker_id, "start": s.start, "end": s.end,
                    "predicted_s": (predicted.get("stage_times_s") or [None] * len(dep.stages))[i], "measured_s": measured_stages[i],
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
    return JSONResponse({"events": list(request.app.state.coordinator.events)})


async def blob(request: Request) -> Response:
    sha = request.path_params["sha"]
    app = request.app.state
    if app.join_token and request.headers.get("authorization") != f"Bearer {app.join_token}":
        raise APIError(401, "unit files need the join token", type_="authentication_error", code="invalid_join_token")
    path = app.package.blob(sha) if SHA.fullmatch(sha) else None
    if path is None or not path.is_file():
        raise APIError(404, f"no blob {sha[:70]}", code="blob_not_found")
    return FileResponse(path, media_type="application/octet-stream", headers={"Cache-Control": "public, max-age=31536000, immutable"})


async def worker_socket(ws: WebSocket) -> None:
    await ws.accept()
    await ws.app.state.coordinator.attach(StarletteChannel(ws))


async def rebalance(request: Request) -> JSONResponse:
    """Deploy a given placement now (operators; tests forcing a KV move)."""
    from ..cluster.placement import StageAssignment
    from .openai_routes import read_json

    coord = request.app.state.coordinator
    body = await read_json(request)
    try:
        stages = [StageAssignment(str(s["worker"]), int(s["start"]), int(s["end"])) for s in body.get("stages", [])]
        if not stages or stages[0].start != 0 or stages[-1].end != coord.n_units:
            raise ValueError(f"stages must cover units [0, {coord.n_units})")
        unknown = [s.worker_id for s in stages if s.worker_id not in coord.workers]
        if unknown:
            raise ValueError(f"unknown worker {unknown[0]}")
        dep = await coord.deploy(stages, reason="manual rebalance")
    except (KeyError, TypeError, ValueError) as exc:
        raise APIError(400, f"bad rebalance: {exc}", param="stages") from None
    except RuntimeError as exc:
        raise APIError(409, str(exc), code="plan_failed") from None
    return JSONResponse({"plan": dep.plan_id, "events": [e for e in coord.events if e.get("plan") == dep.plan_id]})


async def emulation(request: Request) -> JSONResponse:
    """Change a worker's emulated slowdown while it runs (labelled emulation; benchmarks)."""
    from ..net.protocol import Message, MessageType
    from .openai_routes import read_json

    coord = request.app.state.coordinator
    worker = coord.workers.get(request.path_params["worker"])
    if worker is None:
        raise APIError(404, f"no worker {request.path_params['worker']}", code="worker_not_found")
    body = await read_json(request)
    factor = body.get("slowdown")
    if not isinstance(factor, (int, float)) or factor < 1:
        raise APIError(400, "'slowdown' must be a number >= 1", param="slowdown")
    await worker.send(Message(MessageType.EMULATE, {"slowdown": float(factor)}))
    worker.hello["emulation"] = {**(worker.hello.get("emulation") or {}), "slowdown": float(factor)}
    coord.event("emulation", worker=worker.id, slowdown=float(factor))
    return JSONResponse({"worker": worker.id, "slowdown": float(factor)})


async def metrics(request: Request) -> Response:
    app = request.app.state
    return Response(app.metrics.render(app.coordinator), media_type="text/plain; version=0.0.4")


routes = [
    Route("/v1/cluster/status", status, methods=["GET"]),
    Route("/v1/cluster/plan", plan, methods=["GET"]),
    Route("/v1/cluster/events", events, methods=["GET"]),
    Route("/v1/cluster/rebalance", rebalance, methods=["POST"]),
    Route("/v1/cluster/workers/{worker}/emulation", emulation, methods=["POST"]),
    Route("/v1/blobs/{sha}", blob, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    WebSocketRoute("/v1/worker", worker_socket),
]
