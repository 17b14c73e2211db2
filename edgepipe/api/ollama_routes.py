"""The Ollama API (``/api/...``), so Ollama clients (Open WebUI, editors, the ``ollama`` package) work unchanged.

``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``, ``/api/chat`` and ``/api/generate``
(NDJSON when streaming, Ollama's default; one JSON object when ``"stream": false``). Options
honoured: temperature, num_predict, stop, seed, top_k, top_p, min_p, presence_penalty, frequency_penalty
(OpenAI's meaning, as Ollama's), ``repeat_penalty`` and ``repeat_last_n`` (llama.cpp's
multiplicative penalty over the last N tokens of prompt and output, applied in the head graph:
positive logits divided by it, negative ones multiplied; it is applied when given — Ollama's own
default of 1.1 is not assumed, llama-server's 1.0 is); the sampling options left out take
llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05: ``generation.SAMPLING_DEFAULTS``),
``temperature: 0`` is greedy; other options
are ignored as Ollama ignores those a model does not use. ``format``
(``"json"`` or a JSON Schema) holds the output to it, as ``response_format``; tool calls are held
to their schemas. ``raw`` sends the prompt as it is and, as Ollama, returns no ``context``.

``keep_alive`` (seconds, or a Go duration such as ``"5m"``, ``"1h30m"``; negative: for ever; 0:
unload; default 5 minutes) is kept as Ollama keeps it and reported by ``/api/ps``
(``expires_at``); a request with no prompt loads (``done_reason: "load"``) or, with 0, unloads
(``"unload"``: the model leaves ``/api/ps``). The cluster itself keeps the weights on its workers
whatever a client asks: a plan is the coordinator's, not a client's, to tear down. ``/api/show``
gives Ollama's fields (``details.parameter_size`` counted from the model's shapes,
``model_info`` with the GGUF-style keys). Errors are Ollama's shape, ``{"error": "..."}``. The
same validation, admission and cancellation as the OpenAI routes (``generation``).
"""

from __future__ import annotations

import functools
import json
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..cluster.shells.coordinator import RequestFailed
from ..runtime.sequence import GenerationParams
from . import generation as G, schemas as S, tools
from .errors import APIError, bad_request
from .openai_routes import json_constraint, no_embeddings, parse_body, tool_constraint
from .routing import Doc, Guard, get, post

