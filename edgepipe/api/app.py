"""The ASGI application: routes grouped by resource, OpenAI error shapes, optional API key.

Every route is an ``routing.Endpoint`` declared in its resource's module (``ENDPOINTS`` lists
them in order); with ``--api-key`` the middleware lets through only the routes declared open
(or worker-facing, which check the join token themselves): any other path, one that does not
exist included, is a 401 without the key."""

from __future__ import annotations

import time
from typing import Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from . import (browser_routes, cluster_routes, dist_routes, messages_routes, ollama_routes, openai_routes, openapi, page_routes,
               responses_routes)
from .admission import Admission
from ..net.auth import bearer_matches, same_secret
from ..net.limits import EventLog, control_frame_limit, hello_frame_limit
from .errors import APIError
from .metrics import Metrics
from .routing import Endpoint, Guard, guard_of

ENDPOINTS: tuple[Endpoint, ...] = (*page_routes.routes, *openai_routes.routes, *responses_routes.routes, *messages_routes.routes,
                                   *ollama_routes.routes, *openapi.routes, *cluster_routes.routes, *browser_routes.routes,
                                   *dist_routes.routes)


def has_key(scope: Scope, api_key: str) -> bool:
    """``Authorization: Bearer <key>`` or Anthropic's ``x-api-key: <key>``, compared in constant time on the raw bytes (never a 500)."""
    headers = dict(scope.get("headers") or [])
    key = headers.get(b"x-api-key")
    return bearer_matches(headers.get(b"authorization"), api_key) or (key is not None and same_secret(key, api_key.encode("utf-8")))


class APIKeyMiddleware:
    """When a key is set, every request whose route is guarded by it (``Guard.API_KEY``, and any
    path no route declares) must carry it: else a 401 (a WebSocket: closed before it is accepted)."""

    def __init__(self, app: ASGIApp, api_key: str | None, routes: Sequence[BaseRoute] = ()):
        self.app, self.api_key, self.routes = app, api_key, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key and scope["type"] in ("http", "websocket") and guard_of(self.routes, scope) is Guard.API_KEY
                and not has_key(scope, self.api_key)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
                return
            response = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                type_="authentication_error", code="invalid_api_key").response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


MAX_BODY_BYTES = 8 << 20  # a request body beyond this is refused with 413 before it is buffered


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes", code="request_too_large")


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes: at once from ``Content-Length``, or as soon as
    a chunked body passes the limit (the route reading it gets ``BodyTooLarge`` -> 413)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            too_long = declared is not None and int(declared) > self.limit
        except ValueError:
            too_long = False  # the server rejects a malformed length itself
        if too_long:
            await BodyTooLarge(self.limit).response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


def create_app(coordinator, package, api_key: str | None = None, join_token: str | None = None,
               admission: Admission | None = None, metrics: Metrics | None = None, extra_routes: list | None = None,
               admin_token: str | None = None) -> Starlette:
    async def api_error(request, exc: APIError):
        return exc.response()

    async def not_found(request, exc):
        return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def internal_error(request, exc):  # every route answers JSON, even when it breaks
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error", code="internal_error").response()

    async def method_not_allowed(request, exc):
        return APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()

    endpoints = (*ENDPOINTS, *(extra_routes or []))  # extra: Endpoints (a bare Starlette route is guarded by the key)
    routes = [e.route() if isinstance(e, Endpoint) else e for e in endpoints]
    app = Starlette(routes=routes, middleware=[Middleware(BodyLimitMiddleware), Middleware(APIKeyMiddleware, api_key=api_key, routes=routes)],
                    exception_handlers={APIError: api_error, 404: not_found, 405: method_not_allowed, Exception: internal_error})
    s = app.state
    s.coordinator, s.package, s.join_token = coordinator, package, join_token
    s.api_key, s.admin_token = api_key, admin_token
    s.endpoints = endpoints
    if not isinstance(coordinator.events, EventLog):  # bounded per kind: one kind cannot flush the others
        coordinator.events = EventLog(initial=coordinator.events)
    m = package.manifest
    n_files = sum(1 for _ in package.blobs.iterdir()) if package.blobs.is_dir() else 0
    s.worker_gate = cluster_routes.WorkerGate(join_token, hello_frame_limit(n_files), control_frame_limit(m.max_context, m.hidden_size))
    s.started = time.time()
    from ..model.store import alias_of  # a package imported under an alias answers to it too (`smollm2`, `qwen05`)

    from .served import ServedNames

    alias = alias_of(package.manifest.name)
    s.model_names = [package.manifest.name, alias] if alias else [package.manifest.name]
    s.served = ServedNames.of(package.manifest.name, alias, (package.manifest.source or {}).get("path"))
    s.metrics = metrics or Metrics(package.manifest.hidden_size)
    s.admission = admission or Admission()
    s.admission.bind(coordinator)  # its book is the coordinator's ``ClusterState.admission``
    coordinator.on_step = s.metrics.on_step
    return app
