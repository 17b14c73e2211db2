"""``/openapi.json``: the OpenAPI 3.1 document of the OpenAI, Anthropic and Ollama routes, generated from the pydantic schemas.

A route is documented by the :class:`routing.Doc` it declares where it is defined (its summary,
request and response models); routes without one (pages, cluster views, the worker socket) are
left out."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import schemas as S
from .generation import VERSION
from .routing import Endpoint, Guard, get


def document(endpoints) -> dict:
    """The document of the ``endpoints`` that declare a :class:`routing.Doc`, in their order."""
    ops = [(e.methods[0].lower(), e.documented_path, e.doc.request, e.doc.response, e.doc.summary)
           for e in endpoints if isinstance(e, Endpoint) and e.doc is not None]
    requests = {req for _, _, req, _, _ in ops if req is not None}
    models = {m for _, _, req, res, _ in ops for m in (req, res) if m is not None} | {S.ErrorResponse}
    ordered = sorted(models, key=lambda m: m.__name__)
    keys, defs = models_json_schema([(m, "validation" if m in requests else "serialization") for m in ordered],
                                    ref_template="#/components/schemas/{model}")
    ref = {m: keys[(m, "validation" if m in requests else "serialization")] for m in ordered}
    error = {"description": "Error", "content": {"application/json": {"schema": ref[S.ErrorResponse]}}}
    paths: dict[str, dict] = {}
    for method, path, req, res, summary in ops:
        op: dict = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
                    "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref[res] if res else {"type": "object"}}}},
                                  "4XX": error, "5XX": error}}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[req]}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": "edgepipe", "version": VERSION}, "paths": paths,
            "components": {"schemas": defs.get("$defs", {})}}


async def openapi_json(request: Request) -> JSONResponse:
    state = request.app.state
    if getattr(state, "openapi", None) is None:  # built once per app, from the endpoints it serves
        state.openapi = document(state.endpoints)
    return JSONResponse(state.openapi)


routes = [get("/openapi.json", openapi_json, guard=Guard.OPEN)]  # the API's shape, no data: open as it is today
