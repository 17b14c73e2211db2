"""One assistant turn of a chat, for the routes that speak other chat dialects (``/v1/responses``,
``/v1/messages``): the same path as ``/v1/chat/completions`` with one choice.

A route turns its body into a :class:`~edgepipe.api.schemas.ChatRequest` (messages, tools,
tool_choice, response_format, sampling) and hands it to :func:`prepare`, which renders, compiles
the constraints and builds the sequence (every 400 before admission). :func:`answer` runs it to
its end; :func:`stream` runs it as a response whose body the route writes from the turn's
:class:`TextPiece` s and its final :class:`Answer` (text that may be the start of a tool call is
held back until it is known not to be one). Admission, cancellation and metrics as in
``generation``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.requests import Request

from ..runtime.sequence import SequenceState
from . import generation as G, schemas as S, tools
from .openai_routes import _vocab, check_model, json_constraint, params_for, render_chat


@dataclass
class Turn:
    """A prepared turn: validated, rendered, its sequence built (not yet admitted)."""

    model: str
    prompt: tools.ChatPrompt
    state: SequenceState
    rid: str


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class Answer:
    """The finished turn: content (None when the answer is only tool calls), calls in OpenAI's
    shape (``{"id", "type", "function": {"name", "arguments"}}``) and why it ended."""

    content: str | None
    tool_calls: list[dict]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_sequence: str | None  # the stop string that ended it, if one did
    prompt_tokens: int
    completion_tokens: int

    def arguments(self, call: dict) -> dict:
        """A call's arguments as an object (``{}`` when the text is not one: a call cut by max_tokens)."""
        try:
            value = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


async def prepare(request: Request, req: S.ChatRequest, rid: str) -> Turn:
    """Validate and build ``req`` (one choice) as ``/v1/chat/completions`` would; 4xx before admission."""
    model = check_model(request, req.model)
    prompt, ids, calls = await render_chat(request, req)
    coord = request.app.state.coordinator
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = params_for(req, max_tokens, len(ids), coord.manifest.max_context, prompt.stop, _vocab(request))
    fmt = req.response_format
    constraint = await json_constraint(request, fmt and fmt.type, fmt and fmt.json_schema, bool(req.ignore_eos),
                                       bool(prompt.tool_names)) or calls
    (state,) = G.build(coord, [ids], params, 1, tools.decoder(request.app.state.package.tokenizer, prompt))
    state.token_mask = constraint.token_mask() if constraint else None
    return Turn(model, prompt, state, rid)


def finish(turn: Turn, text: str) -> Answer:
    """The :class:`Answer` of a turn whose model output is ``text``."""
    state, prompt = turn.state, turn.prompt
    parsed = tools.parse(text, prompt) if prompt.tool_names else tools.ParsedOutput(text)
    reason = state.finish_reason or "stop"
    stop_sequence = None
    if reason == "stop" and state.generated and state.generated[-1] not in state.eos_ids:
        written = state.decode(state.generated)
        stop_sequence = next((s for s in state.params.stop if s in written), None)
    if parsed.tool_calls and reason == "stop":
        reason = "tool_calls"
    content = parsed.content if parsed.tool_calls else (parsed.content or "")
    return Answer(content, parsed.tool_calls, reason, stop_sequence, len(state.prompt_ids), len(state.generated))


async def answer(request: Request, turn: Turn) -> Answer:
    """Admit and run the turn to its end (cancelled if the client leaves)."""
    ticket = await G.admit(request, len(turn.state.prompt_ids) + turn.state.params.max_tokens)
    (text,) = await G.answer(request, ticket, [turn.state], turn.rid)
    return finish(turn, text)


async def pieces(app, turn: Turn) -> AsyncIterator[TextPiece | Answer]:
    """The turn's text as it comes (never any part of a tool call), then its :class:`Answer`."""
    full = ""
    held = tools.HeldCalls(turn.prompt) if turn.prompt.tool_names else None
    async for _, delta in G.merged(app.coordinator, [turn.state], turn.rid):
        full += delta.text
        content = held.feed(delta.text) if held else delta.text
        if content:
            yield TextPiece(content)
        if delta.finished:
            rest = held.finish()[1] if held else ""
            if rest:  # held back, and no call after all
                yield TextPiece(rest)
            yield finish(turn, full)


async def stream(request: Request, turn: Turn, body: Callable[[AsyncIterator[TextPiece | Answer]], AsyncIterator[str]],
                 media_type: str = "text/event-stream") -> G.ReleasingStream:
    """Admit the turn and answer with ``body(pieces)``, the route's own event format; ``body`` catches
    ``RequestFailed`` (and any error) to write it in its stream, the admission slot is released however it ends."""
    app = request.app.state
    ticket = await G.admit(request, len(turn.state.prompt_ids) + turn.state.params.max_tokens)

    async def counted() -> AsyncIterator[TextPiece | Answer]:
        outcome = "cancelled"
        try:
            async for piece in pieces(app, turn):
                yield piece
            outcome = "ok"
        except Exception:
            outcome = "error"
            raise
        finally:  # a client that left (GeneratorExit, cancellation) stays "cancelled"
            app.metrics.requests.labels(outcome).inc()

    try:
        return G.ReleasingStream(body(counted()), on_close=lambda: app.admission.release(ticket), media_type=media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    except BaseException:
        app.admission.release(ticket)
        raise


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def sse(event: str, data: dict) -> str:
    """One server-sent event with its name (the Responses and Messages streams name theirs)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


@dataclass
class Sequencer:
    """Numbers the events of a stream (the Responses API's ``sequence_number``)."""

    next: int = 0

    def __call__(self, event: dict) -> dict:
        event["sequence_number"] = self.next
        self.next += 1
        return event
