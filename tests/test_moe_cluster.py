"""A MoE package through 3 worker processes, as the dense model is run in the cluster tests: cuts
inside the MoE layers, a forced rebalance mid-stream (the MoE stages' KV moves), prefix-cached
chat turns, a stage replicated over two workers under concurrent (batched) streams, and a worker
SIGKILLed mid-stream (its KV replayed on the survivors): every answer is the single process's.

The package is the bundled SmolLM2 upcycled into 4 experts, top 2, router rows in equal pairs
(``edgepipe/bench/moe_files.py``): each layer equals the dense one to the bit, so the dense model's
tokens are a second reference beside the MoE package's own single-process ones."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edgepipe.bench.moe_files import upcycle
from edgepipe.model.store import bundled_gguf, local_form, prepare_local_form, resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from harness import Server
from test_living_cluster import PROMPT, events, stream_tokens
from test_prefix_cluster import play_turns

pytestmark = pytest.mark.slow  # three worker processes, a few minutes on 2 busy cores
N = 40
CONCURRENT = [("Name a fruit.", 12), ("What is 2 + 2?", 16), ("Write one line about the sea.", 20), ("Say hi.", 8)]


@pytest.fixture(scope="module")
def moe_pkg(home, tmp_path_factory):
    path = upcycle(bundled_gguf(), tmp_path_factory.mktemp("moe-cluster") / "smollm2-moe.gguf", seed=2, tied=True)
    pkg = resolve(str(path), "native", home)
    prepare_local_form(pkg)
    return pkg


def _ids(pkg, messages: list[dict]) -> list[int]:
    tok = pkg.tokenizer
    return tok.encode(tok.format_chat(messages))


def solo(pkg, messages: list[dict], n: int, ignore_eos: bool = False) -> list[int]:
    """The single-process batch-invariant tokens (the runners a ``--batch-invariant`` cluster's stages use)."""
    pipe = pkg.pipeline(batch_invariant=True, precision=local_form(pkg))
    params = GenerationParams(max_tokens=n, ignore_eos=ignore_eos)
    out = generate(pipe, _ids(pkg, messages), params, pkg.tokenizer.decode, pkg.manifest.eos_ids).tokens
    return out if ignore_eos else [t for t in out if t not in pkg.manifest.eos_ids]


def rebalance(server: Server, stages: list[tuple[str, int, int]]) -> dict:
    reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=180, json={
        "stages": [{"worker": w, "start": a, "end": b} for w, a, b in stages], "pin_s": 600})
    assert reply.status_code == 200, reply.text
    return reply.json()


def ask(server: Server, messages: list[dict], n: int) -> list[int]:
    with httpx.Client(base_url=server.url, timeout=300) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": n, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


