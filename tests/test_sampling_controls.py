"""Logit controls in the head graph (issue 15): logit_adjust, token masks, penalties, logit_bias.

The head graph alone (a small random head, checked against numpy): with no adjustment it picks
exactly what the head without controls picks, greedy and sampled; a mask forces the allowed
tokens; logprobs are log_softmax of the raw logits whatever the adjustment; each row is its own.
On the real model: a token mask through the same wire entries a worker reads. Through 3 real
workers with the openai SDK: penalties change the greedy text (and equal the single-process
reference token for token), logit_bias -100 forbids the greedy token and +100 forces one, and
out-of-range values are 400s.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from edgepipe.model import graphs
from edgepipe.model.config import ModelConfig
from edgepipe.runtime import controls
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.runtime.stage_runner import RowControls, SamplingBatch, logit_adjust
from edgepipe.model.store import local_form


H, V, EPS = 16, 50, 1e-5
CFG = ModelConfig(architecture="llama", name="tiny", n_layers=1, hidden_size=H, intermediate_size=32, n_heads=2, n_kv_heads=1,
                  head_dim=8, vocab_size=V, context_length=64, rope_theta=10000.0, rms_eps=EPS, tie_embeddings=False,
                  rope_interleaved=False)
rng = np.random.default_rng(0)
NORM = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
LM_HEAD = rng.standard_normal((V, H)).astype(np.float32)


def session(model) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def head():
    return session(graphs.head_unit(CFG, 2, NORM, LM_HEAD))


@pytest.fixture(scope="module")
def head_before():
    """The head as it was before controls: the same logits, ArgMax or the same sampling branch."""
    g = graphs._Graph("head.")
    last = g.op1("Gather", ["hidden.2", g.const(np.array(-1, np.int64), "last")], axis=1)
    logits = graphs._head_logits(g, CFG, last, NORM, LM_HEAD)
    greedy = helper.make_graph([helper.make_node("ArgMax", [logits], ["greedy_token"], axis=-1, keepdims=0)], "greedy", [],
                               [helper.make_tensor_value_info("greedy_token", graphs.INT64, ["batch"])])
    g.op("If", ["do_sample"], out=["next_token"], then_branch=graphs._sampling_branch(logits, V), else_branch=greedy)
    vi = helper.make_tensor_value_info
    return session(g.model([vi("hidden.2", graphs.FLOAT, ["batch", "seq", H]), vi("do_sample", graphs.BOOL, []),
                            vi("temperature", graphs.FLOAT, ["batch"]), vi("top_k", graphs.INT64, ["batch"]),
                            vi("top_p", graphs.FLOAT, ["batch"]), vi("uniform", graphs.FLOAT, ["batch"]), vi("min_p", graphs.FLOAT, ["batch"])],
                           [vi("next_token", graphs.INT64, ["batch"])], "head_before"))


def numpy_logits(x: np.ndarray) -> np.ndarray:
    """[B, S, H] -> logits of every position [B, S, V] (final RMSNorm, then the LM head)."""
    normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS) * NORM
    return normed @ LM_HEAD.T.astype(np.float64)


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def feeds(x, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, uniform=0.5, adjust=None, top=0, targets=None, min_p=0.0) -> dict:
    B = x.shape[0]
    return {"hidden.2": x.astype(np.float32), "do_sample": np.array(do_sample), "temperature": np.full(B, temperature, np.float32),
            "top_k": np.full(B, top_k, np.int64), "top_p": np.full(B, top_p, np.float32),
            "uniform": np.full(B, uniform, np.float32) if np.isscalar(uniform) else np.asarray(uniform, np.float32),
            "logit_adjust": np.zeros((1, V), np.float32) if adjust is None else adjust.astype(np.float32),
            "num_top": np.array([top], np.int64), "prompt_targets": np.zeros((1, 0), np.int64) if targets is None else targets,
            "repeat_ids": np.zeros((B, 0), np.int64), "repeat_penalty": np.ones(B, np.float32), "min_p": np.full(B, min_p, np.float32)}


def run(sess, f: dict) -> dict:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    return dict(zip(names, sess.run(None, {k: v for k, v in f.items() if k in wanted})))


def test_no_adjustment_picks_what_the_head_before_picked(head, head_before):
    for trial in range(40):
        x = rng.standard_normal((3, 2, H)).astype(np.float32)
        kw = dict(do_sample=trial % 2 == 1, temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(0, 8)),
                  top_p=float(rng.uniform(0.3, 1.0)), uniform=rng.uniform(0, 1, 3))
        got = run(head, feeds(x, **kw))["next_token"]
        assert got.tolist() == run(head_before, feeds(x, **kw))["next_token"].tolist()
        if not kw["do_sample"]:
            assert got.tolist() == numpy_logits(x)[:, -1].argmax(-1).tolist()
        # a dense all-zero [B, V] adjustment is the same as none
        assert run(head, feeds(x, adjust=np.zeros((3, V)), **kw))["next_token"].tolist() == got.tolist()


def test_min_p_keeps_what_is_that_likely_relative_to_the_best(head):
    """min_p (llama-server's default 0.05, GRAPH_VERSION 10): a sampled token is one at least
    min_p times as likely as the best, judged before temperature (llama.cpp's order), drawn with
    the tempered probabilities; 0 keeps all, 1 only the best."""
    x = rng.standard_normal((1, 1, H)).astype(np.float32) * 3
    logits = numpy_logits(x)[0, -1]
    grid = np.linspace(0, 0.999, 400)
    for temperature in (0.5, 1.0, 2.0):
        p = np.exp((logits - logits.max()) / temperature)
        p /= p.sum()
        ratio = np.exp(logits - logits.max())  # the model's own probabilities relative to the best
        for min_p in (0.0, 0.05, 0.3, 1.0):
            picks = [int(run(head, feeds(x, do_sample=True, temperature=temperature, uniform=u, min_p=min_p))["next_token"][0]) for u in grid]
            kept = ratio >= min_p
            assert all(ratio[t] >= min_p * 0.999 for t in picks), (temperature, min_p)  # nothing below the floor
            share = np.where(kept, p, 0) / np.where(kept, p, 0).sum()
            assert {t for t in range(V) if share[t] > 3 / len(grid) and ratio[t] > min_p * 1.001} <= set(picks), (temperature, min_p)
            if min_p == 1.0:
                assert set(picks) == {int(logits.argmax())}
        # top_p too is judged before temperature: the prefix of the model's own probabilities reaching 0.5
        order = np.argsort(-logits)
        own = np.exp(logits - logits.max())
        own /= own.sum()
        prefix = set(order[(np.cumsum(own[order]) - own[order]) < 0.5].tolist())
        picks = {int(run(head, feeds(x, do_sample=True, temperature=temperature, top_p=0.5, uniform=u))["next_token"][0]) for u in grid}
        assert picks <= prefix and {t for t in prefix if np.where(np.isin(np.arange(V), list(prefix)), p, 0)[t] /
                                    p[list(prefix)].sum() > 3 / len(grid)} <= picks, (temperature, picks, prefix)


def test_mask_forces_the_allowed_tokens(head):
    x = rng.standard_normal((2, 1, H)).astype(np.float32)
    best = numpy_logits(x)[:, -1].argmax(-1)
    worst = numpy_logits(x)[:, -1].argmin(-1)
    allowed = np.zeros((2, V), bool)
    allowed[np.arange(2), worst] = True
    masks = [RowControls(mask=np.packbits(a, bitorder="little").tobytes()) for a in allowed]
    adjust = logit_adjust(masks, V)
    assert np.isneginf(adjust).sum() == 2 * (V - 1)
    for do_sample in (False, True):
        for u in (0.0, 0.5, 0.999):
            out = run(head, feeds(x, do_sample=do_sample, uniform=u, adjust=adjust))
            assert out["next_token"].tolist() == worst.tolist() != best.tolist()
    two = np.zeros(V, bool)
    two[[3, 17]] = True
    adjust = logit_adjust([RowControls(mask=np.packbits(two, bitorder="little").tobytes())] * 2, V)
    picks = {int(t) for u in np.linspace(0, 0.999, 25) for t in run(head, feeds(x, do_sample=True, uniform=u, adjust=adjust))["next_token"]}
    assert picks == {3, 17}  # both reachable, nothing else


def test_logprobs_are_of_raw_logits_and_rows_are_independent(head):
    x = rng.standard_normal((2, 3, H)).astype(np.float32)
    want = log_softmax(numpy_logits(x)[:, -1])
    bias = np.zeros((2, V))
    bias[0, 7] = 100.0  # forces token 7 on row 0 only
    out = run(head, feeds(x, adjust=bias, top=5))
    assert out["next_token"][0] == 7 and out["next_token"][1] == want[1].argmax()
    assert np.allclose(out["token_logprob"], want[np.arange(2), out["next_token"]], atol=1e-4)  # raw, not biased
    assert np.array_equal(out["top_ids"], np.argsort(-want, -1)[:, :5])
    assert np.allclose(out["top_logprobs"], np.sort(want, -1)[:, ::-1][:, :5], atol=1e-4)
    solo = run(head, feeds(x[1:], top=5))
    assert solo["next_token"][0] == out["next_token"][1] and np.array_equal(solo["top_ids"][0], out["top_ids"][1])
    assert out["prompt_logprobs"].size == 0  # not asked: the all-positions branch does not run


@pytest.mark.parametrize("S", [1, 6, graphs.PROMPT_CHUNK, 2 * graphs.PROMPT_CHUNK + 5])  # chunks of the Scan, padded
def test_prompt_logprobs_of_every_position(head, S):
    x = rng.standard_normal((1, S, H)).astype(np.float32)
    targets = rng.integers(0, V, (1, S))
    out = run(head, feeds(x, top=3, targets=targets))
    want = log_softmax(numpy_logits(x))[0]  # [S, V]
    assert out["prompt_logprobs"].shape == (1, S) and out["prompt_top_ids"].shape == (1, S, 3)
    assert np.allclose(out["prompt_logprobs"][0], want[np.arange(S), targets[0]], atol=1e-4)
    assert run(head, feeds(x, top=0, targets=targets))["prompt_top_ids"].shape == (1, S, 0)
    assert np.array_equal(out["prompt_top_ids"][0], np.argsort(-want, -1)[:, :3])
    assert np.allclose(out["token_logprob"][0], want[-1, out["next_token"][0]], atol=1e-4)  # the last position is the decode one
    assert np.allclose(out["prompt_top_logprobs"][0], np.sort(want, -1)[:, ::-1][:, :3], atol=1e-4)


def test_sparse_wire_entries_fold_into_one_dense_row():
    rows = [RowControls((4, 9), (-2.0, 1.5)), None, RowControls(mask=bytes([0b101] + [0] * ((V + 7) // 8 - 1)))]
    dense = logit_adjust(rows, V)
    assert dense.shape == (3, V) and dense[0, 4] == -2 and dense[0, 9] == 1.5 and np.count_nonzero(dense[0]) == 2
    assert not dense[1].any() and np.isfinite(dense[2]).sum() == 2 and dense[2, 0] == 0 and dense[2, 2] == 0
    assert logit_adjust([None, RowControls()], V) is None
    for bad in ([RowControls((V,), (1.0,))], [RowControls((1,), (float("nan"),))], [RowControls(mask=bytes((V + 7) // 8))],
                [RowControls(mask=b"\x01")]):
        with pytest.raises(ValueError):
            logit_adjust(bad, V)


def test_penalties_fold_with_bias_per_generated_token():
    from edgepipe.runtime.sequence import SequenceState

    params = GenerationParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 10.0), (8, -100.0)))
    state = SequenceState([1, 2], params, lambda ids: "", ())
    state.generated = [3, 5, 5, 5]
    ids, values = controls.adjustment(state)
    assert dict(zip(ids, values)) == {3: 10.0 - 0.75, 5: -(0.5 + 0.75), 8: -100.0}  # prompt tokens do not count


def test_token_mask_on_the_real_model(native_pkg):
    """The wire path a worker runs (``SamplingBatch.from_wire``) with a mask provider: only digits."""
    tok = native_pkg.tokenizer
    pipe = native_pkg.pipeline([12], precision=local_form(native_pkg))
    vocab = pipe.runners[-1].vocab
    digits = np.array([tok.decode([t]).strip() in {str(d) for d in range(10)} for t in range(vocab)])
    calls = []

    def provider(generated):
        calls.append(list(generated))
        return np.packbits(digits, bitorder="little")

    ids = tok.encode("The capital of France is")
    r = generate(pipe, ids, GenerationParams(max_tokens=5), tok.decode, native_pkg.manifest.eos_ids, token_mask=provider)
    assert len(r.tokens) == 5 and all(digits[t] for t in r.tokens)
    assert calls == [r.tokens[:k] for k in range(5)]  # once per step, with the ids so far
    free = generate(pipe, ids, GenerationParams(max_tokens=5), tok.decode, native_pkg.manifest.eos_ids)
    assert not all(digits[t] for t in free.tokens)
    with pytest.raises(ValueError, match="allows no token"):
        generate(pipe, ids, GenerationParams(max_tokens=2), tok.decode, native_pkg.manifest.eos_ids,
                 token_mask=lambda generated: np.zeros(vocab, bool))


def test_old_head_without_controls_refuses_them_clearly():
    entry = {"seq": "a", "sampling": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0,
                                      "adjust_ids": [1], "adjust": [1.0]}}
    with pytest.raises(ValueError, match="re-import"):
        SamplingBatch.from_wire([entry], None)  # a runner over a GRAPH_VERSION 1 head has no vocab for controls


# -- through 3 real workers with the openai SDK ---------------------------------------------------------
REPEAT = "Write the word 'apple' ten times, separated by commas."
REPEATING = REPEAT + "\n\napple, apple,"  # greedy goes on " apple," for ever: a penalty must change that


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


@pytest.fixture(scope="module")
def client(three_workers_openai):
    return three_workers_openai


def complete(client, prompt: str, **kw):
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=kw.pop("max_tokens", 16), temperature=0,
                                  extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    return r.choices[0].text, r.choices[0].model_extra["token_ids"]


def reference_ids(pkg, prompt: str, **params) -> list[int]:
    tok = pkg.tokenizer
    r = generate(pkg.pipeline(precision=local_form(pkg)), tok.encode(prompt), GenerationParams(max_tokens=params.pop("max_tokens", 16), **params),
                 tok.decode, pkg.manifest.eos_ids)
    return r.tokens


def test_penalties_change_the_greedy_text_as_the_reference_does(client, native_pkg):
    plain, plain_ids = complete(client, REPEATING)
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 1.0, "frequency_penalty": -0.5}):
        text, ids = complete(client, REPEATING, **kw)
        want = reference_ids(native_pkg, REPEATING, **kw)
        assert ids == want[: len(ids)], kw  # the single-process runner, token for token
        # a frequency penalty of 2 grows with every repeat and must break the loop; a flat presence
        # penalty of 2 is within rounding of the model's lead for " apple" here (it changed the text
        # of the kernel form with an fp32 KV cache, not the MatMulNBits form's nor, now, the fp16 one's)
        if kw.get("frequency_penalty", 0) > 0:
            assert text != plain, kw
    assert plain_ids == reference_ids(native_pkg, REPEATING)[: len(plain_ids)]


def test_logit_bias_forbids_and_forces(client, native_pkg):
    prompt = "The capital of France is"
    text, greedy = complete(client, prompt, max_tokens=4)
    first = greedy[0]
    assert text.startswith(" Paris")
    banned_text, banned = complete(client, prompt, max_tokens=4, logit_bias={str(first): -100})
    assert banned and banned[0] != first and first not in banned and "Paris" not in banned_text
    assert banned == reference_ids(native_pkg, prompt, max_tokens=4, logit_bias=((first, -100.0),))[: len(banned)]
    forced = native_pkg.tokenizer.encode(" banana")[0]
    _, ids = complete(client, prompt, max_tokens=4, logit_bias={str(forced): 100})
    assert ids == [forced] * 4


def test_chat_penalty_and_bias_with_streaming(client):
    kw = dict(model="smollm2", messages=[{"role": "user", "content": REPEAT}], max_tokens=12, temperature=0, frequency_penalty=1.5,
              logit_bias={"28": -5})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices)
    assert streamed == whole


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.01}, "presence_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"), ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
])
def test_out_of_range_controls_are_400s(server, body, param):
    import json

    payload = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}, allow_nan=True)
    r = server.client.post("/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]


@pytest.mark.parametrize("body", [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}, {"echo": "yes"}])
def test_out_of_range_completion_logprobs_are_400s(server, body):
    r = server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("logprobs", "echo"), r.text


def test_package_with_older_graphs_is_rebuilt(tmp_path):
    """A package whose manifest records an older GRAPH_VERSION (or none: version 1) is re-imported."""
    import json

    from edgepipe.model.importer import import_model
    from edgepipe.model.store import bundled_gguf

    path = import_model(bundled_gguf(), tmp_path, "native", name="pkg", measure_cost=False)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["source"]["graphs"] == graphs.GRAPH_VERSION
    del manifest["source"]["graphs"]  # as written before versions were recorded
    (path / "manifest.json").write_text(json.dumps(manifest))
    import_model(bundled_gguf(), tmp_path, "native", name="pkg", measure_cost=False)
    assert json.loads((path / "manifest.json").read_text())["source"]["graphs"] == graphs.GRAPH_VERSION


def test_repeat_penalty_in_the_head(native_pkg):
    """The head's repeat penalty (llama.cpp's): a penalised argmax token loses to the runner-up when
    the factor is large; a factor of 1 changes nothing; logprobs stay the model's own (raw logits)."""
    import numpy as np

    from edgepipe.runtime.stage_runner import SamplingBatch

    n = len(native_pkg.manifest.units)
    head = native_pkg.runner(n - 1, n, precision=local_form(native_pkg))
    x = np.random.default_rng(0).standard_normal((1, 1, native_pkg.manifest.config["hidden_size"])).astype(np.float32)

    def run(**extra):
        entry = {"sampling": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0, "top": 3, **extra}}
        token = int(head.run("s", x, SamplingBatch.from_wire([entry], head.vocab))[0])
        head.drop("s")
        return token, head.last_head[1].top_ids[0].tolist(), head.last_head[1].top_logprobs[0].tolist()

    token, top, logprobs = run()
    assert token == top[0]
    assert run(repeat_ids=[token], repeat_penalty=100.0) == (top[1], top, logprobs)
    assert run(repeat_ids=[token, top[1]], repeat_penalty=1.0) == (token, top, logprobs)
    with pytest.raises(ValueError, match="repeat_penalty"):
        SamplingBatch.from_wire([{"sampling": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0,
                                               "repeat_ids": [1], "repeat_penalty": -1}}], head.vocab)
