"""Anthropic's Messages API, ``POST /v1/messages``, on the chat completions' generation path (``turns``).

``system`` (a string or text blocks), ``messages`` whose content is a string or blocks (``text``,
``tool_use`` in assistant turns, ``tool_result`` in user turns), ``tools`` (``input_schema``),
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; calls held to their schemas as in chat;
several calls only with ``disable_parallel_tool_use: false``, as chat's ``required``),
``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` (and ``min_p``,
an extension; those left out take llama-server's defaults, ``generation.SAMPLING_DEFAULTS``),
``output_config.format`` (a JSON schema the text is held to, as chat's response_format). The answer
is ``text`` and ``tool_use`` blocks with ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` or ``tool_use``. Streaming sends the API's events (``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``). Errors are
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``. The API key may come as
``x-api-key`` (Anthropic's header) or as a Bearer token.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..cluster.shells.coordinator import RequestFailed
from . import schemas as S, turns
from .errors import APIError, bad_request
from .openai_routes import parse_body
from .routing import Doc, Guard, post

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class TextBlock(S.Strict):
    type: Literal["text"]
    text: str = Field(max_length=1 << 22)


class ToolUseBlock(S.Strict):
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: S.FunctionName
    input: dict[str, Any]


class ToolResultBlock(S.Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: str | Annotated[list[TextBlock], Field(max_length=4096)] | None = ""
    is_error: bool | None = None


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(S.Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=4096)] = Field(
        description="Text, or text / tool_use / tool_result blocks (images are not supported: a text model).")


class ToolDef(S.Strict):
    name: S.FunctionName
    description: str | None = Field(None, max_length=1 << 14)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(S.Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: S.FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(S.Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(S.Strict):
    format: OutputFormat | None = None
    effort: str | None = Field(None, max_length=16, description="Ignored (no reasoning model).")


class MessagesRequest(S.Strict):
    model: str = Field(max_length=256)
    max_tokens: S.PositiveTokens
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: str | Annotated[list[TextBlock], Field(max_length=256)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: Annotated[list[S.StopString], Field(max_length=S.MAX_STOP)] | None = None
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy; absent = 0.8 (llama-server's default).")
    top_p: float | None = Field(None, gt=0, le=1, description="Absent = 0.95 (llama-server's default); 1 = off.")
    top_k: Annotated[int, Field(ge=0, le=S.MAX_WIRE_INT)] | None = Field(None, description="0 = no limit; absent = 40.")
    min_p: float | None = Field(None, ge=0, le=1, description="An extension (llama-server's): 0 = off; absent = 0.05.")
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class MessageObject(S.Loose):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: dict[str, int]


def anthropic_errors(route):
    """Errors as Anthropic sends them: ``{"type": "error", "error": {"type", "message"}}`` with the status."""

    @functools.wraps(route)
    async def wrapped(request: Request):
        try:
            return await route(request)
        except APIError as exc:
            kind = ERROR_TYPES.get(exc.status, "api_error")
            return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}}, status_code=exc.status,
                                headers=exc.headers)
        except Exception as exc:  # noqa: BLE001 (never a plain-text 500)
            return JSONResponse({"type": "error", "error": {"type": "api_error", "message": f"internal error: {type(exc).__name__}"}},
                                status_code=500)

    return wrapped


def _text(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_request(req: MessagesRequest) -> S.ChatRequest:
    """The chat request the same answer comes from."""
    messages: list[dict] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            messages.append({"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})})
            continue
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise bad_request("tool_use blocks belong in assistant messages", param="messages")
        for b in blocks:  # tool results answer the previous turn's calls, before the user's text
            if isinstance(b, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                 "content": ("Error: " if b.is_error else "") + _text(b.content)})
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": "user", "content": text})
    choice, parallel = None, None
    if req.tool_choice is not None:
        c = req.tool_choice
        if c.type == "tool" and not c.name:
            raise bad_request("tool_choice of type 'tool' needs a 'name'", param="tool_choice")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {"type": "function", "function": {"name": c.name}}
        parallel = c.disable_parallel_tool_use is False
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "stop": req.stop_sequences, "tool_choice": choice, "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
                  for t in req.tools] if req.tools else None,
    }
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    try:
        return S.ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        _, message = S.first_error(exc)
        raise bad_request(message, param="messages") from None


def stop_reason(answer: turns.Answer) -> str:
    if answer.finish_reason == "tool_calls":
        return "tool_use"
    if answer.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if answer.stop_sequence else "end_turn"


def tool_use_block(call: dict, answer: turns.Answer) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": answer.arguments(call)}


def message_object(mid: str, model: str, content: list[dict], answer: turns.Answer | None, prompt_tokens: int) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(answer) if answer else None, "stop_sequence": answer.stop_sequence if answer else None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": answer.completion_tokens if answer else 0,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


@anthropic_errors
async def create_message(request: Request):
    req = await parse_body(request, MessagesRequest)
    mid = turns.new_id("msg_")
    turn = await turns.prepare(request, chat_request(req), mid)
    prompt_tokens = len(turn.state.prompt_ids)
    if not req.stream:
        answer = await turns.answer(request, turn)
        content = [{"type": "text", "text": answer.content}] if answer.content or not answer.tool_calls else []
        content += [tool_use_block(call, answer) for call in answer.tool_calls]
        return JSONResponse(message_object(mid, turn.model, content, answer, prompt_tokens))

    async def body(pieces: AsyncIterator) -> AsyncIterator[str]:
        yield turns.sse("message_start", {"type": "message_start", "message": message_object(mid, turn.model, [], None, prompt_tokens)})
        index, text_open = 0, False
        try:
            async for piece in pieces:
                if isinstance(piece, turns.TextPiece):
                    if not text_open:
                        text_open = True
                        yield turns.sse("content_block_start", {"type": "content_block_start", "index": index,
                                                                "content_block": {"type": "text", "text": ""}})
                    yield turns.sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                            "delta": {"type": "text_delta", "text": piece.text}})
                    continue
                answer: turns.Answer = piece
                if not text_open and not answer.tool_calls:  # an empty answer still has its text block
                    text_open = True
                    yield turns.sse("content_block_start", {"type": "content_block_start", "index": index,
                                                            "content_block": {"type": "text", "text": ""}})
                if text_open:
                    yield turns.sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                for call in answer.tool_calls:
                    block = tool_use_block(call, answer)
                    yield turns.sse("content_block_start", {"type": "content_block_start", "index": index,
                                                            "content_block": {**block, "input": {}}})
                    yield turns.sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
                    yield turns.sse("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                yield turns.sse("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": stop_reason(answer), "stop_sequence": answer.stop_sequence},
                                                  "usage": {"output_tokens": answer.completion_tokens}})
                yield turns.sse("message_stop", {"type": "message_stop"})
        except RequestFailed as exc:
            yield turns.sse("error", {"type": "error", "error": {"type": "overloaded_error", "message": str(exc)}})
        except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes in the stream)
            yield turns.sse("error", {"type": "error", "error": {"type": "api_error", "message": f"internal error: {type(exc).__name__}"}})

    return await turns.stream(request, turn, body)


routes = [post("/v1/messages", create_message, guard=Guard.API_KEY,
               doc=Doc("Anthropic Messages (SSE events when stream is true)", MessagesRequest, MessageObject))]
