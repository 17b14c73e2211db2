"""Through the API, 1, 2 and 3 worker processes give exactly the single-process tokens."""

from __future__ import annotations


import pytest

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form

from harness import server_for

PROMPTS = ["What is the tallest mountain on Earth?", "Write a short poem about a cat.", "Explain recursion in one sentence."]


def reference_tokens(pkg, prompt: str, max_tokens: int) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    return generate(pkg.pipeline(precision=local_form(pkg)), ids, GenerationParams(max_tokens=max_tokens), tok.decode, pkg.manifest.eos_ids).tokens


# 3 workers in the default run (the cuts the others make are inside it); 1 and 2 with -m slow
@pytest.mark.parametrize("workers", [3, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_api_greedy_equals_single_process(native_pkg, home, workers, request):
    with server_for(request, home, workers) as server:
        stages = server.status()["plan"]["stages"]
        assert len(stages) == workers
        # serve's default: the file's own model, in the kernel library's form where it loads here
        assert [s["precision"] for s in stages] == [local_form(native_pkg)] * workers
        for prompt in PROMPTS:
            r = server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            expected = reference_tokens(native_pkg, prompt, 40)
            generated = [t for t in expected if t not in native_pkg.manifest.eos_ids]
            assert choice["token_ids"] == generated
            assert choice["message"]["content"] == native_pkg.tokenizer.decode(generated)
            assert r.json()["usage"]["completion_tokens"] == len(generated)