OLLAMA_VERSION = "0.12.0"  # the Ollama API level these routes follow (clients compare it to enable features)
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default (OLLAMA_KEEP_ALIVE=5m)
FOREVER_S = 292 * 365 * 86400.0  # what Ollama's "for ever" (Go's longest duration) comes to
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value) -> float:
    """Ollama's ``keep_alive`` in seconds: a number (seconds) or a Go duration string (``"5m"``,
    ``"1h30m"``, ``"-1"``); negative means for ever (:data:`FOREVER_S`); None is the default. 400 otherwise."""
    if value is None:
        return DEFAULT_KEEP_ALIVE_S
    if isinstance(value, bool):
        raise bad_request("keep_alive must be a number of seconds or a duration such as '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # a bare number is seconds
        except ValueError:
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise bad_request(f"keep_alive {text[:40]!r} is not a duration (e.g. '5m', '1h30m', '-1', 0)") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    return FOREVER_S if seconds < 0 else min(seconds, FOREVER_S)


class Options(S.Strict):
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy; absent = 0.8.")
    num_predict: Annotated[int, Field(ge=-2, le=S.MAX_WIRE_INT)] | None = Field(None, description="-1: up to the context.")
    stop: Annotated[list[S.StopString], Field(max_length=16)] | None = None
    seed: Annotated[int, Field(ge=S.SEED_MIN, le=S.SEED_MAX)] | None = None
    top_k: Annotated[int, Field(ge=0, le=S.MAX_WIRE_INT)] | None = Field(None, description="0 = no limit; absent = 40.")
    top_p: float | None = Field(None, gt=0, le=1, description="Absent = 0.95 (llama-server's; Ollama's is 0.9).")
    min_p: float | None = Field(None, ge=0, le=1, description="0 = off; absent = 0.05 (llama-server's; Ollama's is 0).")
    num_ctx: Annotated[int, Field(ge=1, le=S.MAX_WIRE_INT)] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repeat_penalty: float | None = Field(None, gt=0, le=100, description="llama.cpp's multiplicative repeat penalty (1: off).")
    repeat_last_n: Annotated[int, Field(ge=-1, le=S.MAX_WIRE_INT)] | None = Field(None, description="Tokens it looks back (-1: all, 0: none; 64).")


class OllamaFunctionCall(S.Strict):
    name: S.FunctionName
    arguments: dict[str, Any] = {}


class OllamaToolCall(S.Strict):
    function: OllamaFunctionCall


class OllamaMessage(S.Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: Annotated[list[str], Field(max_length=0)] | None = Field(None, description="Not supported: a text model.")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(None, max_length=256)


class OllamaBase(S.Strict):
    model: str = Field(max_length=256)
    stream: bool | None = True
    options: Options | None = None
    format: Literal["", "json"] | dict[str, Any] | None = Field(None, description='"json" or a JSON Schema: the output follows it.')
    keep_alive: Annotated[str, Field(max_length=64)] | int | float | None = Field(
        None, description="Seconds or a duration ('5m'); negative: for ever; 0: unload. Default 5m.")


class OllamaChatRequest(OllamaBase):
    messages: Annotated[list[OllamaMessage], Field(max_length=4096)] = []
    tools: Annotated[list[S.Tool], Field(max_length=128)] | None = None


class OllamaGenerateRequest(OllamaBase):
    prompt: str | None = Field("", max_length=1 << 22)
    system: str | None = Field(None, max_length=1 << 20)
    raw: bool | None = False
    context: Annotated[list[S.TokenId], Field(max_length=1 << 20)] | None = None
    images: Annotated[list[str], Field(max_length=0)] | None = None


class OllamaShowRequest(S.Strict):
    model: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    verbose: bool | None = None


def ollama_errors(route):
    """Errors as Ollama sends them: ``{"error": "..."}`` with the status."""

    @functools.wraps(route)
    async def wrapped(request: Request):
        try:
            return await route(request)
        except APIError as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)
        except Exception as exc:  # noqa: BLE001 (never a plain-text 500)
            return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)

    return wrapped


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def tag(name: str) -> str:
    return name if ":" in name else name + ":latest"


def served_name(request: Request, model: str) -> str:
    served = request.app.state.served
    if served.answers(model):
        return tag(served.shown[0])
    raise APIError(404, f"model '{model[:100]}' not found (this server serves: {', '.join(map(tag, served.shown))})", code="model_not_found")


def parameter_count(config: dict) -> int:
    """The model's parameters, counted from its shapes (embeddings, attention, MLP, norms; the
    output matrix again when it is not tied)."""
    hidden, vocab, layers = config.get("hidden_size", 0), config.get("vocab_size", 0), config.get("n_layers", 0)
    heads, kv_heads = config.get("n_heads", 0), config.get("n_kv_heads") or config.get("n_heads", 0)
    head_dim = config.get("head_dim") or (hidden // heads if heads else 0)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if config.get("attention_bias"):
        attention += heads * head_dim + 2 * kv_heads * head_dim
    norms = 2 * hidden * (2 if config.get("post_norms") else 1) + (2 * head_dim if config.get("qk_norm") else 0)
    per_layer = attention + 3 * hidden * config.get("intermediate_size", 0) + norms
    embeddings = vocab * hidden * (1 if config.get("tie_embeddings", True) else 2)
    return embeddings + layers * per_layer + hidden


def parameter_size(count: int) -> str:
    """As Ollama writes it: ``134.52M``, ``7.6B``."""
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.2f}M"