def test_moe_stages_move_cache_replicate_batch_and_survive_a_kill(home, native_pkg, moe_pkg):
    story = [{"role": "user", "content": PROMPT}]
    expected = solo(moe_pkg, story, N, ignore_eos=True)
    assert expected == solo(native_pkg, story, N, ignore_eos=True) and len(set(expected)) > 5  # MoE = dense, a non-trivial text
    text_of = moe_pkg.tokenizer.decode
    with Server(home, workers=3, args=("--placement", "memory", "--batch-invariant", "--model", moe_pkg.root.name), timeout=300) as server:
        status = server.status()
        n = status["n_units"]
        assert n == 32  # embedding, 30 MoE layers, head
        a, b, c = sorted(w["id"] for w in status["workers"])

        # Cuts inside the MoE layers (units 1..30), then a forced rebalance mid-stream: the KV of the
        # layers that change hands moves between processes.
        rebalance(server, [(a, 0, 6), (b, 6, 19), (c, 19, n)])
        moved = {}

        def move(count: int) -> None:
            if count == 12 and not moved:
                moved.update(rebalance(server, [(b, 0, 11), (c, 11, 24), (a, 24, n)]))

        text, _ = stream_tokens(server, N, move)
        assert moved and text == text_of(expected)
        up = [e for e in events(server, "up") if e.get("plan") == moved["plan"]]
        assert up and up[0]["kv_moved"] == 1 and up[0]["kv_recomputed"] == 0 and up[0]["kv_moved_bytes"] > 0, up

        # Prefix cache: later turns start from cached blocks on the MoE stages.
        before = server.status()["prefix_cache"]
        turns = play_turns(server, 12)
        for messages, got in turns:
            assert got == solo(moe_pkg, messages, 12), messages[-1]
        assert server.status()["prefix_cache"]["hits"] - before["hits"] >= len(turns) - 1

        # A MoE stage replicated over two workers; concurrent streams are batched on every stage.
        rebalance(server, [(a, 0, 13), (b, 13, n), (c, 13, n)])
        plan = server.status()["plan"]
        assert plan["replicated"] and [s.get("replica") for s in plan["stages"]] == [None, [1, 2], [2, 2]]
        wanted = [solo(moe_pkg, [{"role": "user", "content": p}], k) for p, k in CONCURRENT]
        with ThreadPoolExecutor(len(CONCURRENT)) as pool:
            got = list(pool.map(lambda item: ask(server, [{"role": "user", "content": item[0]}], item[1]), CONCURRENT))
        for (prompt, _), g, e in zip(CONCURRENT, got, wanted):
            assert g == e, prompt
        metrics = server.client.get("/metrics").text.splitlines()
        sizes = [ln for ln in metrics if ln.startswith("edgepipe_stage_batch_size_bucket") and 'le="1.0"' in ln]
        count = sum(float(ln.split()[-1]) for ln in metrics if ln.startswith("edgepipe_stage_batch_size_count"))
        assert sum(float(ln.split()[-1]) for ln in sizes) < count, "no stage ever batched"

        # Three stages again, one SIGKILLed mid-stream: recovery replays its sequence on the rest.
        rebalance(server, [(a, 0, 9), (b, 9, 22), (c, 22, n)])
        victim = next(w for w in server.status()["workers"] if w["id"] == b)
        killed = threading.Event()

        def kill(count: int) -> None:
            if count == 12 and not killed.is_set():
                os.kill(victim["pid"], signal.SIGKILL)
                killed.set()

        text, _ = stream_tokens(server, N, kill)
        assert killed.is_set() and text == text_of(expected)
        assert events(server, "leave") and events(server, "recovered")


def test_speculative_verify_on_moe_stages_through_a_move_and_a_kill(home, moe_pkg):
    """n-gram drafts verified on MoE stages (cuts inside the experts): a forced rebalance mid-stream
    moves the KV with rejected drafts' positions, a worker SIGKILLed mid-stream is replayed; the text
    is decoding one token per step in the verify form, single process."""
    from test_speculative_cluster import EDIT, chat_ids, without_eos

    pipe = moe_pkg.pipeline(verify_form=True, threads=1, precision=local_form(moe_pkg))
    params = GenerationParams(max_tokens=80, ignore_eos=True)
    ref = generate(pipe, chat_ids(moe_pkg, EDIT), params, moe_pkg.tokenizer.decode, moe_pkg.manifest.eos_ids).tokens
    expected = moe_pkg.tokenizer.decode(without_eos(moe_pkg, ref))
    body = {"messages": [{"role": "user", "content": EDIT}], "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}

    def stream(server, at_20) -> str:
        import json

        pieces, done = [], False
        with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces += [choice["delta"].get("content", "") for choice in json.loads(line[6:])["choices"]]
                    if len(pieces) >= 20 and not done:
                        at_20()
                        done = True
        assert done
        return "".join(pieces)

    with Server(home, workers=3, args=("--placement", "memory", "--speculative", "ngram", "--model", moe_pkg.root.name), timeout=300) as server:
        a, b, c = sorted(w["id"] for w in server.status()["workers"])
        n = server.status()["n_units"]
        rebalance(server, [(a, 0, 7), (b, 7, 20), (c, 20, n)])
        moved = {}
        assert stream(server, lambda: moved.update(rebalance(server, [(c, 0, 12), (a, 12, 25), (b, 25, n)]))) == expected
        up = [e for e in events(server, "up") if e.get("plan") == moved["plan"]]
        assert up and up[0]["kv_moved"] == 1, up
        kept = server.status()["speculation"]["kept"]
        assert kept > 0
        victim = next(w for w in server.status()["workers"] if w["id"] == a)
        assert stream(server, lambda: os.kill(victim["pid"], signal.SIGKILL)) == expected
        assert events(server, "leave") and events(server, "recovered")
