"""Constrained decoding (pure): random walks over the allowed tokens always spell JSON that meets the schema.

With the bundled SmolLM2 tokenizer and the real Qwen2.5 0.5B one (skipped, not passed, when its
GGUF is absent): every walk, decoded by edgepipe's own tokenizer, parses and validates; the
mask forbids tokens that would break the JSON, allows EOS only once it is complete, and only
EOS after the last brace. Invalid schemas are refused in one line.
"""

from __future__ import annotations

import json

import jsonschema_rs
import numpy as np
import pytest

from edgepipe.api.structured import Constraint, JsonFormat, SchemaError, closed_objects, from_openai, vocabulary_for
from edgepipe.model.gguf_source import GGUFSource
from edgepipe.model.store import bundled_gguf, local_form, missing_reference, reference_gguf
from edgepipe.model.tokenizer import TextTokenizer
from edgepipe.runtime.stage_runner import SamplingBatch

QWEN = reference_gguf("qwen05")
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"], "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "score": {"type": "number", "minimum": -1000, "maximum": 1000}}}


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-0.5b"])
def model(request):
    path = bundled_gguf() if request.param == "smollm2" else QWEN
    if not path.is_file():
        pytest.fail(missing_reference("qwen05"))
    src = GGUFSource(path)
    info = src.tokenizer_info()
    tok = TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)
    return tok, vocabulary_for(tok), closing_ranks(tok, vocabulary_for(tok).size)


def walk(tok, vocab, ranks, fmt: JsonFormat, seed: int, explore: int = 25, limit: int = 400) -> list[int]:
    """Sample allowed tokens at random for ``explore`` steps, then prefer ones that close the JSON."""
    rng = np.random.default_rng(seed)
    m = vocab.matcher(vocab.compile(fmt))
    out: list[int] = []
    for step in range(limit):
        allowed = m.allowed_ids()
        assert allowed.size, f"no token allowed after {tok.decode(out)!r}"
        if step >= explore:
            allowed = allowed[ranks[allowed] == ranks[allowed].min()]
        token = int(rng.choice(allowed))
        m.advance(token)
        if token in tok.eos_ids:
            assert m.is_accepting
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {limit} tokens: {tok.decode(out)!r}")


def closing_ranks(tok, size: int) -> np.ndarray:
    """Per token, how soon it tends to end the JSON: EOS 0, a closing bracket 1, a quote 2, digits 3, others 4."""
    def rank(token: int) -> int:
        text = tok.decode([token])
        return next((i for i, chars in enumerate(("}]", '"', "0123456789,"), 1) if any(c in text for c in chars)), 4)
    ranks = np.array([rank(t) for t in range(size)])
    ranks[list(tok.eos_ids)] = 0
    return ranks


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_validate_against_the_schema(model, seed):
    tok, vocab, ranks = model
    validator = jsonschema_rs.validator_for(PERSON)
    text = tok.decode(walk(tok, vocab, ranks, JsonFormat("json_schema", PERSON, strict=True), seed, explore=10 + 15 * seed))
    value = json.loads(text)
    assert validator.is_valid(value), (text, [e.message for e in validator.iter_errors(value)])


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_of_json_object_are_objects(model, seed):
    tok, vocab, ranks = model
    text = tok.decode(walk(tok, vocab, ranks, JsonFormat("json_object"), seed, explore=20))
    assert isinstance(json.loads(text), dict), text


