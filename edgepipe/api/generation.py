"""Running the sequences of one HTTP request (the OpenAI and Ollama routes share it).

Order of a request: everything validated, each sequence built (``Coordinator.new_sequence``
refuses what cannot run) and only then admitted. Admission waits while watching the client: a
client that leaves while queued leaves the queue. A non-streaming request runs while watching the
client too, and is cancelled when it goes (its sequences' KV freed). A streaming request's slot is
released by the response itself (:class:`ReleasingStream`), whether or not its body was ever
iterated. Every path releases the admission ticket exactly once.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from importlib.metadata import PackageNotFoundError, version
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..runtime.sequence import GenerationParams, SequenceState, TextDelta
from .errors import APIError, bad_request
from .schemas import SEED_MAX

try:
    VERSION = version("edgepipe")
except PackageNotFoundError:  # running from a source tree
    VERSION = "0.0.0"


class ClientGone(APIError):
    def __init__(self):
        super().__init__(499, "the client closed the request", code="client_closed")


# What a request that names none of them samples with: llama-server's defaults (Ollama's are the
# same but for top_p 0.9 and min_p 0), on every route. Greedy is one field away: temperature 0.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def random_seed() -> int:
    return secrets.randbits(63)


def sampling(temperature: float | None, top_k: int | None, top_p: float | None, min_p: float | None, seed: int | None) -> dict:
    """A request's ``GenerationParams`` sampling fields: each one it leaves out at its
    ``SAMPLING_DEFAULTS`` value; without a seed a random one when it samples (0 when greedy,
    where no draw is made: ``reported_seed`` leaves it out)."""
    d = SAMPLING_DEFAULTS
    temperature = d["temperature"] if temperature is None else temperature
    if seed is None:
        seed = random_seed() if temperature > 0 else 0
    return {"temperature": temperature, "top_k": d["top_k"] if top_k is None else top_k,
            "top_p": d["top_p"] if top_p is None else top_p, "min_p": d["min_p"] if min_p is None else min_p, "seed": seed}


def room(asked: int | None, prompt_len: int, context: int, default: int | None = 256, param: str = "messages") -> int:
    """Tokens a request may generate: ``asked`` (None: ``default``, None: up to the context) clamped
    to what the context leaves after the prompt, as llama-server does (the answer then ends with
    finish reason ``length``); a prompt that leaves no room is a 400 that says so."""
    left = context - prompt_len
    if left < 1:
        raise bad_request(f"the request ({prompt_len} prompt tokens) exceeds the available context size ({context} tokens; "
                          f"serve --context sets it): a prompt must leave room for one token, max_tokens beyond the context "
                          f"is clamped to the room left, as llama-server does", param=param)
    wanted = (default if default is not None else left) if asked is None else asked
    return min(wanted, left)


def reported_seed(params: GenerationParams, asked: int | None) -> dict:
    """``{"seed": ...}`` for a response when the request gave one or sampled (the seed that
    reproduces it), else ``{}`` (a greedy answer depends on no seed)."""
    return {"seed": params.seed} if asked is not None or not params.greedy else {}


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's seed for the first, then the next ones (within 64 bits)."""
    return seed if index == 0 else (seed + index) & SEED_MAX


def fingerprint(package) -> str:
    m = package.manifest
    digest = str((m.source or {}).get("sha256") or "")[:8] or m.name
    return f"edgepipe-{VERSION}-{digest}-{m.precision}"


def logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> -100..100) as (id, value) pairs; 400 on a bad key."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab):
            raise bad_request(f"logit_bias key {key[:20]!r} is not a token id in [0, {vocab})", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


class TokenTexts:
    """Token id -> its own bytes and text, as the logprobs fields show a token (cached)."""

    def __init__(self, tok):
        self.tok = tok.tokenizer
        decoder = (json.loads(self.tok.to_str()).get("decoder") or {})
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self.byte_level = "ByteLevel" in kinds
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token: int) -> tuple[str, bytes]:
        if token not in self._cache:
            piece = self.tok.id_to_token(int(token)) or ""
            if m := _BYTE_PIECE.fullmatch(piece):
                raw = bytes([int(m.group(1), 16)])
            elif self.byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                raw = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            else:
                raw = piece.replace("\u2581", " ").encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's form
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token] = (text, raw)
        return self._cache[token]

    def text(self, token: int) -> str:
        return self.get(token)[0]


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_UNICODE_TO_BYTE = _byte_level_map()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


