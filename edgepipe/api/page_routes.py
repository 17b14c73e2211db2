"""The open pages: the dashboard (``/``), ``/health`` and ``/favicon.ico``.

They are open (``Guard.OPEN``) because a browser loads them before it has the key: the dashboard
asks for the key itself and sends it with every API call it makes.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse

from .routing import Guard, get

STATIC = Path(__file__).parent / "static"


async def dashboard(request: Request) -> FileResponse:
    return FileResponse(STATIC / "dashboard.html")


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"state": request.app.state.coordinator.state.value})


async def favicon(request: Request) -> FileResponse:
    # An SVG under the name browsers ask for: every current browser draws it from its media type.
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400",
                                                                                          "Cross-Origin-Resource-Policy": "same-origin"})


routes = [
    get("/", dashboard, guard=Guard.OPEN),
    get("/health", health, guard=Guard.OPEN),
    get("/favicon.ico", favicon, guard=Guard.OPEN),
]
