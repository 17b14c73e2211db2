"""The Ollama API, spoken by the official ``ollama`` Python client, through real workers."""

from __future__ import annotations

import json

import httpx
import pytest


ollama = pytest.importorskip("ollama")
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": "Bearer sekrit"})


def openai_chat(server, **body) -> dict:
    r = server.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekrit"})
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
    whole = client.chat(model=name, messages=QUESTION, options={"num_predict": 12})
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count >= 1
    pieces = list(client.chat(model=name, messages=QUESTION, stream=True, options={"num_predict": 12}))
    assert pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(p.message.content for p in pieces) == whole.message.content
    reference = openai_chat(server, messages=QUESTION, max_tokens=12)
    assert whole.message.content == reference["choices"][0]["message"]["content"]  # greedy: the same tokens


def test_generate_with_options(server, client):
    name = client.list().models[0].model
    raw = client.generate(model=name, prompt="The sky is", raw=True, options={"num_predict": 6})
    assert raw.response and raw.eval_count == 6 and raw.context[-6:] and raw.done_reason == "length"
    streamed = "".join(p.response for p in client.generate(model=name, prompt="The sky is", raw=True, stream=True,
                                                           options={"num_predict": 6}))
    assert streamed == raw.response
    sampled = [client.generate(model=name, prompt="Once upon a time", raw=True,
                               options={"num_predict": 10, "temperature": 1.0, "seed": 3, "top_k": 40, "top_p": 0.9}).response
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    words = raw.response.split()
    stopped = client.generate(model=name, prompt="The sky is", raw=True, options={"num_predict": 6, "stop": [words[-1]]})
    assert words[-1] not in stopped.response and stopped.done_reason == "stop"
    templated = client.generate(model=name, prompt="Name three colours.", options={"num_predict": 12})
    assert templated.response == client.chat(model=name, messages=QUESTION, options={"num_predict": 12}).message.content


def test_penalties_as_openai(server, client):
    """Ollama's presence/frequency penalties mean what OpenAI's do: the same greedy text."""
    name = client.list().models[0].model
    plain = client.chat(model=name, messages=QUESTION, options={"num_predict": 16}).message.content
    penalised = client.chat(model=name, messages=QUESTION, options={"num_predict": 16, "frequency_penalty": 2.0,
                                                                    "presence_penalty": 1.0}).message.content
    reference = openai_chat(server, messages=QUESTION, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalised == reference["choices"][0]["message"]["content"] and penalised != plain
    r = httpx.post(server.url + "/api/chat", headers={"Authorization": "Bearer sekrit"},
                   json={"model": name, "messages": QUESTION, "options": {"frequency_penalty": 3}})
    assert r.status_code == 400 and "frequency_penalty" in r.json()["error"]


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