def details(package) -> dict:
    m = package.manifest
    arch = m.config.get("architecture", "")
    return {"parent_model": "", "format": "gguf" if (m.source or {}).get("kind") == "gguf" else "onnx", "family": arch,
            "families": [arch], "parameter_size": parameter_size(parameter_count(m.config)), "quantization_level": m.precision}


def model_entry(request: Request) -> dict:
    app = request.app.state
    pkg = app.package
    size = sum(u.weight_bytes for u in (pkg.manifest.variant(x.index, pkg.manifest.precision) for x in pkg.manifest.units)) \
        if hasattr(pkg.manifest, "variant") else 0
    name = tag(app.model_names[0])
    return {"name": name, "model": name, "modified_at": datetime.fromtimestamp(app.started, timezone.utc).isoformat(),
            "size": size, "digest": str((pkg.manifest.source or {}).get("sha256") or ""), "details": details(pkg)}


@ollama_errors
async def version(request: Request) -> JSONResponse:
    return JSONResponse({"version": OLLAMA_VERSION})


@ollama_errors
async def tags(request: Request) -> JSONResponse:
    return JSONResponse({"models": [model_entry(request)]})


@ollama_errors
async def embed(request: Request) -> JSONResponse:
    raise no_embeddings(request)


def loaded_until(request: Request) -> float:
    """When the model leaves ``/api/ps`` (a time.time() value): ``keep_alive`` after the last request."""
    state = request.app.state
    return getattr(state, "ollama_expires", state.started + DEFAULT_KEEP_ALIVE_S)


def keep(request: Request, keep_alive) -> float:
    """Note a request's ``keep_alive`` (400 when it is not one); the new expiry."""
    seconds = keep_alive_seconds(keep_alive)
    request.app.state.ollama_expires = time.time() + seconds
    return seconds


@ollama_errors
async def ps(request: Request) -> JSONResponse:
    until = loaded_until(request)
    if until <= time.time():
        return JSONResponse({"models": []})
    entry = model_entry(request)
    expires = (datetime.fromtimestamp(request.app.state.started, timezone.utc) + timedelta(seconds=until - request.app.state.started))
    return JSONResponse({"models": [{**{k: v for k, v in entry.items() if k != "modified_at"},
                                     "expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": 0,
                                     "context_length": request.app.state.package.manifest.max_context}]})


@ollama_errors
async def show(request: Request) -> JSONResponse:
    req = await parse_body(request, OllamaShowRequest)
    served_name(request, req.model or req.name or "")
    pkg = request.app.state.package
    m, cfg = pkg.manifest, pkg.manifest.config
    arch = cfg.get("architecture", "")
    info = {"general.architecture": arch, "general.basename": cfg.get("name") or m.name, "general.parameter_count": parameter_count(cfg),
            f"{arch}.context_length": m.max_context, f"{arch}.embedding_length": cfg.get("hidden_size"),
            f"{arch}.block_count": cfg.get("n_layers"), f"{arch}.feed_forward_length": cfg.get("intermediate_size"),
            f"{arch}.attention.head_count": cfg.get("n_heads"), f"{arch}.attention.head_count_kv": cfg.get("n_kv_heads"),
            f"{arch}.attention.layer_norm_rms_epsilon": cfg.get("rms_eps"), f"{arch}.rope.freq_base": cfg.get("rope_theta"),
            f"{arch}.rope.dimension_count": cfg.get("rotary_dim") or cfg.get("head_dim"), f"{arch}.vocab_size": cfg.get("vocab_size")}
    tok = pkg.tokenizer
    template = tok.chat_template or ""
    stops = [tok.tokenizer.id_to_token(i) for i in m.eos_ids]
    parameters = "\n".join(f'{"stop":<31}"{s}"' for s in stops if s)
    modelfile = f"# Modelfile generated by edgepipe\nFROM {m.name}\nTEMPLATE {json.dumps(template)}\n" + \
        "".join(f'PARAMETER stop "{s}"\n' for s in stops if s)
    return JSONResponse({"modelfile": modelfile, "parameters": parameters, "template": template, "license": "", "details": details(pkg),
                         "model_info": info, "capabilities": ["completion", "tools"],  # every model gets tools (api.tools)
                         "modified_at": datetime.fromtimestamp(request.app.state.started, timezone.utc).isoformat()})


