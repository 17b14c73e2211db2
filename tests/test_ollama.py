"""The Ollama API, spoken by the official ``ollama`` Python client, through real workers."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import jsonschema_rs
import pytest

from edgepipe.api.ollama_routes import parameter_count
from edgepipe.model.store import local_form


ollama = pytest.importorskip("ollama")
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": "Bearer sekrit"})


def openai_chat(server, **body) -> dict:
    r = server.client.post("/v1/chat/completions", json={"temperature": 0, **body}, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200, r.text
    return r.json()


def test_list_show_version(server, client):
    models = client.list().models
    assert len(models) == 1 and models[0].model.endswith(":latest") and models[0].size > 0
    info = client.show(models[0].model)
    assert info.modelinfo["general.architecture"] == "llama" and "im_start" in info.template
    assert httpx.get(server.url + "/api/version", headers={"Authorization": "Bearer sekrit"}).json()["version"]
    assert httpx.get(server.url + "/api/tags").status_code == 401  # the key guards the Ollama routes too


def test_chat_streaming_and_not_match_openai(server, client):
    name = client.list().models[0].model
    whole = client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 12})
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count >= 1
    pieces = list(client.chat(model=name, messages=QUESTION, stream=True, options={"temperature": 0, "num_predict": 12}))
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(p.message.content for p in pieces) == whole.message.content
    reference = openai_chat(server, messages=QUESTION, max_tokens=12)
    assert whole.message.content == reference["choices"][0]["message"]["content"]  # greedy: the same tokens


def test_generate_with_options(server, client):
    name = client.list().models[0].model
    raw = client.generate(model=name, prompt="The sky is", raw=True, options={"temperature": 0, "num_predict": 6})
    assert raw.response and raw.eval_count == 6 and raw.done_reason == "length"
    assert raw.context is None  # as Ollama: raw mode returns no context
    streamed = "".join(p.response for p in client.generate(model=name, prompt="The sky is", raw=True, stream=True,
                                                           options={"temperature": 0, "num_predict": 6}))
    assert streamed == raw.response
    sampled = [client.generate(model=name, prompt="Once upon a time", raw=True,
                               options={"num_predict": 10, "temperature": 1.0, "seed": 3, "top_k": 40, "top_p": 0.9}).response
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    words = raw.response.split()
    stopped = client.generate(model=name, prompt="The sky is", raw=True, options={"temperature": 0, "num_predict": 6, "stop": [words[-1]]})
    assert words[-1] not in stopped.response and stopped.done_reason == "stop"
    templated = client.generate(model=name, prompt="Name three colours.", options={"temperature": 0, "num_predict": 12})
    assert templated.response == client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 12}).message.content
    assert len(templated.context) == templated.prompt_eval_count + templated.eval_count


def test_penalties_as_openai(server, client):
    """Ollama's presence/frequency penalties mean what OpenAI's do: the same greedy text."""
    name = client.list().models[0].model
    plain = client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 16}).message.content
    penalised = client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 16, "frequency_penalty": 2.0,
                                                                    "presence_penalty": 1.0}).message.content
    reference = openai_chat(server, messages=QUESTION, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised == reference["choices"][0]["message"]["content"] and penalised != plain
    r = httpx.post(server.url + "/api/chat", headers={"Authorization": "Bearer sekrit"},
                   json={"model": name, "messages": QUESTION, "options": {"frequency_penalty": 3}})
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]


def test_repeat_penalty_is_llama_cpps_and_exact_through_the_workers(server, client, native_pkg):
    """repeat_penalty / repeat_last_n (llama.cpp's multiplicative penalty, applied in the head graph)
    change the greedy answer, and the cluster gives the single process's tokens for them; 1.0 is
    the plain answer; out-of-range values are a 400 in Ollama's shape."""
    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams

    name = client.list().models[0].model
    plain = client.generate(model=name, prompt="Say cat cat cat cat cat cat.", options={"temperature": 0, "num_predict": 20})
    penalised = client.generate(model=name, prompt="Say cat cat cat cat cat cat.", options={"temperature": 0, "num_predict": 20, "repeat_penalty": 1.5,
                                                                                          "repeat_last_n": 32})
    same = client.generate(model=name, prompt="Say cat cat cat cat cat cat.", options={"temperature": 0, "num_predict": 20, "repeat_penalty": 1.0})
    assert penalised.response != plain.response and same.response == plain.response
    tok = native_pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": "Say cat cat cat cat cat cat."}]))
    want = generate(native_pkg.pipeline(precision=local_form(native_pkg)), ids, GenerationParams(max_tokens=20, repeat_penalty=1.5, repeat_last_n=32), tok.decode,
                    native_pkg.manifest.eos_ids)
    assert penalised.context[len(ids):] == [t for t in want.tokens if t not in native_pkg.manifest.eos_ids]
    r = httpx.post(server.url + "/api/generate", headers={"Authorization": "Bearer sekrit"},
                   json={"model": name, "prompt": "hi", "options": {"repeat_penalty": 0}})
    assert r.status_code == 400 and "repeat_penalty" in r.json()["error"]


def test_the_key_guards_the_openai_routes(server):
    """--api-key on the OpenAI routes too: 401 without it or with another, the openai SDK with it."""
    openai = pytest.importorskip("openai")
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = server.client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    reply = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit").chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=4)
    assert reply.usage.completion_tokens >= 1


def test_errors_in_ollama_shape(server, client):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3:8b", messages=QUESTION)
    assert info.value.status_code == 404 and "not found" in info.value.error
    r = httpx.post(server.url + "/api/generate", headers={"Authorization": "Bearer sekrit"},
                   json={"model": client.list().models[0].model, "prompt": "x", "options": {"top_k": 2**64}})
    assert r.status_code == 400 and "top_k" in r.json()["error"]
    r = httpx.post(server.url + "/api/chat", headers={"Authorization": "Bearer sekrit"}, content=b"{nope")
    assert r.status_code == 400 and json.loads(r.text)["error"]


def test_raw_sends_the_prompt_as_it_is(server, client, native_pkg):
    """raw: the prompt is not wrapped in the template: the template's own text sent raw gives the templated answer."""
    name = client.list().models[0].model
    templated = client.generate(model=name, prompt="Name three colours.", options={"temperature": 0, "num_predict": 10})
    rendered = native_pkg.tokenizer.format_chat([{"role": "user", "content": "Name three colours."}])
    raw = client.generate(model=name, prompt=rendered, raw=True, options={"temperature": 0, "num_predict": 10})
    assert raw.response == templated.response and raw.context is None and templated.context
    unwrapped = client.generate(model=name, prompt="Name three colours.", raw=True, options={"temperature": 0, "num_predict": 10})
    assert unwrapped.prompt_eval_count < templated.prompt_eval_count  # no template around it


def test_format_schema_with_the_client(client):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    name = client.list().models[0].model
    for seed in (1, 2, 3):
        r = client.chat(model=name, messages=[{"role": "user", "content": "Invent a person."}], format=person,
                        options={"num_predict": 48, "temperature": 1.0, "seed": seed})
        assert r.done_reason == "stop" and jsonschema_rs.validator_for(person).is_valid(json.loads(r.message.content)), r.message.content
    # (a prompt with a short answer: asked for "A JSON object:", the greedy 135M model nests keys past any limit)
    r = client.generate(model=name, prompt="What is the capital of France? Answer in JSON.", format="json", options={"temperature": 0, "num_predict": 48})
    assert r.done_reason == "stop" and isinstance(json.loads(r.response), dict), r.response


def test_show_gives_ollamas_fields(client, native_pkg):
    name = client.list().models[0].model
    info = client.show(name)
    config = native_pkg.manifest.config
    assert info.details.parameter_size == "134.52M"  # what Ollama shows for smollm2:135m
    assert parameter_count(config) == info.modelinfo["general.parameter_count"]
    assert info.details.family == "llama" and info.details.format == "gguf" and info.details.quantization_level
    for key, value in (("llama.context_length", native_pkg.manifest.max_context), ("llama.embedding_length", 576),
                       ("llama.block_count", 30), ("llama.attention.head_count", 9), ("llama.attention.head_count_kv", 3),
                       ("llama.feed_forward_length", 1536), ("llama.vocab_size", 49152)):
        assert info.modelinfo[key] == value, key
    assert "completion" in info.capabilities and "tools" in info.capabilities
    assert 'stop' in info.parameters and "<|im_end|>" in info.parameters and info.modelfile.startswith("# Modelfile")
    assert info.template == native_pkg.tokenizer.chat_template


def test_keep_alive_and_ps(client):
    name = client.list().models[0].model

    def expires_in() -> float | None:
        models = client.ps().models
        assert len(models) <= 1
        return (models[0].expires_at - datetime.now(timezone.utc)).total_seconds() if models else None

    client.generate(model=name, prompt="hi", options={"temperature": 0, "num_predict": 2}, keep_alive="10m")
    running = client.ps().models[0]
    assert running.model == name and running.context_length and running.details.parameter_size == "134.52M"
    assert 540 < expires_in() <= 600
    assert client.generate(model=name, keep_alive=0).done_reason == "unload"
    assert expires_in() is None  # unloaded: not running
    assert client.generate(model=name, keep_alive=-1).done_reason == "load"
    assert expires_in() > 100 * 365 * 86400  # for ever
    client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 2}, keep_alive=90)
    assert 30 < expires_in() <= 90
    client.chat(model=name, messages=QUESTION, options={"temperature": 0, "num_predict": 2})  # the default: 5 minutes
    assert 240 < expires_in() <= 300
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model=name, prompt="hi", keep_alive="soon")
    assert info.value.status_code == 400 and "keep_alive" in info.value.error
