"""JSON output (``response_format``) through 3 real workers with the openai SDK (issue 15, must-show 2).

The coordinator builds the allowed-token mask per step (``api.structured``, llguidance) and
the last stage's head graph applies it, so sampled answers always parse: 20 answers sampled at
temperature 1 with different seeds all validate against a json_schema; json_object (chat,
streaming, completions, Ollama's ``format``) parses; an invalid schema is a 400 before admission;
max_tokens reached before the JSON closes ends with finish_reason "length".
"""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest


openai = pytest.importorskip("openai")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Invent a person. Answer in JSON with their name and age."}]


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


@pytest.fixture(scope="module")
def client(three_workers_openai):
    return three_workers_openai


@pytest.mark.slow  # 18 s: -m slow (greedy JSON answers stay in the default run)
def test_twenty_sampled_answers_validate(client):
    validator = jsonschema_rs.validator_for(PERSON)
    answers = []
    for seed in (100, 200):  # n=10 each: choice seeds seed..seed+9, twenty different seeds
        r = client.chat.completions.create(model="smollm2", messages=ASK, temperature=1.0, seed=seed, n=10, max_tokens=48,
                                           response_format=FORMAT)
        answers += [(c.message.content, c.finish_reason) for c in r.choices]
    assert len(answers) == 20
    for text, finish in answers:
        assert finish == "stop", text  # the schema bounds the answer well inside max_tokens
        assert validator.is_valid(json.loads(text)), text
    assert len({text for text, _ in answers}) > 5  # sampled, not one answer twenty times


def test_json_object_parses_streaming_and_not(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=96, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48, temperature=1.0, seed=3, stream=True,
                                            response_format=FORMAT)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(text)), text


def test_completions_take_response_format_and_length_ends_early(client):
    r = client.completions.create(model="smollm2", prompt="A person as JSON:", max_tokens=48, temperature=1.0, seed=5,
                                  extra_body={"response_format": FORMAT})
    assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(r.choices[0].text)), r.choices[0].text
    short = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=3, temperature=0, response_format=FORMAT)
    assert short.choices[0].finish_reason == "length" and short.choices[0].message.content.startswith("{")


def test_two_field_schema_without_additional_properties_closes(client):
    """The schema says nothing of additionalProperties: the object still closes after its two fields."""
    two = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
           "required": ["name", "age"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": two}}
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(model="smollm2", messages=ASK, temperature=temperature, seed=7, n=4 if temperature else 1,
                                           max_tokens=60, response_format=fmt, extra_body={"return_token_ids": True})
        for choice in r.choices:
            text = choice.message.content
            assert choice.finish_reason == "stop", text
            assert len(choice.model_extra["token_ids"]) <= 40, text  # well within 60
            assert set(json.loads(text)) == {"name", "age"}, text


@pytest.mark.parametrize("fmt,words", [
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}, "Unsatisfiable"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {}}, "strict": True}}, "Unimplemented"),
    ({"type": "json_schema"}, "json_schema"),
])
def test_invalid_schema_is_a_400_before_admission(server, fmt, words):
    r = server.client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "response_format": fmt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and words in err["message"] and "\n" not in err["message"]
    admission = server.status()["admission"]
    assert admission["active"] == 0 and admission["queued"] == 0


def test_ollama_format_json_and_schema(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/api/chat", json={"model": "smollm2", "messages": ASK, "stream": False, "format": "json",
                                      "options": {"num_predict": 96, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["message"]["content"]), dict)
        r = c.post("/api/generate", json={"model": "smollm2", "prompt": "A person:", "stream": False, "format": PERSON,
                                          "options": {"num_predict": 48, "temperature": 1, "seed": 9}})
        assert jsonschema_rs.validator_for(PERSON).is_valid(json.loads(r.json()["response"])), r.text


def test_json_output_with_ignore_eos_or_tools_is_refused(server):
    tool = {"type": "function", "function": {"name": "get_time"}}
    for extra in ({"ignore_eos": True}, {"tools": [tool], "tool_choice": "auto"}):
        r = server.client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"},
                                                            **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = server.client.post("/api/chat", json={"model": "smollm2", "messages": ASK, "stream": False, "format": {"type": "strng"}})
    assert r.status_code == 400 and "Invalid type" in r.json()["error"], r.text
