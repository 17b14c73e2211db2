"""Routes declared once: path, handler, methods, who may call it (its guard) and its OpenAPI row.

Every route of the app is an :class:`Endpoint`, written where its handler is. The app builds its
Starlette routes from them (:meth:`Endpoint.route`), the API-key middleware asks
:func:`guard_of` for a request's guard, and ``openapi.py`` documents the endpoints that carry a
:class:`Doc`. Closed by default: a path no endpoint declares (``/v1/embeddings`` in a server
without such a route, a typo) is guarded like any API route, so without the key it is a 401, and
only with the key a 404 that says there is no such route.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

from starlette.routing import BaseRoute, Match, Route, WebSocketRoute
from starlette.types import Scope


class Guard(str, Enum):
    """Who may call a route when the server has an API key (``--api-key``)."""

    API_KEY = "api_key"  # the key, sent as ``Authorization: Bearer`` or ``x-api-key``
    OPEN = "open"  # anyone: the pages a browser opens before it has a key, their assets, health, metrics
    JOIN_TOKEN = "join_token"  # workers, who hold the join token, not the key: the route checks ``--join-token`` itself


@dataclass(frozen=True)
class Doc:
    """A route's row in ``/openapi.json``: what it does and its request and response schemas (pydantic models)."""

    summary: str
    request: type | None = None
    response: type | None = None


@dataclass(frozen=True)
class Endpoint:
    """One route: ``guard`` has no default, so a route cannot be added without saying who may call it."""

    path: str
    handler: Callable
    guard: Guard
    methods: tuple[str, ...] = ("GET",)
    doc: Doc | None = None
    websocket: bool = False

    def route(self) -> BaseRoute:
        if self.websocket:
            return DeclaredWebSocketRoute(self)
        return DeclaredRoute(self)

    @property
    def documented_path(self) -> str:
        """The path as OpenAPI writes it: ``{model:path}`` -> ``{model}``."""
        return re.sub(r"\{(\w+):\w+\}", r"{\1}", self.path)


class DeclaredRoute(Route):
    """A Starlette route that keeps the :class:`Endpoint` it was built from."""

    def __init__(self, declared: Endpoint):
        super().__init__(declared.path, declared.handler, methods=list(declared.methods))
        self.declared = declared


class DeclaredWebSocketRoute(WebSocketRoute):
    def __init__(self, declared: Endpoint):
        super().__init__(declared.path, declared.handler)
        self.declared = declared


def get(path: str, handler: Callable, *, guard: Guard, doc: Doc | None = None) -> Endpoint:
    return Endpoint(path, handler, guard, ("GET",), doc)


def post(path: str, handler: Callable, *, guard: Guard, doc: Doc | None = None) -> Endpoint:
    return Endpoint(path, handler, guard, ("POST",), doc)


def websocket(path: str, handler: Callable, *, guard: Guard) -> Endpoint:
    return Endpoint(path, handler, guard, (), websocket=True)


def guard_of(routes: Sequence[BaseRoute], scope: Scope) -> Guard:
    """The guard of the route this request reaches (the first full match, else the first whose
    path matches with another method, as Starlette's router picks; else the route Starlette
    redirects a path with or without its trailing slash to); a path that no declared route
    matches is guarded by the key."""
    route = _reached(routes, scope)
    if route is None and scope["type"] == "http" and scope.get("path", "/") != "/":
        path = scope["path"]
        route = _reached(routes, {**scope, "path": path[:-1] if path.endswith("/") else path + "/"})
    return Guard.API_KEY if route is None else _declared_guard(route)


def _reached(routes: Sequence[BaseRoute], scope: Scope) -> BaseRoute | None:
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial


def _declared_guard(route: BaseRoute) -> Guard:
    declared = getattr(route, "declared", None)
    return declared.guard if isinstance(declared, Endpoint) else Guard.API_KEY  # a route nobody declared is closed