def params_from(options: Options | None, prompt_len: int, context: int, extra_stop=()) -> GenerationParams:
    o = options or Options()
    if o.num_predict == 0:
        raise bad_request("num_predict 0 generates nothing: send -1 or a positive number")
    max_tokens = G.room(None if o.num_predict in (None, -1, -2) else o.num_predict, prompt_len, context, default=None, param="prompt")
    return GenerationParams(max_tokens=max_tokens, **G.sampling(o.temperature, o.top_k, o.top_p, o.min_p, o.seed),
                            stop=tuple(o.stop or ()) + tuple(extra_stop), presence_penalty=o.presence_penalty or 0.0,
                            frequency_penalty=o.frequency_penalty or 0.0, repeat_penalty=o.repeat_penalty or 1.0,
                            repeat_last_n=64 if o.repeat_last_n is None else o.repeat_last_n)


@ollama_errors
async def chat(request: Request):
    req = await parse_body(request, OllamaChatRequest)
    model = served_name(request, req.model)
    loaded = keep(request, req.keep_alive)
    if not req.messages:  # Ollama: an empty chat loads the model (or with keep_alive 0 unloads it)
        return JSONResponse({"model": model, "created_at": now(), "message": {"role": "assistant", "content": ""}, "done": True,
                             "done_reason": "load" if loaded > 0 else "unload"})
    messages = [S.ChatMessage(role=m.role, content=m.content or "", name=m.tool_name,
                              tool_calls=[S.ToolCall(id=f"call_{i}", function=S.FunctionCall(name=c.function.name,
                                                                                              arguments=json.dumps(c.function.arguments)))
                                          for i, c in enumerate(m.tool_calls)] if m.tool_calls else None)
                for m in req.messages]
    tok = request.app.state.package.tokenizer
    try:
        prompt = tools.render(tok.chat_template, tok.format_chat, messages, req.tools, "auto" if req.tools else None)
    except Exception as exc:  # noqa: BLE001 (a template that breaks on these messages)
        raise bad_request(f"the chat template cannot render these messages: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from None
    return await _run(request, req, model, tok.encode(prompt.text), chat=prompt)


@ollama_errors
async def generate(request: Request):
    req = await parse_body(request, OllamaGenerateRequest)
    model = served_name(request, req.model)
    loaded = keep(request, req.keep_alive)
    if not req.prompt and not req.context:  # Ollama: an empty prompt loads the model (or with keep_alive 0 unloads it)
        return JSONResponse({"model": model, "created_at": now(), "response": "", "done": True,
                             "done_reason": "load" if loaded > 0 else "unload"})
    tok = request.app.state.package.tokenizer
    if req.raw:
        text = req.prompt or ""
    else:
        msgs = ([{"role": "system", "content": req.system}] if req.system else []) + [{"role": "user", "content": req.prompt or ""}]
        text = tok.format_chat(msgs)
    ids = list(req.context or []) + tok.encode(text)
    vocab = request.app.state.package.manifest.config.get("vocab_size") or (1 << 31)
    if any(t >= vocab for t in ids):
        raise bad_request(f"a context token id is outside the vocabulary of {vocab}")
    return await _run(request, req, model, ids, chat=None, raw=bool(req.raw))


async def _run(request: Request, req: OllamaBase, model: str, ids: list[int], chat: tools.ChatPrompt | None, raw: bool = False):
    app = request.app.state
    coord, tok = app.coordinator, app.package.tokenizer
    params = params_from(req.options, len(ids), coord.manifest.max_context, chat.stop if chat else ())
    fmt = req.format or None
    constraint = await json_constraint(request, fmt and ("json_object" if fmt == "json" else "json_schema"),
                                       {"schema": fmt} if isinstance(fmt, dict) else None, tools_on=bool(chat and chat.tool_names))
    if constraint is None and chat is not None and chat.tool_names:  # calls the model starts follow their schemas
        constraint = await tool_constraint(request, req.tools, chat, parallel=True)
    states = G.build(coord, [ids], params, 1, tools.decoder(tok, chat))
    state = states[0]
    state.token_mask = constraint.token_mask() if constraint else None
    rid = "ollama-" + __import__("uuid").uuid4().hex[:24]
    started = time.monotonic_ns()
    use_tools = chat is not None and bool(chat.tool_names)

    def final(text: str) -> dict:
        elapsed = time.monotonic_ns() - started
        out = {"model": model, "created_at": now(), "done": True, "done_reason": state.finish_reason or "stop",
               "total_duration": elapsed, "load_duration": 0, "prompt_eval_count": len(ids), "prompt_eval_duration": 0,
               "eval_count": len(state.generated), "eval_duration": elapsed}
        if chat is None:  # as Ollama: no context in raw mode (the prompt was not the model's template)
            return {**out, "response": text, **({} if raw else {"context": ids + list(state.generated)})}
        parsed = tools.parse(text, chat) if use_tools else tools.ParsedOutput(text)
        message = {"role": "assistant", "content": parsed.content or ""}
        if parsed.tool_calls:
            message["tool_calls"] = [{"function": {"name": c["function"]["name"], "arguments": _args(c["function"]["arguments"])}}
                                     for c in parsed.tool_calls]
        return {**out, "message": message}

    ticket = await G.admit(request, len(ids) + params.max_tokens)
    if not req.stream:
        (text,) = await G.answer(request, ticket, states, rid)
        return JSONResponse(final(text))

    async def lines():
        full = ""
        try:
            async for _, delta in G.merged(coord, states, rid):
                full += delta.text
                if use_tools:  # a call is parsed once the answer is complete
                    if delta.finished:
                        yield json.dumps(final(full)) + "\n"
                    continue
                if delta.text:
                    piece = {"model": model, "created_at": now(), "done": False}
                    piece.update({"message": {"role": "assistant", "content": delta.text}} if chat else {"response": delta.text})
                    yield json.dumps(piece) + "\n"
                if delta.finished:
                    last = final(full)
                    if chat:
                        last["message"]["content"] = ""
                    else:
                        last["response"] = ""
                    yield json.dumps(last) + "\n"
        except RequestFailed as exc:
            yield json.dumps({"error": str(exc)}) + "\n"
        except Exception as exc:  # noqa: BLE001 (headers are sent: the error goes in the stream)
            yield json.dumps({"error": f"internal error: {type(exc).__name__}"}) + "\n"

    try:
        return G.ReleasingStream(lines(), on_close=lambda: app.admission.release(ticket), media_type="application/x-ndjson")
    except BaseException:
        app.admission.release(ticket)
        raise


def _args(arguments: str):
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"value": value}


routes = [
    get("/api/version", version, guard=Guard.API_KEY, doc=Doc("Ollama: API version")),
    get("/api/tags", tags, guard=Guard.API_KEY, doc=Doc("Ollama: local models")),
    get("/api/ps", ps, guard=Guard.API_KEY, doc=Doc("Ollama: running models")),
    post("/api/show", show, guard=Guard.API_KEY, doc=Doc("Ollama: model details", OllamaShowRequest)),
    post("/api/chat", chat, guard=Guard.API_KEY, doc=Doc("Ollama: chat (NDJSON unless stream is false)", OllamaChatRequest)),
    post("/api/generate", generate, guard=Guard.API_KEY, doc=Doc("Ollama: generate (NDJSON unless stream is false)", OllamaGenerateRequest)),
    post("/api/embed", embed, guard=Guard.API_KEY),  # Ollama's embeddings, and its older name: a clear 400
    post("/api/embeddings", embed, guard=Guard.API_KEY),
]
