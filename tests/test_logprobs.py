"""Log-probabilities through 3 real workers with the openai SDK (issue 15), against the single-process runner.

Chat ``logprobs``/``top_logprobs`` (streaming and not), completions ``logprobs`` with ``echo``
(the prompt's logprobs come back from the prefill), ``n=3``. Every logprob is the head graph's
log_softmax of the model's raw logits; the reference is ``runtime.local.generate`` on one process
with the same prompt ids, compared to within 1e-3 (the distributed pipeline cuts the model in three
and batches decode steps; batch invariance keeps the tokens equal, the logprobs to float noise).
"""

from __future__ import annotations

import math

import pytest

from edgepipe.api import tools
from edgepipe.api.schemas import ChatMessage
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form


openai = pytest.importorskip("openai")

QUESTION = "Name the largest planet of the solar system."
PROMPT = "The three primary colours are red,"
TOL = 1e-3


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


@pytest.fixture(scope="module")
def client(three_workers_openai):
    return three_workers_openai


@pytest.fixture(scope="module")
def reference(native_pkg):
    """Single-process generation over the whole model (one stage)."""
    pipe = native_pkg.pipeline(precision=local_form(native_pkg))
    tok = native_pkg.tokenizer

    def run(ids: list[int], **params):
        return generate(pipe, ids, GenerationParams(**params), tok.decode, native_pkg.manifest.eos_ids)

    return run


def chat_ids(pkg, question: str) -> list[int]:
    tok = pkg.tokenizer
    prompt = tools.render(tok.chat_template, tok.format_chat, [ChatMessage(role="user", content=question)], None, None)
    return tok.encode(prompt.text)


def test_chat_logprobs_equal_single_process(client, native_pkg, reference):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    ref = reference(chat_ids(native_pkg, QUESTION), max_tokens=12, logprobs=True, top_logprobs=5)
    assert ids == ref.tokens[: len(ids)] and len(ids) == len(ref.logprobs)
    content = choice.logprobs.content
    assert len(content) == len(ids)
    tok = native_pkg.tokenizer
    for entry, want, token in zip(content, ref.logprobs, ids):
        assert abs(entry.logprob - want.logprob) < TOL, (entry, want)
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 5
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
        assert [t.token for t in entry.top_logprobs] == [tok_text(tok, t) for t, _ in want.top]
        assert all(abs(t.logprob - lp) < TOL for t, (_, lp) in zip(entry.top_logprobs, want.top))
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the best one, and the top-5 mass is a probability
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6 and entry.top_logprobs[0].token == entry.token
        assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-4
    assert "".join(e.token for e in content) == choice.message.content


def tok_text(tok, token: int) -> str:
    from edgepipe.api.generation import token_texts

    return token_texts(tok).text(token)


def test_chat_logprobs_stream_equal_non_stream(client):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=10, temperature=0, logprobs=True,
                  top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_chat_without_logprobs_has_none(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=3)
    assert r.choices[0].logprobs is None


def test_completion_echo_logprobs_equal_single_process(client, native_pkg, reference):
    ids = native_pkg.tokenizer.encode(PROMPT)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=3,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    lp = choice.logprobs
    generated = choice.model_extra["token_ids"]
    ref = reference(ids, max_tokens=3, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    assert generated == ref.tokens[: len(generated)]
    assert choice.text.startswith(PROMPT) and choice.text == PROMPT + native_pkg.tokenizer.decode(generated)
    assert len(lp.tokens) == len(ids) + len(generated) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in ref.logprobs]
    assert all(abs(a - b) < TOL for a, b in zip(lp.token_logprobs[1:], want)), (lp.token_logprobs, want)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for k, top in enumerate(lp.top_logprobs[1:], start=1):
        assert 3 <= len(top) <= 4 and lp.tokens[k] in top  # the N best plus the chosen token
        assert abs(top[lp.tokens[k]] - lp.token_logprobs[k]) < 1e-6
    for k in range(len(ids), len(lp.tokens)):  # greedy: each generated token is its position's best
        assert abs(max(lp.top_logprobs[k].values()) - lp.token_logprobs[k]) < 1e-6


def test_completion_echo_streams_prompt_first(client, native_pkg):
    ids = native_pkg.tokenizer.encode(PROMPT)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    lps = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert text.startswith(PROMPT) and chunks[0].choices[0].text.startswith(PROMPT)
    assert len(tokens) >= len(ids) + 1 and lps[0] is None and all(v is not None for v in lps[1:])


def test_token_id_prompt_echo_and_loglikelihood_shape(client, native_pkg, reference):
    """lm-evaluation-harness' loglikelihood request: token ids, echo, logprobs=1, max_tokens=1."""
    ids = native_pkg.tokenizer.encode("Paris is the capital of France")
    r = client.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    ref = reference(ids, max_tokens=1, logprobs=True, top_logprobs=1, prompt_logprobs=True)
    got = lp.token_logprobs[1 : len(ids)]
    assert all(abs(a - b.logprob) < TOL for a, b in zip(got, ref.prompt_logprobs[1:]))
    assert sum(got) < 0 and all(isinstance(v, float) for v in got)


def test_max_tokens_zero_with_echo_scores_the_prompt_only(client, server, native_pkg, reference):
    """As the legacy OpenAI API and vLLM: the prompt and its logprobs, nothing generated."""
    ids = native_pkg.tokenizer.encode(PROMPT)
    ref = reference(ids, max_tokens=1, logprobs=True, top_logprobs=2, prompt_logprobs=True)
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                  extra_body={"return_token_ids": True})
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length" and choice.model_extra["token_ids"] == []
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
    assert all(abs(a - b.logprob) < TOL for a, b in zip(lp.token_logprobs[1:], ref.prompt_logprobs[1:]))
    chunks = list(client.completions.create(model="smollm2", prompt=[ids, ids], max_tokens=0, echo=True, logprobs=1, stream=True))
    by_choice = {c.choices[0].index: c.choices[0] for c in chunks if c.choices}
    assert sorted(by_choice) == [0, 1]
    for ch in by_choice.values():
        assert ch.text == PROMPT and ch.finish_reason == "length" and len(ch.logprobs.tokens) == len(ids)
    r = server.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "echo" in r.json()["error"]["message"], r.text


def test_n3_each_choice_has_its_logprobs(client):
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=6, n=3,
                                       temperature=0.9, seed=11, logprobs=True, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == len(c.model_extra["token_ids"]) > 0
        assert all(e.logprob <= 0 and e.top_logprobs == [] for e in c.logprobs.content)