def test_mask_forbids_what_breaks_the_json_and_ends_with_eos(model):
    tok, vocab, ranks = model
    m = vocab.matcher(vocab.compile(JsonFormat("json_schema", PERSON, strict=True)))
    bits = m.allowed()
    assert bits.dtype == np.uint8 and bits.size == (vocab.size + 7) // 8
    first = m.allowed_ids().tolist()
    assert first and all(tok.decode([t]).startswith("{") for t in first)  # '{"' may be one token
    assert not {tok.encode(text)[0] for text in ("}", "[", "hello", '"', " ")} & set(first)
    assert not set(tok.eos_ids) & set(first)
    for t in tok.encode('{"name": "Ann", "age": 41'):
        m.advance(t)
    after = set(m.allowed_ids().tolist())
    assert tok.encode("]")[0] not in after and tok.encode("}")[0] not in after  # "ok" is required
    assert tok.encode(",")[0] in after and not set(tok.eos_ids) & after
    with pytest.raises(ValueError, match="breaks the response format"):
        vocab.matcher(vocab.compile(JsonFormat("json_object"))).advance(tok.encode("]")[0])
    for t in tok.encode(', "ok": true}'):
        m.advance(t)
    assert m.is_accepting and m.is_finished
    assert set(m.allowed_ids().tolist()) == set(tok.eos_ids)


