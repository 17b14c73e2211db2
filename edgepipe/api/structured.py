"""Constrained decoding for ``response_format``: which tokens may come next so the output is JSON.

Pure logic on the coordinator (workers only apply the mask). A :class:`JsonFormat` (any JSON
object, or a JSON Schema) is compiled once per request against the model's vocabulary
(:class:`Vocabulary`, built once per tokenizer: ~1 s for 50k tokens, ~3 s for 150k) into a
grammar; each sequence gets its own :class:`JsonMatcher`, which gives per step the allowed-token
bitmask (packed ``uint8``, little bit order: token ``t`` is bit ``t % 8`` of byte ``t // 8``,
EOS set once the JSON is complete) and is advanced by the sampled token. Built on ``llguidance``
(the Rust structured-generation library), imported only here and only when used.

Output is compact (``", "`` and ``": "`` separators, no other whitespace between tokens of the
JSON): a small model given free whitespace at temperature 1 tends to spend its tokens on it.
``strict`` (OpenAI's flag) refuses schema keywords the grammar cannot enforce; without it they
are ignored (the output is JSON but may not meet them).

An object schema that declares ``properties`` and says nothing of ``additionalProperties`` takes
no other properties (:func:`closed_objects`): as llama.cpp's and xgrammar's converters do and
OpenAI's strict mode requires, since a small model left free to add keys may never close the
object. A schema allows more with ``"additionalProperties": true`` (or a schema for them).

Beside JSON formats, a Lark grammar with JSON Schemas embedded (:func:`embedded_schema`) compiles
the same way (tool calls: ``api.tools.call_grammar``), and a :class:`Constraint` with a
``trigger`` is lazy, as llama.cpp's lazy grammars: the output is free until the trigger text
appears, held to the grammar from just after it until the grammar completes, then free again.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_SCHEMA_CHARS = 1 << 16


class SchemaError(ValueError):
    """The response format cannot be compiled (one line, safe to show to the client)."""


@dataclass(frozen=True)
class JsonFormat:
    """What the output must be: ``json_object`` (any JSON object) or ``json_schema`` (``schema``)."""

    kind: str  # "json_object" | "json_schema"
    schema: Any = None  # a JSON Schema (dict or bool); None with json_schema: any JSON value
    strict: bool = False

    def schema_text(self) -> str:
        return json.dumps(self.schema_value())

    def schema_value(self) -> dict:
        """The schema the grammar enforces (objects closed, :func:`closed_objects`); :class:`SchemaError` when unusable."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise SchemaError(f"unknown response format {self.kind!r}")
        schema = self.schema
        if schema is None or schema is True:
            schema = {}
        if schema is False:
            raise SchemaError("the schema is `false`: no output can satisfy it")
        if not isinstance(schema, dict):
            raise SchemaError("the schema must be a JSON object")
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise SchemaError(f"the schema is {len(text)} characters long (at most {MAX_SCHEMA_CHARS})")
        return bounded_numbers(closed_objects(schema))