_TEXTS: dict[int, TokenTexts] = {}


def token_texts(tok) -> TokenTexts:
    """The (cached) TokenTexts of a package's tokenizer."""
    if id(tok) not in _TEXTS:
        _TEXTS[id(tok)] = TokenTexts(tok)
    return _TEXTS[id(tok)]


def chat_logprobs(entries: list, texts: TokenTexts) -> dict:
    """``choices[].logprobs`` of a chat completion (or a chunk's share of it)."""
    def one(token: int, logprob: float) -> dict:
        text, raw = texts.get(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(ids: list[int], entries: list, texts: TokenTexts, offset: int = 0) -> dict:
    """``choices[].logprobs`` of a completion: per token its text, logprob (None: an echoed first
    token), the N best plus the chosen one, and its character offset from ``offset``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, e in zip(ids, entries):
        text = texts.text(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(e.logprob)
        top = {texts.text(t): lp for t, lp in e.top}
        top.setdefault(text, e.logprob)
        out["top_logprobs"].append(top)
    return out


def build(coord, prompts: list[list[int]], params: GenerationParams, n: int, decode) -> list[SequenceState]:
    """One sequence per (prompt, choice), choice seeds following the request's; 400 when one cannot run."""
    states = []
    for ids in prompts:
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        for i in range(n):
            p = GenerationParams(**{**params.__dict__, "seed": choice_seed(params.seed, len(states))})
            try:
                states.append(coord.new_sequence(ids, p, decode))
            except ValueError as exc:
                text = str(exc)
                raise bad_request(text, param="top_k" if "top_k" in text else "seed" if "seed" in text else "max_tokens") from None
    return states


async def cancel_until_done(*tasks: asyncio.Future, retry_s: float = 0.05) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again while one runs on: before Python
    3.12, ``asyncio.wait_for`` returns its result instead of raising when the cancellation and the
    result arrive together, so one cancel of a decode loop can be lost (the request would run on)."""
    pending = [t for t in tasks if not t.done()]
    while pending:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=retry_s)
        pending = [t for t in pending if not t.done()]


async def until_disconnect(request: Request, work: Awaitable):
    """``await work``, cancelled (and :class:`ClientGone` raised) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        watcher.cancel()
        await cancel_until_done(task)


async def admit(request: Request, positions: int) -> int:
    """An admission ticket, waiting in the queue while the client is still there."""
    return await until_disconnect(request, request.app.state.admission.admit(positions))


async def merged(coord, states: list[SequenceState], rid: str) -> AsyncIterator[tuple[int, TextDelta]]:
    """(choice index, delta) from all sequences as they come; the first failure ends all of them."""
    if len(states) == 1:
        async for delta in coord.stream(states[0], rid):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, state: SequenceState) -> None:
        try:
            async for delta in coord.stream(state, f"{rid}-{i}"):
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 (handed to the consumer)
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        await cancel_until_done(*tasks)


async def collect(coord, states: list[SequenceState], rid: str) -> list[str]:
    """Run all sequences to their end; the text of each."""
    texts = [[] for _ in states]
    async for i, delta in merged(coord, states, rid):
        texts[i].append(delta.text)
    return ["".join(t) for t in texts]


async def answer(request: Request, ticket: int, states: list[SequenceState], rid: str) -> list[str]:
    """A whole (not streamed) answer for admitted sequences: their texts, the admission released
    however it ends; a failed pipeline is a 503, a client that left cancels the work. Counted in
    the requests metric by outcome."""
    from ..cluster.shells.coordinator import RequestFailed

    app = request.app.state
    try:
        texts = await until_disconnect(request, collect(app.coordinator, states, rid))
    except RequestFailed as exc:
        app.metrics.requests.labels("error").inc()
        raise APIError(503, str(exc), type_="server_error", code="pipeline_failed") from None
    except ClientGone:
        app.metrics.requests.labels("cancelled").inc()
        raise
    finally:
        app.admission.release(ticket)
    app.metrics.requests.labels("ok").inc()
    return texts


class ReleasingStream(StreamingResponse):
    """A streaming response that calls ``on_close`` once it ends, however it ends (even never iterated)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()
