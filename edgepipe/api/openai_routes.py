"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Streaming responses are server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``. A client that goes away mid-stream cancels its generator, which frees the
sequence's KV on every worker.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..cluster.coordinator import RequestFailed
from ..runtime.sequence import GenerationParams
from .errors import APIError, bad_request


async def read_json(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def check_model(request: Request, body: dict) -> str:
    names = request.app.state.model_names
    model = body.get("model")
    if model is None:
        return names[0]
    if model not in names:
        raise APIError(404, f"The model '{model}' does not exist (this server serves: {', '.join(names)})", param="model",
                       code="model_not_found")
    return names[0]


def params_from(body: dict, context: int) -> GenerationParams:
    def number(key, kind, default):
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
            raise bad_request(f"'{key}' must be {'an integer' if kind is int else 'a number'}", param=key)
        return kind(value)

    max_tokens = number("max_completion_tokens", int, None) or number("max_tokens", int, None) or min(256, context)
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise bad_request("'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    if body.get("n", 1) not in (1, None):
        raise bad_request("only n=1 is supported", param="n")
    seed = number("seed", int, 0)
    try:
        return GenerationParams(max_tokens=max_tokens, temperature=number("temperature", float, 1.0 if "temperature" in body else 0.0),
                                top_p=number("top_p", float, 1.0), top_k=number("top_k", int, 0), seed=seed, stop=tuple(stop),
                                ignore_eos=bool(body.get("ignore_eos", False)))
    except ValueError as exc:
        param = str(exc).split(" ")[0]
        raise bad_request(str(exc), param=param) from None


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise bad_request(f"messages[{i}] needs a role of system, user, assistant, developer or tool", param="messages")
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string", param="messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


async def list_models(request: Request) -> JSONResponse:
    created = int(request.app.state.started)
    return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "edgepipe"}
                                                     for n in request.app.state.model_names[:1]]})


async def chat_completions(request: Request):
    body = await read_json(request)
    model = check_model(request, body)
    prompt = request.app.state.package.tokenizer.format_chat(_messages(body))
    return await _complete(request, body, model, prompt, chat=True)


async def completions(request: Request):
    body = await read_json(request)
    model = check_model(request, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", param="prompt")
    return await _complete(request, body, model, prompt, chat=False)


async def _complete(request: Request, body: dict, model: str, prompt: str, chat: bool):
    app = request.app.state
    coord, tok = app.coordinator, app.package.tokenizer
    params = params_from(body, coord.manifest.max_context)
    ids = tok.encode(prompt)
    try:
        state = coord.new_sequence(ids, params, tok.decode)
    except ValueError as exc:
        raise bad_request(str(exc), param="max_tokens") from None
    admission = app.admission
    ticket = await admission.admit(len(ids) + params.max_tokens)  # raises APIError(429) when the queue is full
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(state.generated),  # noqa: E731
                     "total_tokens": len(ids) + len(state.generated)}

    if not body.get("stream"):
        try:
            text = []
            async for delta in coord.stream(state, rid):
                text.append(delta.text)
        except RequestFailed as exc:
            app.metrics.requests.labels("error").inc()
            raise APIError(503, str(exc), type_="server_error", code="pipeline_failed") from None
        finally:
            admission.release(ticket)
        app.metrics.requests.labels("ok").inc()
        choice = {"index": 0, "finish_reason": state.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": "".join(text)}} if chat else {"text": "".join(text)})
        if body.get("return_token_ids"):  # an extension (as in vLLM) so clients can compare token for token
            choice["token_ids"] = list(state.generated)
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": usage()})

    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        return "data: " + json.dumps({"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model,
                                      "choices": [choice]}) + "\n\n"

    async def events():
        outcome = "cancelled"
        try:
            if chat:
                yield chunk(None, None, role=True)
            async for delta in coord.stream(state, rid):
                if delta.text or delta.finished:
                    yield chunk(delta.text, delta.finish_reason if delta.finished else None)
            if include_usage:
                yield "data: " + json.dumps({"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model,
                                             "choices": [], "usage": usage()}) + "\n\n"
            outcome = "ok"
        except RequestFailed as exc:
            outcome = "error"
            yield "data: " + json.dumps({"error": {"message": str(exc), "type": "server_error", "param": None, "code": "pipeline_failed"}}) + "\n\n"
        finally:
            admission.release(ticket)
            app.metrics.requests.labels(outcome).inc()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
