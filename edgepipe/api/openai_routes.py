"""OpenAI-compatible routes: ``/v1/models[/{id}]``, ``/v1/chat/completions``, ``/v1/completions``.

Bodies are validated by the pydantic schemas in ``schemas`` before anything runs. Streaming
responses are server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``; a failure
after the first byte is sent as one ``data: {"error": ...}`` event. ``n`` > 1 runs separate
sequences (seeds following the request's); a request without a seed gets a random one, reported
back as ``seed`` beside ``system_fingerprint`` (a greedy one, ``temperature: 0``, reports none unless
it gave one). Sampling fields a request leaves out take llama-server's defaults
(``generation.SAMPLING_DEFAULTS``: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05). Tools go through the model's chat template and
come back as ``tool_calls`` (``tools``), generated under their parameter schemas. ``logprobs``/``top_logprobs`` (chat), ``logprobs``/``echo``
(completions; ``max_tokens: 0`` with ``echo`` scores the prompt only, as the legacy OpenAI API and
vLLM allow: the prefill runs, the one token it samples is dropped), ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` run in the last
stage's head graph (``runtime.controls``); logprobs are of the model's raw logits.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from . import structured
from ..cluster.shells.coordinator import RequestFailed
from ..runtime.sequence import GenerationParams
from . import generation as G, schemas as S, tools
from .errors import APIError, bad_request
from .routing import Doc, Guard, get, post


async def parse_body(request: Request, model: type[BaseModel]):
    """The body as ``model``, or a 400 naming the first field that is wrong (an image part: the
    model reads text only)."""
    raw = await request.body() or b"null"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        param, message = S.first_error(exc, model)
        try:
            media = S.media_part(json.loads(raw))
        except ValueError:  # not JSON: the validation message says so
            media = None
        if media is not None:
            raise APIError(400, f"'{media}': this is a text-only model: image, audio and file parts are not supported; send text",
                           param=media.split("[")[0], code="unsupported_content") from None
        raise bad_request(message, param=param) from None


def check_model(request: Request, model: str | None) -> str:
    """The served model's name, or a 404 when ``model`` names another (``served.ServedNames``:
    the package name, its file's stem, its alias, Ollama's ``name:latest``; none: the served one)."""
    served = request.app.state.served
    if model is None or served.answers(model):
        return served.shown[0]
    raise APIError(404, f"The model '{model[:100]}' does not exist (this server serves: {served.listing()})", param="model",
                   code="model_not_found")


def params_for(req: S.Sampling, max_tokens: int | None, prompt_len: int, context: int, extra_stop=(), vocab: int = 1 << 31) -> GenerationParams:
    max_tokens = G.room(max_tokens, prompt_len, context, param="messages" if isinstance(req, S.ChatRequest) else "prompt")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if isinstance(req, S.ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs, top, echo = bool(req.logprobs), req.top_logprobs or 0, False
    else:
        logprobs, top = req.logprobs is not None, req.logprobs or 0
        echo = logprobs and bool(getattr(req, "echo", False))
    return GenerationParams(max_tokens=max_tokens, **G.sampling(req.temperature, req.top_k, req.top_p, req.min_p, req.seed),
                            stop=stop + tuple(extra_stop),
                            ignore_eos=bool(req.ignore_eos), presence_penalty=req.presence_penalty or 0.0,
                            frequency_penalty=req.frequency_penalty or 0.0, logit_bias=G.logit_bias(req.logit_bias, vocab),
                            logprobs=logprobs, top_logprobs=top, prompt_logprobs=echo)


def refuse_unsupported(req: S.Sampling) -> None:
    found = S.unsupported(req)
    if found:
        raise bad_request(found[1], param=found[0])


def model_card(request: Request, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(request.app.state.started), "owned_by": "edgepipe"}


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(request, n) for n in request.app.state.model_names[:1]]})


async def get_model(request: Request) -> JSONResponse:
    name = request.path_params["model"]
    check_model(request, name)
    return JSONResponse(model_card(request, name))


def no_embeddings(request: Request) -> APIError:
    """The 400 of an embeddings route: the served model generates text, it does not embed it."""
    name = request.app.state.model_names[0]
    return APIError(400, f"embeddings are not served by this model: '{name}' is a text-generation model (chat and "
                         "completions); use an embedding model for embeddings", param="model", code="model_not_supported")


async def embeddings(request: Request) -> JSONResponse:
    raise no_embeddings(request)


async def chat_completions(request: Request):
    req = await parse_body(request, S.ChatRequest)
    model = check_model(request, req.model)
    prompt, ids, calls = await render_chat(request, req)
    return await _run(request, req, model, [ids], req.max_completion_tokens or req.max_tokens, chat=prompt, constraint=calls)


async def render_chat(request: Request, req: S.ChatRequest) -> tuple[tools.ChatPrompt, list[int], structured.Constraint | None]:
    """A chat request's prompt, its token ids and the grammar of its tool calls (None without
    tools), after the checks every chat-shaped route shares (400s naming the field)."""
    refuse_unsupported(req)
    tool_names = {t.function.name for t in req.tools or []}
    if isinstance(req.tool_choice, S.NamedToolChoice) and req.tool_choice.function.name not in tool_names:
        raise bad_request(f"tool_choice names '{req.tool_choice.function.name}', which is not in 'tools'", param="tool_choice")
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise bad_request("tool_choice needs 'tools'", param="tool_choice")
    tok = request.app.state.package.tokenizer
    try:
        prompt = tools.render(tok.chat_template, tok.format_chat, req.messages, req.tools, req.tool_choice)
    except ValueError as exc:
        raise bad_request(str(exc).splitlines()[0][:300], param="messages") from None
    except Exception as exc:  # noqa: BLE001 (a template that breaks on these messages)
        raise bad_request(f"the chat template cannot render these messages: {type(exc).__name__}", param="messages") from None
    calls = await tool_constraint(request, req.tools, prompt, bool(req.parallel_tool_calls), bool(req.ignore_eos))
    return prompt, tok.encode(prompt.text), calls


async def json_constraint(request: Request, kind: str | None, json_schema=None, ignore_eos: bool = False,
                          tools_on: bool = False) -> structured.Constraint | None:
    """A response format compiled for the model's tokenizer (before admission: a 400 when it cannot be used)."""
    if kind in (None, "text"):
        return None
    if ignore_eos or tools_on:
        raise bad_request(f"response_format cannot be combined with {'ignore_eos' if ignore_eos else 'tools'}", param="response_format")
    try:
        fmt = structured.from_openai(kind, json_schema)
        return await asyncio.to_thread(structured.constraint_for, request.app.state.package.tokenizer, _vocab(request), fmt)
    except structured.SchemaError as exc:
        raise bad_request(f"response_format: {exc}", param="response_format") from None


