"""The HTTP API: a real OpenAI client, and bad input that must not disturb other requests."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest
import websockets

from edgepipe.net.protocol import Message, MessageType, decode, encode


CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


def assert_still_serves(server):
    r = server.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param


def test_openai_client_streams_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    models = client.models.list()
    assert models.data[0].id == server.status()["model"]
    stream = client.chat.completions.create(model=models.data[0].id, messages=CHAT["messages"], max_tokens=24, stream=True, temperature=0,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    full = client.chat.completions.create(model=models.data[0].id, messages=CHAT["messages"], max_tokens=24, temperature=0)
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens > 0
    legacy = client.completions.create(model=models.data[0].id, prompt="The sky is", max_tokens=5, temperature=0)
    assert legacy.choices[0].text and legacy.usage.completion_tokens == 5


def test_malformed_json(server):
    r = server.client.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert "not valid JSON" in r.json()["error"]["message"]
    assert_still_serves(server)


def test_unknown_model(server):
    assert_error(server.client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404, code="model_not_found", param="model")


def test_max_tokens_beyond_context_is_clamped(server):
    """As llama-server: max_tokens beyond the context is cut to what the prompt leaves (it was a 400)."""
    r = server.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6})
    assert r.status_code == 200, r.text
    short = server.client.post("/v1/chat/completions", json=CHAT).json()
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= server.status()["context"] and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert r.json()["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])


@pytest.mark.parametrize("patch", [{"temperature": -1}, {"top_p": 2}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                                   {"max_tokens": "many"}, {"stop": 5}, {"n": 0}, {"n": 1000}])
def test_bad_fields(server, patch):
    assert_error(server.client.post("/v1/chat/completions", json={**CHAT, **patch}), 400)


def test_unknown_route_and_method(server):
    assert_error(server.client.get("/v1/nothing"), 404)
    assert_error(server.client.get("/v1/chat/completions"), 405)


def test_streamed_token_ids_are_the_whole_answers(server):
    """``return_token_ids`` in a stream: the ids of each chunk, in order, are the answer's ids,
    the text of each chunk the decoded pieces, for chat and for completions."""
    import json

    for route, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "The sky is", "max_tokens": 16, "temperature": 0})):
        whole = server.client.post(route, json={**body, "return_token_ids": True}).json()["choices"][0]
        ids, texts = [], []
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                c.stream("POST", route, json={**body, "stream": True, "return_token_ids": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice.get("token_ids", [])
                    texts.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
        assert ids == whole["token_ids"] and len(ids) > 1, route
        assert "".join(texts) == (whole["message"]["content"] if "message" in whole else whole["text"])
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert not any("token_ids" in line for line in r.iter_lines())  # only when asked for


def test_client_disconnect_mid_stream_frees_kv(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400, "stream": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines >= 3:
                    break  # hang up mid-stream
    server.wait_for(lambda s: s["requests_in_flight"] == 0, timeout=30)
    server.wait_for(lambda s: all((w["stats"] or {}).get("kv_bytes") == 0 for w in s["workers"]), timeout=30)
    assert_still_serves(server)


async def _worker_socket_exchange(url: str, frames: list) -> tuple[list, bool]:
    """Send frames on the coordinator's worker socket; return replies and whether it closed."""
    replies = []
    async with websockets.connect(url.replace("http://", "ws://") + "/v1/worker") as ws:
        for f in frames:
            await ws.send(f)
        try:
            while True:
                replies.append(await asyncio.wait_for(ws.recv(), timeout=10))
        except websockets.ConnectionClosed:
            return replies, True
        except asyncio.TimeoutError:
            return replies, False


def _only_error(replies) -> str:
    assert len(replies) == 1
    msg = decode(replies[0])
    assert msg.type is MessageType.ERROR
    return msg["message"]


def test_garbage_frame_on_worker_socket(server):
    replies, closed = asyncio.run(_worker_socket_exchange(server.url, [b"\x00\x01garbage-bytes"]))
    assert closed and "header length" in _only_error(replies)
    replies, closed = asyncio.run(_worker_socket_exchange(server.url, ["a text frame"]))
    assert closed and "binary" in _only_error(replies)
    assert_still_serves(server)


def test_truncated_frame_on_worker_socket(server):
    frame = encode(Message(MessageType.HELLO, {"name": "x"}, {"t": __import__("numpy").zeros(100, "float32")}))
    replies, closed = asyncio.run(_worker_socket_exchange(server.url, [frame[:-37]]))
    assert closed and "truncated" in _only_error(replies)
    assert_still_serves(server)


def test_wrong_protocol_version(server):
    header = msgpack.packb({"type": "hello", "v": 99, "name": "old", "tensors": []})
    frame = len(header).to_bytes(4, "little") + header
    replies, closed = asyncio.run(_worker_socket_exchange(server.url, [frame]))
    message = _only_error(replies)
    assert closed and "protocol version 99 is not supported" in message
    assert all(w["name"] != "old" for w in server.status()["workers"])
    assert_still_serves(server)


def test_garbage_on_worker_data_port(server):
    """A data port wants its plan's secret in the handshake: a stranger's garbage is refused before it is parsed."""
    data_url = server.status()["workers"][0]["data_url"]

    async def poke():
        async with websockets.connect(data_url) as ws:
            await ws.send(b"\xff" * 64)
            return decode(await asyncio.wait_for(ws.recv(), timeout=10))

    with pytest.raises(websockets.InvalidStatus) as info:
        asyncio.run(poke())
    assert info.value.response.status_code == 401
    assert_still_serves(server)


def test_metrics_after_requests(server):
    assert_still_serves(server)
    text = server.client.get("/metrics").text
    for name in ("edgepipe_tokens_generated_total", "edgepipe_time_to_first_token_seconds_bucket", "edgepipe_time_per_output_token_seconds",
                 "edgepipe_stage_compute_seconds", "edgepipe_hop_bytes_total", "edgepipe_tokens_per_second"):
        assert name in text, name
    hop = [line for line in text.splitlines() if line.startswith("edgepipe_hop_bytes_total{")]
    assert hop and float(hop[0].split()[-1]) > 0


