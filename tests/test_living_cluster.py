"""A living cluster: a worker killed mid-stream, a newcomer mid-generation, a forced KV move."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form

from harness import Server

PROMPT = "Tell me a long story about a lighthouse keeper."


def reference(pkg, n: int) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    params = GenerationParams(max_tokens=n, ignore_eos=True)
    return generate(pkg.pipeline(precision=local_form(pkg)), ids, params, tok.decode, pkg.manifest.eos_ids).tokens


def stream_tokens(server, n: int, on_chunk=None) -> tuple[str, list[str]]:
    """Stream a chat completion; returns the text and the raw pieces in order."""
    pieces = []
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content", ""))
            if on_chunk:
                on_chunk(len(pieces))
    return "".join(pieces), pieces


def events(server, kind):
    return [e for e in server.client.get("/v1/cluster/events").json()["events"] if e["kind"] == kind]


def test_worker_killed_mid_stream(native_pkg, home):
    expected = native_pkg.tokenizer.decode(reference(native_pkg, 48))
    with Server(home, workers=2, args=("--placement", "memory")) as server:
        victim = server.status()["workers"][1]
        killed = threading.Event()

        def on_chunk(n):
            if n == 12 and not killed.is_set():
                os.kill(victim["pid"], signal.SIGKILL)
                killed.set()

        text, _ = stream_tokens(server, 48, on_chunk)
        assert killed.is_set()
        assert text == expected
        assert events(server, "leave") and events(server, "recovered")
        status = server.status()
        assert [w["id"] for w in status["workers"]] != [] and victim["id"] not in [w["id"] for w in status["workers"]]


@pytest.mark.slow
def test_faster_newcomer_mid_generation(native_pkg, home):
    expected = native_pkg.tokenizer.decode(reference(native_pkg, 200))
    # slow enough that the newcomer starts, calibrates and is switched in while the request runs
    with Server(home, workers=1, args=("--worker-args", "--slowdown 8")) as server:
        slow = server.status()["workers"][0]["id"]
        newcomer = []

        def on_chunk(n):
            if n == 2 and not newcomer:
                newcomer.append(server.worker("--name", "fast", "--threads", "1"))

        try:
            text, _ = stream_tokens(server, 200, on_chunk)
            assert text == expected
            plans = events(server, "up")
            assert len(plans) >= 2, plans  # the plan changed while the request ran
            assert plans[-1]["kv_moved"] + plans[-1]["kv_recomputed"] == 1  # the request in flight went along
            final = server.status()["plan"]["stages"]
            assert any(s["worker"].endswith("fast") for s in final) and not all(s["worker"] == slow for s in final)
        finally:
            for p in newcomer:
                p.terminate()
                p.wait(timeout=10)


@pytest.fixture(scope="module")
def two_workers(home, native_pkg):
    with Server(home, workers=2, args=("--placement", "memory")) as server:
        yield server


@pytest.mark.parametrize("cut", [8, 31], ids=["layers-move", "head-alone"])
def test_forced_rebalance_moves_kv(native_pkg, two_workers, cut):
    """The KV of the layers that change hands moves; a stage left with the head alone keeps no
    KV and must take the next step without one (it once refused it as 'a frame was lost')."""
    expected = native_pkg.tokenizer.decode(reference(native_pkg, 64))
    server = two_workers
    # one server for both cuts: each moves from the plan in place (the second from the first's, pinned)
    stages = server.status()["plan"]["stages"]
    a, b = stages[0]["worker"], stages[1]["worker"]
    moved = {}

    def on_chunk(n):
        if n == 16 and not moved:
            moved["reply"] = httpx.post(server.url + "/v1/cluster/rebalance", timeout=120, json={"stages": [
                {"worker": a, "start": 0, "end": cut}, {"worker": b, "start": cut, "end": 32}], "pin_s": 600}).json()

    text, _ = stream_tokens(server, 64, on_chunk)
    assert text == expected
    up = [e for e in events(server, "up") if e["plan"] == moved["reply"]["plan"]][0]
    assert up["kv_moved"] == 1 and up["kv_recomputed"] == 0 and up["kv_moved_bytes"] > 0
    assert not events(server, "pause")
    plan = server.status()["plan"]  # pinned: the re-planner leaves the operator's plan alone
    assert plan["id"] == moved["reply"]["plan"] and 0 < plan["pinned_s"] <= 600
    bad = httpx.post(server.url + "/v1/cluster/rebalance", timeout=30, json={"stages": plan["stages"], "pin_s": -1})
    assert bad.status_code == 400 and "pin_s" in bad.json()["error"]["message"]