def embedded_schema(schema: Any, strict: bool = False) -> str:
    """``schema`` as llguidance's ``%json { ... }`` takes it inside a Lark grammar: objects closed,
    the compact separators, ``strict`` as for ``response_format``. :class:`SchemaError` when unusable."""
    value = JsonFormat("json_schema", schema, strict).schema_value()
    return json.dumps({**value, "x-guidance": {**SEPARATORS, "lenient": not strict}})


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "allOf")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` added to every object schema that declares
    ``properties`` and does not say whether others are allowed (a copy; the client's is untouched).

    Left as they are: objects without ``properties`` (``{"type": "object"}`` is any object), and
    ``allOf`` and its members, whose properties combine (closing one member would refuse the
    properties the others declare).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = [closed_objects(sub) for sub in out[key]] if isinstance(out[key], list) else closed_objects(out[key])
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


NUMBER_LIMIT = 1e15  # |x| below this: at most 16 integral digits (llama.cpp's converter allows 16)
NUMBER_STEP = 1e-9  # at most 9 decimals, no exponent


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every number and integer that sets no bounds of its own held to
    ``|x| <= NUMBER_LIMIT`` (numbers also to multiples of ``NUMBER_STEP``): a copy.

    JSON's numbers have no length, and a small model constrained to one writes digits until
    ``max_tokens`` ("population_millions": 14000000000000… or 14.5559999999…, measured on the
    bundled model with instructor's schemas); llama.cpp's converter bounds the digits the same
    way. A schema that gives any bound or ``multipleOf`` of its own, or ``enum``/``const``, is kept
    as it is; ``not`` is not entered (a bound there would widen what it refuses)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in out[key].items()}
    for key in (*_SCHEMA_LISTS, "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out and key != "not":
            out[key] = [bounded_numbers(sub) for sub in out[key]] if isinstance(out[key], list) else bounded_numbers(out[key])
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types & {"number", "integer"} and not any(k in out for k in ("enum", "const")):
        if not any(k in out for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf")):
            out["minimum"], out["maximum"] = -NUMBER_LIMIT, NUMBER_LIMIT
            if "integer" not in types:
                out["multipleOf"] = NUMBER_STEP
    return out


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated response format for one vocabulary."""

    text: str  # llguidance's grammar
    warnings: tuple[str, ...] = ()


class Vocabulary:
    """The model's tokens as the grammar engine sees them (expensive: build once per tokenizer)."""

    def __init__(self, tokenizer_json: str, eos_ids: tuple[int, ...], vocab_size: int | None = None):
        import llguidance as llg

        self._llg = llg
        self.eos_ids = tuple(eos_ids)
        self.ll = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos_ids))
        self.size = self.ll.vocab_size

    def compile(self, fmt: JsonFormat) -> Grammar:
        """The grammar for ``fmt``; :class:`SchemaError` (one line) when it is not a usable schema."""
        text = fmt.schema_text()
        options = {**SEPARATORS, "lenient": not fmt.strict}
        return self._validated(lambda: self._llg.LLMatcher.grammar_from_json_schema(text, overrides=options))

    def compile_lark(self, lark: str) -> Grammar:
        """A Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON Schema); :class:`SchemaError` (one line)."""
        return self._validated(lambda: self._llg.grammar_from("lark", lark))

    def _validated(self, make) -> Grammar:
        try:
            grammar = make()
            is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        except Exception as exc:  # noqa: BLE001 (whatever the engine says of a client's schema is a 400)
            raise SchemaError(f"invalid schema: {_one_line(str(exc)) or type(exc).__name__}") from None
        if is_error:
            raise SchemaError(f"invalid schema: {_one_line('; '.join(messages))}")
        return Grammar(grammar, tuple(_one_line(m) for m in messages))

    def matcher(self, grammar: Grammar) -> "JsonMatcher":
        m = self._llg.LLMatcher(self.ll, grammar.text, log_level=0)
        if m.is_error():
            raise SchemaError(f"invalid schema: {_one_line(m.get_error())}")
        return JsonMatcher(m, self.size, self.eos_ids, self.ll)


@dataclass
class JsonMatcher:
    """One sequence's position in the grammar: ``allowed()`` before each step, ``advance`` after it."""

    _m: Any  # llguidance.LLMatcher
    vocab_size: int
    eos_ids: tuple[int, ...]
    _vocab_ll: Any = None  # llguidance.LLTokenizer (advance_text)
    tokens: list[int] = field(default_factory=list)

    def allowed(self) -> np.ndarray:
        """Packed allowed-token bitmask, ``ceil(vocab_size / 8)`` bytes, little bit order."""
        words = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        if self._m.is_error():
            raise ValueError(f"grammar error: {_one_line(self._m.get_error())}")
        return words[: (self.vocab_size + 7) // 8].copy()

    def allowed_ids(self) -> np.ndarray:
        return np.flatnonzero(np.unpackbits(self.allowed(), bitorder="little")[: self.vocab_size])

    def advance_text(self, text: str) -> bool:
        """Take ``text`` (tokenized by the grammar engine); False, the matcher left in error, when it breaks the grammar."""
        ids = self._vocab_ll.tokenize_str(text) if text else []
        if not self._m.consume_tokens(ids):
            return False
        self.tokens.extend(int(t) for t in ids)
        return True

    def advance(self, token: int) -> None:
        """Take the sampled ``token``; ``ValueError`` when the grammar forbids it (the mask was not applied)."""
        if not self._m.consume_token(int(token)):
            raise ValueError(f"token {int(token)} breaks the response format: {_one_line(self._m.get_error())}")
        self.tokens.append(int(token))

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete JSON that meets the format (EOS is allowed)."""
        return self._m.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS may follow."""
        return self._m.is_stopped()


@dataclass
class TokenMask:
    """A sequence's ``SequenceState.token_mask`` (see ``runtime.controls``): given the ids generated
    so far (the same list again when a step is retried), the next token's allowed bitmask."""

    matcher: JsonMatcher

    def __call__(self, generated: list[int]) -> np.ndarray:
        done = self.matcher.tokens
        if len(generated) < len(done) or (done and generated[len(done) - 1] != done[-1]):
            raise ValueError("the generated tokens no longer follow the response format's matcher")
        for token in generated[len(done):]:
            self.matcher.advance(token)
        return self.matcher.allowed()

    def lookahead(self, generated: list[int], drafts: list[int]) -> list[np.ndarray]:
        """The masks after each of ``drafts`` in turn (speculative decoding: a mask per verified
        position), as far as the grammar allows them: a draft it forbids, or an EOS, ends the list
        (the target could not keep it). The matcher is left where ``generated`` put it."""
        mask, m = self(generated), self.matcher._m
        out: list[np.ndarray] = []
        try:
            for d in drafts:
                d = int(d)
                if d in self.matcher.eos_ids or not 0 <= d < self.matcher.vocab_size or not (mask[d >> 3] >> (d & 7)) & 1:
                    break
                if not m.consume_token(d):
                    raise ValueError(f"draft {d} breaks the response format although its mask allows it")
                mask = self.matcher.allowed()
                out.append(mask)
        finally:
            if out:
                m.rollback(len(out))
        return out


@dataclass
class TriggeredMask:
    """A ``SequenceState.token_mask`` that is free (None) until ``trigger`` appears in the output,
    then the grammar's mask from just after the trigger until the grammar completes, then free
    again (each later trigger starts a fresh matcher). When the text already written after a
    trigger cannot start the grammar (it arrived in the same token), that occurrence stays free."""

    vocab: Vocabulary
    grammar: Grammar
    trigger: str
    seen: list[int] = field(default_factory=list)  # the generated ids taken so far
    free_from: int = 0  # where in ``seen`` the current free stretch starts
    matcher: JsonMatcher | None = None

    def __call__(self, generated: list[int]) -> np.ndarray | None:
        if len(generated) < len(self.seen) or (self.seen and generated[len(self.seen) - 1] != self.seen[-1]):
            raise ValueError("the generated tokens no longer follow the grammar's matcher")
        for token in generated[len(self.seen):]:
            self.seen.append(int(token))
            if self.matcher is not None:
                self.matcher.advance(token)
                if self.matcher.is_finished:
                    self.matcher, self.free_from = None, len(self.seen)
            else:
                self._start_if_triggered()
        return self.matcher.allowed() if self.matcher is not None else None

    def _start_if_triggered(self) -> None:
        # Checked after every token, so a new trigger ends in the newest one: the last few tokens
        # hold it (each decodes to at least one character), whatever the length of the answer.
        window = max(self.free_from, len(self.seen) - len(self.trigger) - 8)
        text = self.vocab.ll.decode_str(self.seen[window:])
        at = text.find(self.trigger)
        if at == -1:
            return
        matcher = self.vocab.matcher(self.grammar)
        if matcher.advance_text(text[at + len(self.trigger):]) and not matcher.is_finished:
            self.matcher = matcher
        else:
            self.free_from = len(self.seen)


@dataclass(frozen=True)
class Constraint:
    """A request's compiled format; one mask per sequence (:class:`TokenMask`, or with a
    ``trigger`` a :class:`TriggeredMask`)."""

    vocab: Vocabulary
    grammar: Grammar
    trigger: str | None = None

    def token_mask(self) -> TokenMask | TriggeredMask:
        if self.trigger is not None:
            return TriggeredMask(self.vocab, self.grammar, self.trigger)
        return TokenMask(self.vocab.matcher(self.grammar))


NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def from_openai(kind: str, json_schema: Any = None) -> JsonFormat | None:
    """OpenAI's ``response_format`` (``type`` and its ``json_schema`` object) as a :class:`JsonFormat`;
    None for ``text``; :class:`SchemaError` naming what is wrong."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonFormat("json_object")
    if kind != "json_schema":
        raise SchemaError(f"unknown type {kind!r} (text, json_object or json_schema)")
    if not isinstance(json_schema, dict):
        raise SchemaError("type json_schema needs a 'json_schema' object ({'name': ..., 'schema': {...}, 'strict': true})")
    name, strict = json_schema.get("name"), json_schema.get("strict")
    if name is not None and not (isinstance(name, str) and 1 <= len(name) <= 64 and set(name) <= NAME_CHARS):
        raise SchemaError("json_schema.name must be 1-64 letters, digits, '_' or '-'")
    if strict is not None and not isinstance(strict, bool):
        raise SchemaError("json_schema.strict must be true or false")
    return JsonFormat("json_schema", json_schema.get("schema"), bool(strict))


def constraint_for(text_tokenizer, vocab_size: int | None, fmt: JsonFormat) -> Constraint:
    """Compile ``fmt`` for a model's tokenizer (blocking: the first call per tokenizer takes seconds;
    run it in a thread). :class:`SchemaError` (one line) when the format cannot be used."""
    vocab = vocabulary_for(text_tokenizer, vocab_size)
    return Constraint(vocab, vocab.compile(fmt))


def lark_constraint_for(text_tokenizer, vocab_size: int | None, lark: str, trigger: str | None = None) -> Constraint:
    """As :func:`constraint_for`, for a Lark grammar (lazy when ``trigger`` is given)."""
    vocab = vocabulary_for(text_tokenizer, vocab_size)
    return Constraint(vocab, vocab.compile_lark(lark), trigger)


_VOCABS: dict[int, tuple[weakref.ref, Vocabulary]] = {}
_LOCK = threading.Lock()


def vocabulary_for(text_tokenizer, vocab_size: int | None = None) -> Vocabulary:
    """The :class:`Vocabulary` of an ``edgepipe.model.tokenizer.TextTokenizer``, built once and kept
    while the tokenizer lives (call from a thread: the first build takes seconds)."""
    with _LOCK:
        key = id(text_tokenizer)
        entry = _VOCABS.get(key)
        if entry is not None and entry[0]() is text_tokenizer:
            return entry[1]
        tok = text_tokenizer.tokenizer
        size = vocab_size if vocab_size and vocab_size >= tok.get_vocab_size(with_added_tokens=True) else None
        vocab = Vocabulary(tok.to_str(), text_tokenizer.eos_ids, size)
        _VOCABS[key] = (weakref.ref(text_tokenizer, lambda _r, k=key: _VOCABS.pop(k, None)), vocab)
        return vocab


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:300]