async def tool_constraint(request: Request, tool_list, prompt: tools.ChatPrompt, parallel: bool,
                          ignore_eos: bool = False) -> structured.Constraint | None:
    """The grammar that holds ``prompt``'s tool calls to their schemas (``tools.call_grammar``),
    compiled before admission: a 400 naming ``tools`` when a schema cannot be used."""
    if prompt.mode == "none":
        return None
    if ignore_eos and prompt.mode in ("named", "required"):
        raise bad_request(f"a {prompt.mode} tool call cannot be combined with ignore_eos (the call ends the answer)", param="ignore_eos")
    try:
        tok = request.app.state.package.tokenizer
        lark, trigger = tools.call_grammar(tool_list, prompt, parallel, tools.special_markers(tok))
        return await asyncio.to_thread(structured.lark_constraint_for, request.app.state.package.tokenizer, _vocab(request), lark, trigger)
    except structured.SchemaError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None


def _vocab(request: Request) -> int:
    return request.app.state.package.manifest.config.get("vocab_size") or (1 << 31)


async def completions(request: Request):
    req = await parse_body(request, S.CompletionRequest)
    model = check_model(request, req.model)
    refuse_unsupported(req)
    app = request.app.state
    tok, vocab = app.package.tokenizer, app.package.manifest.config.get("vocab_size") or (1 << 31)
    p = req.prompt
    if isinstance(p, str):
        texts = [p]
    elif all(isinstance(x, str) for x in p):
        texts = list(p)
    else:
        texts = None  # token ids: echoed as their decoded text
    if texts is not None:
        prompts = [tok.encode(x) for x in texts]
    elif all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = [list(x) for x in p]
    bad = next((t for ids in prompts for t in ids if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary of {vocab}", param="prompt")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 generates nothing: it needs echo: true (the prompt and its logprobs)", param="max_tokens")
    echo = [t for t in texts] if texts is not None else [tok.decode(ids) for ids in prompts]
    return await _run(request, req, model, prompts, req.max_tokens, chat=None, echo=echo if req.echo else None)


async def _run(request: Request, req: S.Sampling, model: str, prompts: list[list[int]], max_tokens: int | None,
               chat: tools.ChatPrompt | None, echo: list[str] | None = None, constraint: structured.Constraint | None = None):
    app = request.app.state
    coord, tok = app.coordinator, app.package.tokenizer
    context = coord.manifest.max_context
    prompt_only = max_tokens == 0  # echo only: the prefill's one sampled token is dropped
    params = params_for(req, 1 if prompt_only else max_tokens, max(len(p) for p in prompts), context, chat.stop if chat else (),
                        _vocab(request))
    n = req.n or 1
    fmt = req.response_format
    constraint = await json_constraint(request, fmt and fmt.type, fmt and fmt.json_schema, bool(req.ignore_eos),
                                       bool(chat and chat.tool_names)) or constraint
    states = G.build(coord, prompts, params, n, tools.decoder(tok, chat))
    for state in states if constraint else ():
        state.token_mask = constraint.token_mask()
    positions = sum(len(s.prompt_ids) + params.max_tokens for s in states)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": G.fingerprint(app.package), **G.reported_seed(params, req.seed)}
    use_tools = chat is not None and bool(chat.tool_names)
    texts_of = G.token_texts(tok)
    views = [_Logprobs(state, texts_of, chat is not None, echo is not None, prompt_only) for state in states]

    def usage() -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = 0 if prompt_only else sum(len(s.generated) for s in states)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    ticket = await G.admit(request, positions)
    if not req.stream:
        texts = await G.answer(request, ticket, states, rid)
        choices = []
        for i, (state, text) in enumerate(zip(states, texts)):
            if prompt_only:
                text = ""
            choice = {"index": i, "finish_reason": "length" if prompt_only else state.finish_reason, "logprobs": views[i].take()}
            if chat:
                parsed = tools.parse(text, chat) if use_tools else tools.ParsedOutput(text)
                message = {"role": "assistant", "content": parsed.content if parsed.tool_calls else (parsed.content or "")}
                if parsed.tool_calls:
                    message["tool_calls"] = parsed.tool_calls
                    if state.finish_reason == "stop":  # a call cut by max_tokens stays "length"
                        choice["finish_reason"] = "tool_calls"
                choice["message"] = message
            else:
                choice["text"] = (echo[i // n] if echo else "") + text
            if req.return_token_ids:  # an extension (as in vLLM) so clients can compare token for token
                choice["token_ids"] = [] if prompt_only else list(state.generated)
            choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": usage()})

    try:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        kind = head["object"] + (".chunk" if chat else "")
        ids = [_StreamedIds(state, prompt_only) if req.return_token_ids else None for state in states]
        events = _events(app, coord, states, rid, {**head, "object": kind}, chat, use_tools, include_usage, usage, views,
                         [echo[i // n] for i in range(len(states))] if echo else None, prompt_only, ids)
        return G.ReleasingStream(events, on_close=lambda: app.admission.release(ticket), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    except BaseException:
        app.admission.release(ticket)
        raise


class _Logprobs:
    """One choice's logprobs in OpenAI's shape, handed out as they arrive (each streamed chunk
    carries the tokens since the previous one) or all at once; None when not asked for."""

    def __init__(self, state, texts: G.TokenTexts, chat: bool, echo: bool, prompt_only: bool = False):
        self.state, self.texts, self.chat, self.prompt_only = state, texts, chat, prompt_only
        self.sent, self.offset, self.echoed = 0, 0, not echo

    def take(self) -> dict | None:
        state = self.state
        if not state.params.logprobs:
            return None
        new = [] if self.prompt_only else state.logprobs[self.sent:]
        self.sent += len(new)
        if self.chat:
            return G.chat_logprobs(new, self.texts)
        ids, entries = [e.token for e in new], list(new)
        if not self.echoed and state.prompt_logprobs is not None:
            ids, entries = list(state.prompt_ids) + ids, list(state.prompt_logprobs) + entries
            self.echoed = True
        out = G.completion_logprobs(ids, entries, self.texts, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


class _StreamedIds:
    """One choice's generated token ids handed out as they arrive (``return_token_ids`` in a stream:
    each chunk carries the ids since the previous one, also those whose text is still held back)."""

    def __init__(self, state, prompt_only: bool = False):
        self.state, self.prompt_only, self.sent = state, prompt_only, 0

    def take(self) -> list[int]:
        new = [] if self.prompt_only else list(self.state.generated[self.sent:])
        self.sent += len(new)
        return new


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


async def _events(app, coord, states, rid, head, chat, use_tools, include_usage, usage, views, echo, prompt_only=False, ids=None):
    def chunk(i: int, finish: str | None, text: str | None = None, role: bool = False, tool_calls: list | None = None) -> str:
        logprobs = None if role else views[i].take()
        token_ids = ids[i].take() if ids and ids[i] and not role else None
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            if echo and echo[i] is not None:  # the prompt goes first, in the choice's first chunk
                text, echo[i] = echo[i] + (text or ""), None
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return _sse({**head, "choices": [choice]})

    held = [tools.HeldCalls(chat) for _ in states] if use_tools else []
    outcome = "cancelled"
    try:
        if chat:
            for i in range(len(states)):
                yield chunk(i, None, role=True)
        async for i, delta in G.merged(coord, states, rid):
            if prompt_only:  # the echoed prompt and its logprobs, once the prefill is done
                if delta.finished:
                    yield chunk(i, "length")
                continue
            if not use_tools:
                if delta.text or delta.finished:
                    yield chunk(i, delta.finish_reason if delta.finished else None, delta.text)
                continue
            content = held[i].feed(delta.text)
            if content:
                yield chunk(i, None, content)
            if delta.finished:
                parsed, rest = held[i].finish()
                if parsed.tool_calls:
                    calls = [{"index": k, **c} for k, c in enumerate(parsed.tool_calls)]
                    yield chunk(i, None, tool_calls=calls)
                    yield chunk(i, "tool_calls" if delta.finish_reason == "stop" else delta.finish_reason)
                else:
                    yield chunk(i, delta.finish_reason, rest)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage()})
        outcome = "ok"
    except RequestFailed as exc:
        outcome = "error"
        yield _sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": "pipeline_failed"}})
    except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes in the stream)
        outcome = "error"
        yield _sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error", "param": None,
                              "code": "internal_error"}})
    finally:
        app.metrics.requests.labels(outcome).inc()
    yield "data: [DONE]\n\n"


routes = [
    get("/v1/models", list_models, guard=Guard.API_KEY, doc=Doc("List the served model", response=S.ModelList)),
    get("/v1/models/{model:path}", get_model, guard=Guard.API_KEY, doc=Doc("One model", response=S.Model)),
    post("/v1/chat/completions", chat_completions, guard=Guard.API_KEY,
         doc=Doc("Chat completion (SSE when stream is true)", S.ChatRequest, S.ChatCompletion)),
    post("/v1/completions", completions, guard=Guard.API_KEY,
         doc=Doc("Text completion (SSE when stream is true)", S.CompletionRequest, S.Completion)),
    post("/v1/embeddings", embeddings, guard=Guard.API_KEY),  # a clear 400, not "no route" (undocumented: nothing to call)
]
