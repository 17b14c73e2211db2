"""OpenAI's Responses API, ``POST /v1/responses``, on the chat completions' generation path (``turns``).

Input: a string or a list of items (messages with ``input_text``/``output_text`` parts,
``function_call`` and ``function_call_output`` items), ``instructions`` (a system message first),
function ``tools`` with ``tool_choice`` and ``parallel_tool_calls`` (calls held to their schemas
as in chat), ``text.format`` (``text``, ``json_object``, ``json_schema``: the response_format of
chat), ``max_output_tokens``, ``temperature``, ``top_p``; extensions ``seed``, ``top_k``, ``min_p`` (those left out take
llama-server's defaults, ``generation.SAMPLING_DEFAULTS``). Nothing
is stored: ``previous_response_id`` and ``store: true`` with a later retrieval are not offered
(``previous_response_id`` is a 400). The output is a ``message`` item with one ``output_text``
part and a ``function_call`` item per call; ``status`` "incomplete" (reason
``max_output_tokens``) when the answer was cut. Streaming sends the API's named events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``), each with
its ``sequence_number``; a failure after the first byte is a ``response.failed`` event.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, AsyncIterator, Literal, Union

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..cluster.shells.coordinator import RequestFailed
from . import generation as G, schemas as S, turns
from .errors import bad_request
from .routing import Doc, Guard, post
from .openai_routes import parse_body


class InputText(S.Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str = Field(max_length=1 << 22)


class MessageItem(S.Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[InputText], Field(max_length=4096)] = Field(
        description="Text, or input_text / output_text parts (images are not supported: a text model).")
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


class FunctionCallItem(S.Strict):
    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: S.FunctionName
    arguments: str = Field(max_length=1 << 20)
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


class FunctionCallOutputItem(S.Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str = Field(max_length=1 << 22)
    id: str | None = Field(None, max_length=256)
    status: str | None = Field(None, max_length=32)


InputItem = Union[FunctionCallItem, FunctionCallOutputItem, MessageItem]


class FunctionTool(S.Strict):
    type: Literal["function"] = Field(description="Function tools only (no hosted tools).")
    name: S.FunctionName
    description: str | None = Field(None, max_length=1 << 14)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(S.Strict):
    type: Literal["function"]
    name: S.FunctionName


class TextFormat(S.Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = Field(None, max_length=1 << 14)


class TextOptions(S.Strict):
    format: TextFormat | None = None


class ResponsesRequest(S.Strict):
    model: str | None = Field(None, max_length=256)
    input: Annotated[str, Field(max_length=1 << 22)] | Annotated[list[InputItem], Field(min_length=1, max_length=4096)] = Field(
        description="A string (one user message) or a list of message, function_call and function_call_output items.")
    instructions: str | None = Field(None, max_length=1 << 20)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: S.PositiveTokens | None = None
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy; absent = 0.8 (llama-server's default).")
    top_p: float | None = Field(None, gt=0, le=1, description="Absent = 0.95 (llama-server's default); 1 = off.")
    top_k: Annotated[int, Field(ge=0, le=S.MAX_WIRE_INT)] | None = Field(None, description="An extension: 0 = no limit; absent = 40.")
    min_p: float | None = Field(None, ge=0, le=1, description="An extension (llama-server's): 0 = off; absent = 0.05.")
    seed: Annotated[int, Field(ge=S.SEED_MIN, le=S.SEED_MAX)] | None = Field(None, description="An extension.")
    stream: bool | None = False
    text: TextOptions | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = Field(None, max_length=256, description="Not supported: nothing is stored.")
    user: str | None = Field(None, max_length=256)


class ResponseObject(S.Loose):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


def chat_request(req: ResponsesRequest) -> S.ChatRequest:
    """The chat request the same answer comes from."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn stay in one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    fmt = req.text.format if req.text else None
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "min_p": req.min_p, "seed": req.seed, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools] if req.tools else None,
        "tool_choice": ({"type": "function", "function": {"name": req.tool_choice.name}}
                        if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice),
        "response_format": None if fmt is None else {"type": fmt.type, **({"json_schema": {
            "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}} if fmt.type == "json_schema" else {})},
    }
    try:
        return S.ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        _, message = S.first_error(exc)
        raise bad_request(message, param="input") from None


def output_items(answer: turns.Answer, message_id: str, call_ids: list[str]) -> list[dict]:
    items = []
    if answer.content or not answer.tool_calls:
        items.append(message_item(message_id, answer.content or "", "completed"))
    for call, item_id in zip(answer.tool_calls, call_ids):
        items.append(call_item(item_id, call, "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(item_id: str, call: dict, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def response_object(req: ResponsesRequest, rid: str, created: int, model: str, status: str, output: list[dict],
                    answer: turns.Answer | None) -> dict:
    usage = None
    if answer is not None:
        usage = {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": answer.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": answer.prompt_tokens + answer.completion_tokens}
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model, "output": output,
            "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": bool(req.parallel_tool_calls), "temperature": G.SAMPLING_DEFAULTS["temperature"] if req.temperature is None else req.temperature,
            "top_p": G.SAMPLING_DEFAULTS["top_p"] if req.top_p is None else req.top_p,
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "text": {"format": fmt},
            "metadata": req.metadata or {}, "store": False, "previous_response_id": None, "truncation": "disabled", "user": req.user}


async def create_response(request: Request):
    req = await parse_body(request, ResponsesRequest)
    if req.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server stores no responses (send the whole input)",
                          param="previous_response_id")
    rid, created = turns.new_id("resp_"), int(time.time())
    turn = await turns.prepare(request, chat_request(req), rid)
    message_id = turns.new_id("msg_")
    if not req.stream:
        answer = await turns.answer(request, turn)
        output = output_items(answer, message_id, [turns.new_id("fc_") for _ in answer.tool_calls])
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        return JSONResponse(response_object(req, rid, created, turn.model, status, output, answer))

    async def body(pieces: AsyncIterator) -> AsyncIterator[str]:
        seq = turns.Sequencer()

        def event(kind: str, **fields) -> str:
            return turns.sse(kind, seq({"type": kind, **fields}))

        start = response_object(req, rid, created, turn.model, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        def open_message() -> list[str]:
            return [event("response.output_item.added", output_index=0, item=message_item(message_id, "", "in_progress")),
                    event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})]

        text, opened = "", False
        try:
            async for piece in pieces:
                answer = piece if isinstance(piece, turns.Answer) else None
                if not opened and (answer is None or not answer.tool_calls):  # an empty answer still has its message
                    opened = True
                    for line in open_message():
                        yield line
                if answer is None:
                    text += piece.text
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=piece.text,
                                logprobs=[])
                    continue
                output = []
                if opened:
                    part = {"type": "output_text", "text": text, "annotations": []}
                    yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
                    output.append(message_item(message_id, text, "completed"))
                    yield event("response.output_item.done", output_index=0, item=output[-1])
                for call in answer.tool_calls:
                    index, item_id = len(output), turns.new_id("fc_")
                    yield event("response.output_item.added", output_index=index, item=call_item(item_id, call, "in_progress"))
                    arguments = call["function"]["arguments"]
                    yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments)
                    yield event("response.function_call_arguments.done", item_id=item_id, output_index=index, arguments=arguments)
                    output.append(call_item(item_id, call, "completed"))
                    yield event("response.output_item.done", output_index=index, item=output[-1])
                status = "incomplete" if answer.finish_reason == "length" else "completed"
                yield event(f"response.{status}", response=response_object(req, rid, created, turn.model, status, output, answer))
        except RequestFailed as exc:
            failed = {**response_object(req, rid, created, turn.model, "failed", [], None),
                      "error": {"code": "server_error", "message": str(exc)}}
            yield event("response.failed", response=failed)
        except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes in the stream)
            yield event("error", code="internal_error", message=f"internal error: {type(exc).__name__}", param=None)

    return await turns.stream(request, turn, body)


routes = [post("/v1/responses", create_response, guard=Guard.API_KEY,
               doc=Doc("OpenAI Responses (SSE events when stream is true)", ResponsesRequest, ResponseObject))]
