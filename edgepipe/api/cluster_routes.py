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
    body["admission"] = {"active": app.admission.active, "queued": app.admission.queued, "max_active": app.admission.max_active}
    return JSONResponse(body)


async def plan(request: Request) -> JSONResponse:
    app = request.app.state
    view = getattr(app, "plan_view", None)
    return JSONResponse(view() if view else {"plan": app.coordinator.status()["plan"]})


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


async def metrics(request: Request) -> Response:
    app = request.app.state
    return Response(app.metrics.render(app.coordinator), media_type="text/plain; version=0.0.4")


routes = [
    Route("/v1/cluster/status", status, methods=["GET"]),
    Route("/v1/cluster/plan", plan, methods=["GET"]),
    Route("/v1/cluster/events", events, methods=["GET"]),
    Route("/v1/blobs/{sha}", blob, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    WebSocketRoute("/v1/worker", worker_socket),
]
