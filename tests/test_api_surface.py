"""The API surface of issue 15 and the input hardening of issue 11, through 3 real workers.

Bad input gets a one-line OpenAI-shaped 400 before admission and never costs a slot; clients
that leave (queued or running, streaming or not) free their slot; n > 1, prompt lists and token
ids, model lookup, reported seeds, tools with the openai SDK.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from harness import Server

CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
    if param:
        assert err["param"] == param, err
    return err


def chat(server, **patch) -> dict:
    r = server.client.post("/v1/chat/completions", json={**CHAT, **patch})
    assert r.status_code == 200, r.text
    return r.json()


def admission(server) -> dict:
    return server.status()["admission"]


MALFORMED = [
    ("chat", {**CHAT, "stream": True, "stream_options": "x"}, "stream_options"),
    ("chat", {**CHAT, "top_k": 2**64}, "top_k"),
    ("chat", {**CHAT, "top_k": -1}, "top_k"),
    ("chat", {**CHAT, "seed": 2**64}, "seed"),
    ("chat", {**CHAT, "temperature": "hot"}, "temperature"),
    ("chat", {**CHAT, "temperature": True}, "temperature"),
    ("chat", {**CHAT, "top_p": 0}, "top_p"),
    ("chat", {**CHAT, "min_p": 1.5}, "min_p"),
    ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ("chat", {**CHAT, "max_tokens": 2**53}, "max_tokens"),  # (10**6 is clamped to the context, as llama-server does)
    ("chat", {**CHAT, "n": 0}, "n"),
    ("chat", {**CHAT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("chat", {**CHAT, "stop": [""]}, "stop"),
    ("chat", {**CHAT, "messages": [{"role": "user"}, 3]}, "messages"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {**CHAT, "stream": "yes"}, "stream"),
    ("chat", {**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ("chat", {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ("chat", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}}, "response_format"),
    ("completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("completions", {"prompt": [1, -2]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [[1], "x"]}, "prompt"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias"),
    ("completions", {"max_tokens": 3}, "prompt"),
]
RAW = [b'{"messages": [', b"[1, 2]", b"\xff\xfe\x00", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
       b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e400}',
       b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}']


@pytest.mark.parametrize("route,body,param", MALFORMED, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(MALFORMED)])
def test_bad_field_is_a_400_naming_it(server, route, body, param):
    assert_error(server.client.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body), 400, param)


def test_forty_malformed_requests_leak_nothing(server):
    """40 bad requests (streaming ones among them) with max_active 16, then a normal one still answers."""
    bodies = [json.dumps(b).encode() for _, b, _ in MALFORMED if _ == "chat"] + RAW
    sent = 0
    with httpx.Client(base_url=server.url, timeout=30) as c:
        while sent < 40:
            r = c.post("/v1/chat/completions", content=bodies[sent % len(bodies)], headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
            sent += 1
    a = admission(server)
    assert a["active"] == 0 and a["queued"] == 0 and a["max_active"] == 16
    assert chat(server)["usage"]["completion_tokens"] >= 1


def test_non_finite_and_garbage_bodies(server):
    for raw in RAW:
        err = assert_error(server.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
        assert len(err["message"]) <= 300


def test_streams_hung_up_at_once_free_their_slots(server):
    for _ in range(17):  # more than max_active: a leak would block the last one
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}) as r:
                assert r.status_code == 200
    server.wait_for(lambda s: s["admission"]["active"] == 0 and s["requests_in_flight"] == 0, timeout=30)
    assert chat(server)["choices"][0]["message"]["content"]


def test_models_by_id(server):
    name = server.client.get("/v1/models").json()["data"][0]["id"]
    card = server.client.get(f"/v1/models/{name}").json()
    assert card["id"] == name and card["object"] == "model"
    assert_error(server.client.get("/v1/models/gpt-17"), 404, "model")


def test_n_choices_are_separate_sequences(server):
    one = chat(server, max_tokens=6)
    greedy = chat(server, max_tokens=6, n=2)
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert all(c["message"]["content"] == one["choices"][0]["message"]["content"] for c in greedy["choices"])
    assert greedy["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]
    sampled = chat(server, max_tokens=8, n=3, temperature=1.0, seed=7)
    texts = [c["message"]["content"] for c in sampled["choices"]]
    assert len(set(texts)) > 1, texts  # different seeds per choice
    again = chat(server, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c["message"]["content"] for c in again["choices"]] == texts and sampled["seed"] == 7


def test_random_seed_is_reported_and_replays(server):
    a = chat(server, max_tokens=12, temperature=1.0)
    b = chat(server, max_tokens=12, temperature=1.0)
    assert a["seed"] != b["seed"] and a["system_fingerprint"].startswith("edgepipe-")
    replay = chat(server, max_tokens=12, temperature=1.0, seed=a["seed"])
    assert replay["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]


def test_sampling_by_default_greedy_one_field_away(server):
    """Issue 42: a request without sampling fields samples with llama-server's defaults (a seed
    reported, which replays it); ``temperature: 0`` is greedy and reports no seed."""
    body = {"messages": [{"role": "user", "content": "Write a line about the sea."}], "max_tokens": 12}

    def post(**patch) -> dict:
        r = server.client.post("/v1/chat/completions", json={**body, **patch})
        assert r.status_code == 200, r.text
        return r.json()

    text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
    sampled = [post() for _ in range(3)]
    seeds = [r["seed"] for r in sampled]
    assert all(isinstance(x, int) for x in seeds) and len(set(seeds)) == 3
    assert len({text(r) for r in sampled}) > 1  # not greedy
    assert text(post(seed=seeds[0])) == text(sampled[0])  # the reported seed replays it
    # the defaults are llama-server's: naming them gives the same tokens for the same seed, other values others
    assert text(post(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seeds[0])) == text(sampled[0])
    greedy = [post(temperature=0) for _ in range(2)]
    assert "seed" not in greedy[0] and text(greedy[0]) == text(greedy[1])
    assert post(temperature=0, seed=5)["seed"] == 5  # a seed given is reported, greedy or not


def test_prompts_as_lists_and_token_ids(server):
    c = server.client
    text = c.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 5, "return_token_ids": True, "temperature": 0}).json()
    ids = c.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}).json()
    both = c.post("/v1/completions", json={"prompt": ["The sky is", "The capital of France is"], "max_tokens": 5, "temperature": 0}).json()
    assert [ch["index"] for ch in both["choices"]] == [0, 1]
    assert both["choices"][0]["text"] == text["choices"][0]["text"]
    from edgepipe.model.store import resolve

    tok = resolve("smollm2", "native").tokenizer
    prompt_ids = tok.encode("The sky is")
    by_ids = c.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 5, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == text["choices"][0]["text"]
    lists = c.post("/v1/completions", json={"prompt": [prompt_ids, tok.encode("The capital of France is")], "max_tokens": 5, "n": 2, "temperature": 0}).json()
    assert len(lists["choices"]) == 4 and lists["choices"][1]["text"] == text["choices"][0]["text"]
    assert lists["usage"]["prompt_tokens"] == len(prompt_ids) + ids["usage"]["prompt_tokens"]


def test_assistant_content_null_and_tool_turns_accepted(server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    reply = chat(server, messages=messages, tools=TOOLS, max_tokens=16)
    assert reply["choices"][0]["message"]["role"] == "assistant"


def test_tool_round_trip_with_openai_sdk(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=16, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    required = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=16, tool_choice="required",
                                              temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 18, "sky": "sunny"}'}]
    second = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=6, tool_choice="none", temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # the same forced call, streamed: the SDK accumulates the tool-call deltas
    stream = client.chat.completions.create(model="smollm2", messages=messages[:1], tools=TOOLS, max_tokens=16, stream=True,
                                            temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, args, finish = [], "", None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                names.append(tc.function.name)
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert args == call.function.arguments  # greedy: the same call as without streaming


def test_stream_n2_carries_both_indexes(server):
    seen, done = set(), set()
    with server.client.stream("POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    seen.add(ch["index"])
                    if ch["finish_reason"]:
                        done.add(ch["index"])
    assert seen == done == {0, 1}


def test_openapi_document(server):
    doc = server.client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models/{model}", "/api/chat",
                 "/api/generate"):
        assert path in doc["paths"], path
    chat_schema = doc["components"]["schemas"]["ChatRequest"]["properties"]
    assert chat_schema["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1


# -- clients that go away, on a server that runs one request at a time -----------------------------
@pytest.fixture(scope="module")
def single(home, native_pkg):
    with Server(home, workers=1, args=("--max-active", "1")) as s:
        yield s


LONG = {**CHAT, "max_tokens": 3000, "ignore_eos": True}


def test_non_streaming_client_that_leaves_frees_its_slot(single):
    started = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(single.url + "/v1/chat/completions", json=LONG, timeout=2)
    single.wait_for(lambda s: s["admission"]["active"] == 0 and s["requests_in_flight"] == 0, timeout=15)
    assert time.monotonic() - started < 17  # 3,000 tokens would take far longer
    single.wait_for(lambda s: all((w["stats"] or {}).get("kv_bytes") == 0 for w in s["workers"]), timeout=15)
    assert chat(single)["usage"]["completion_tokens"] >= 1


def test_queued_client_that_leaves_leaves_the_queue(single):
    stop = threading.Event()

    def hold_the_slot():
        with httpx.Client(base_url=single.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions",
                                                                          json={**LONG, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    try:
        single.wait_for(lambda s: s["admission"]["active"] == 1, timeout=15)
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(_post_until_timeout(single.url, CHAT, 3)))
        waiter.start()
        single.wait_for(lambda s: s["admission"]["queued"] == 1, timeout=5)
        waiter.join(10)
        assert outcome == ["timed out"]
        single.wait_for(lambda s: s["admission"]["queued"] == 0, timeout=5)
        assert admission(single)["active"] == 1  # the holder still runs
    finally:
        stop.set()
        holder.join(30)
    single.wait_for(lambda s: s["admission"]["active"] == 0, timeout=15)
    assert chat(single)["usage"]["completion_tokens"] >= 1


def _post_until_timeout(url: str, body: dict, timeout: float) -> str:
    try:
        return f"answered {httpx.post(url + '/v1/chat/completions', json=body, timeout=timeout).status_code}"
    except httpx.TimeoutException:
        return "timed out"
