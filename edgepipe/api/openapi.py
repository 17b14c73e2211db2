"""``/openapi.json``: the OpenAPI 3.1 document of the OpenAI, Anthropic and Ollama routes, generated from the pydantic schemas."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import messages_routes as M, ollama_routes as O, responses_routes as R, schemas as S
from .generation import VERSION

# (method, path, request model or None, response model or None, summary)
OPERATIONS: list[tuple[str, str, type[BaseModel] | None, type[BaseModel] | None, str]] = [
    ("get", "/v1/models", None, S.ModelList, "List the served model"),
    ("get", "/v1/models/{model}", None, S.Model, "One model"),
    ("post", "/v1/chat/completions", S.ChatRequest, S.ChatCompletion, "Chat completion (SSE when stream is true)"),
    ("post", "/v1/completions", S.CompletionRequest, S.Completion, "Text completion (SSE when stream is true)"),
    ("post", "/v1/responses", R.ResponsesRequest, R.ResponseObject, "OpenAI Responses (SSE events when stream is true)"),
    ("post", "/v1/messages", M.MessagesRequest, M.MessageObject, "Anthropic Messages (SSE events when stream is true)"),
    ("get", "/api/version", None, None, "Ollama: API version"),
    ("get", "/api/tags", None, None, "Ollama: local models"),
    ("get", "/api/ps", None, None, "Ollama: running models"),
    ("post", "/api/show", O.OllamaShowRequest, None, "Ollama: model details"),
    ("post", "/api/chat", O.OllamaChatRequest, None, "Ollama: chat (NDJSON unless stream is false)"),
    ("post", "/api/generate", O.OllamaGenerateRequest, None, "Ollama: generate (NDJSON unless stream is false)"),
]


def document() -> dict:
    models = {m for _, _, req, res, _ in OPERATIONS for m in (req, res) if m is not None} | {S.ErrorResponse}
    ordered = sorted(models, key=lambda m: m.__name__)
    keys, defs = models_json_schema([(m, "validation" if m in _requests() else "serialization") for m in ordered],
                                    ref_template="#/components/schemas/{model}")
    ref = {m: keys[(m, "validation" if m in _requests() else "serialization")] for m in ordered}
    error = {"description": "Error", "content": {"application/json": {"schema": ref[S.ErrorResponse]}}}
    paths: dict[str, dict] = {}
    for method, path, req, res, summary in OPERATIONS:
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


def _requests() -> set:
    return {req for _, _, req, _, _ in OPERATIONS if req is not None}


_cached: dict | None = None


async def openapi_json(request: Request) -> JSONResponse:
    global _cached
    if _cached is None:
        _cached = document()
    return JSONResponse(_cached)


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