@pytest.mark.parametrize("schema,words", [
    ({"type": "strng"}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "/nope"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
    ({"not": {"type": "string"}}, "Unimplemented"),  # strict: a keyword the grammar cannot enforce
    (False, "no output"),
    ([1, 2], "JSON object"),
])
def test_invalid_schemas_are_refused_in_one_line(model, schema, words):
    _, vocab, _ = model
    with pytest.raises(SchemaError) as info:
        vocab.compile(JsonFormat("json_schema", schema, strict=True))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_without_strict_unenforceable_keywords_are_warnings(model):
    _, vocab, _ = model
    grammar = vocab.compile(JsonFormat("json_schema", {"type": "object", "not": {"required": ["a"]}}, strict=False))
    assert any("not" in w for w in grammar.warnings)
    assert vocab.compile(JsonFormat("json_schema", None)).text  # no schema: any JSON value


def test_token_mask_follows_the_generated_ids_and_tolerates_retries(model):
    tok, vocab, _ = model
    fmt = from_openai("json_schema", {"name": "person", "schema": PERSON, "strict": True})
    mask = Constraint(vocab, vocab.compile(fmt)).token_mask()
    ids = tok.encode('{"name": "Bo", "age": 7, "ok": true}')
    first = mask([])
    assert np.array_equal(first, mask([]))  # a retried step asks again: same answer, nothing consumed twice
    for k in range(1, len(ids) + 1):
        bits = np.unpackbits(mask(ids[:k]), bitorder="little")
        assert k == len(ids) or bits[ids[k]], f"the mask forbids the next token of valid JSON at {k}"
    assert mask.matcher.is_finished and {int(i) for i in np.flatnonzero(bits)} == set(tok.eos_ids)
    with pytest.raises(ValueError, match="no longer follow"):
        mask(ids[:2])


@pytest.mark.parametrize("kind,json_schema,words", [
    ("json_schema", None, "needs a 'json_schema' object"),
    ("json_schema", {"name": "has space", "schema": {}}, "json_schema.name"),
    ("json_schema", {"name": "x", "schema": {}, "strict": "yes"}, "strict"),
    ("xml", None, "unknown type"),
])
def test_openai_response_formats_are_checked(kind, json_schema, words):
    with pytest.raises(SchemaError, match=words):
        from_openai(kind, json_schema)


def test_openai_response_formats_map_to_json_formats():
    assert from_openai("text") is None and from_openai("json_object") == JsonFormat("json_object")
    assert from_openai("json_schema", {"name": "p", "schema": PERSON, "strict": True}) == JsonFormat("json_schema", PERSON, True)


TWO_FIELDS = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


def test_declared_properties_close_the_object_unless_the_schema_opens_it(model):
    tok, vocab, _ = model
    comma, brace = tok.encode(",")[0], tok.encode("}")[0]

    def after_two_fields(schema) -> set[int]:
        m = vocab.matcher(vocab.compile(JsonFormat("json_schema", schema)))
        for t in tok.encode('{"name": "Ann", "age": 41'):
            m.advance(t)
        return set(m.allowed_ids().tolist())

    closed = after_two_fields(TWO_FIELDS)
    assert brace in closed and comma not in closed  # no third property
    assert comma in after_two_fields({**TWO_FIELDS, "additionalProperties": True})
    assert comma in after_two_fields({**TWO_FIELDS, "additionalProperties": {"type": "string"}})


def test_closed_objects_adds_false_only_where_the_schema_is_silent():
    nested = {"type": "object", "properties": {"pet": {"type": "object", "properties": {"kind": {"type": "string"}}},
                                                "tags": {"type": "array", "items": {"properties": {"x": {}}}},
                                                "any": {"type": "object"}},
              "$defs": {"d": {"properties": {"y": {}}, "additionalProperties": True}},
              "anyOf": [{"properties": {"z": {}}}], "allOf": [{"properties": {"w": {}}}]}
    out = closed_objects(nested)
    props = out["properties"]
    assert props["pet"]["additionalProperties"] is False and props["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["any"]  # no properties declared: any object
    assert out["$defs"]["d"]["additionalProperties"] is True and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out and "additionalProperties" not in out["allOf"][0]  # allOf combines members
    assert "additionalProperties" not in nested["properties"]["pet"]  # the client's schema is not changed


def test_each_row_gets_its_own_mask_when_a_batch_is_not_in_row_order(native_pkg):
    """A decode batch whose sequences hold their KV rows in another order (b, a on rows 1, 0) must
    still apply each sequence's mask and sampling draw to that sequence's row (they went to the
    batch position's row, so n > 1 JSON answers through a worker broke their grammar)."""
    pipe, tok = native_pkg.pipeline(precision=local_form(native_pkg)), native_pkg.tokenizer
    vocab = pipe.runners[-1].vocab
    only = {name: tok.encode(text)[0] for name, text in (("a", "{"), ("b", "["))}
    prompt = np.array([tok.encode("Once upon a time")], np.int64)

    def run(seqs, x, masks):
        items = [{"seq": s, "sampling": {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.5,
                                         "mask": np.packbits(np.arange(vocab) == only[m], bitorder="little").tobytes()}}
                 for s, m in zip(seqs, masks)]
        sampling = SamplingBatch.from_wire(items, vocab)
        for runner in pipe.runners:
            x = runner.run_batch(seqs, x, sampling if runner.emits_tokens else None)
        return [int(t) for t in x]

    try:
        assert run(["a"], prompt, "a") == [only["a"]] and run(["b"], prompt, "b") == [only["b"]]
        assert run(["b", "a"], np.array([[only["b"]], [only["a"]]], np.int64), "ba") == [only["b"], only["a"]]
    finally:
        pipe.drop("a")
        pipe.drop("b")


def test_numbers_without_bounds_get_a_length():
    """A number or integer without bounds of its own is held to |x| <= 1e15 (numbers to 9 decimals);
    a client's own bounds, multipleOf, enum and what sits under ``not`` are left alone."""
    from edgepipe.api.structured import NUMBER_LIMIT, bounded_numbers

    schema = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "integer"}, "c": {"type": ["number", "null"]},
                                               "d": {"type": "number", "maximum": 5}, "e": {"type": "number", "enum": [1.5, 2]},
                                               "f": {"not": {"type": "number"}}, "g": {"type": "array", "items": {"type": "number"}}}}
    out = bounded_numbers(schema)["properties"]
    assert out["a"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": 1e-9}
    assert out["b"] == {"type": "integer", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
    assert out["c"]["multipleOf"] == 1e-9
    assert out["d"] == {"type": "number", "maximum": 5}
    assert out["e"] == {"type": "number", "enum": [1.5, 2]}
    assert out["f"] == {"not": {"type": "number"}}
    assert out["g"]["items"]["maximum"] == NUMBER_LIMIT
    assert schema["properties"]["a"] == {"type": "number"}  # the client's schema is not touched
