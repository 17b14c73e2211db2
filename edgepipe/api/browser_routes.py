"""The browser worker: ``GET /worker`` turns a tab into a worker; ``/static/...`` serves its code.

The page runs its stage with onnxruntime-web (WebGPU where the browser has an adapter, else
WebAssembly) and speaks the same protocol as a
native worker over ``/v1/worker``. WebAssembly threads need a cross-origin isolated page, so
every response here carries COOP ``same-origin`` + COEP ``require-corp``, and CORP
``same-origin`` on the scripts and the ``.wasm`` (same-origin fetches, such as the unit files
under ``/v1/blobs/``, need no CORP header). The vendored libraries under ``static/vendor/``
are written by ``scripts/vendor_js.sh`` and committed, so nothing is fetched from npm at run time.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from .errors import APIError
from .routing import Guard, get

STATIC = (Path(__file__).parent / "static").resolve()
ISOLATION = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".mjs": "text/javascript; charset=utf-8",
               ".wasm": "application/wasm", ".css": "text/css; charset=utf-8", ".json": "application/json", ".txt": "text/plain; charset=utf-8",
               ".svg": "image/svg+xml"}


async def worker_page(request: Request) -> Response:
    return FileResponse(STATIC / "worker.html", media_type=MEDIA_TYPES[".html"], headers={**ISOLATION, "Cache-Control": "no-cache"})


async def static_file(request: Request) -> Response:
    rel = request.path_params["path"]
    path = (STATIC / rel).resolve()
    if not path.is_relative_to(STATIC) or not path.is_file() or path.suffix not in MEDIA_TYPES:
        raise APIError(404, f"no static file {rel[:100]}", code="not_found")
    # Vendored files are pinned by version; the page's own code may change with any release.
    cache = "public, max-age=86400" if path.parent.name == "vendor" else "no-cache"
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={**ISOLATION, "Cache-Control": cache})


# Open: a tab opens the page and its code before it joins; it joins with the join token, not the API key.
routes = [
    get("/worker", worker_page, guard=Guard.OPEN),
    get("/static/{path:path}", static_file, guard=Guard.OPEN),
]
