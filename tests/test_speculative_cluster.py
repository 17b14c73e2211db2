"""Speculative decoding through real worker processes: greedy tokens (and logprobs) equal decoding
one token per step in the same graph form, alone and beside other requests; sampled requests
follow the speculative-sampling rule (the tokens of the rule run in one process), or with
logprobs the seeded tokens of decoding without speculation; a worker killed mid-stream is
replayed to the same tokens (``-m slow``).

The drafter is SmolLM2's fp32 package drafting for the int4 target, served with `--precision int4`
(one tokenizer, other weights: it agrees often, not always, so passes keep some drafts and rewind
others; the fp32 model agrees with `serve`'s default, the file's own Q4_1, on every greedy draft of
these prompts, so nothing would be rewound)."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edgepipe.cluster.shells.speculation import Speculation
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.runtime.speculative import ModelDrafter

from harness import Server
from test_speculative_sampling import speculative_tokens

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
EDIT = f"Rename every function in this code to start with 'calc_' and output the whole code:\n{CODE}"
CHAT = "Count from one to twenty in words, separated by commas."


def chat_ids(pkg, prompt: str) -> list[int]:
    tok = pkg.tokenizer
    return tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))


def api_params(**params) -> GenerationParams:
    """``params`` with the API's defaults for the sampling fields a request leaves out (top_k, top_p, min_p)."""
    from edgepipe.api.generation import SAMPLING_DEFAULTS

    return GenerationParams(**{**{k: v for k, v in SAMPLING_DEFAULTS.items() if k != "temperature"}, **params})


def reference(pkg, prompt: str, **params):
    """Decoding one token per step, single process, in the verify form the cluster's stages run."""
    tok = pkg.tokenizer
    return generate(pkg.pipeline(verify_form=True, threads=1), chat_ids(pkg, prompt), api_params(**params), tok.decode,
                    pkg.manifest.eos_ids)


def without_eos(pkg, tokens: list[int]) -> list[int]:
    return [t for t in tokens if t not in pkg.manifest.eos_ids]


def ask(server, prompt: str, **body) -> dict:
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}], "return_token_ids": True,
                                                         **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def spec_server(home, int4_pkg, fp32_pkg):
    """Draft lengths from the acceptance rate alone (timed ones follow the machine's speed: the
    rule's tokens would not repeat run to run); drafts on a drafter worker once one is ready
    (none joins before ``test_a_drafter_worker_drafts_and_its_loss_loses_nothing``)."""
    with Server(home, workers=3, args=("--precision", "int4", "--placement", "memory", "--speculative", str(fp32_pkg.root), "--draft-k", "6",
                                       "--draft-length", "acceptance", "--draft-on", "workers")) as server:
        yield server


def test_greedy_tokens_and_logprobs_equal_one_token_per_step(int4_pkg, spec_server):
    for prompt in (EDIT, CHAT):
        choice = ask(spec_server, prompt, max_tokens=48, temperature=0, logprobs=True, top_logprobs=2)
        ref = reference(int4_pkg, prompt, max_tokens=48, logprobs=True, top_logprobs=2)
        assert choice["token_ids"] == without_eos(int4_pkg, ref.tokens)
        got = [(e["logprob"], [t["logprob"] for t in e["top_logprobs"]]) for e in choice["logprobs"]["content"]]
        want = [(w.logprob, [lp for _, lp in w.top]) for w in ref.logprobs]
        assert got == want  # the verify rows are the decode steps' bits: the same floats
    spec = spec_server.status()["speculation"]
    assert spec["drafter"] == "smollm2-135m-instruct-fp32" and spec["passes"] > 0
    assert 0 < spec["kept"] < spec["drafted"], spec  # drafts kept, and some rejected (rewound on every stage)
    metrics = spec_server.client.get("/metrics").text
    assert "edgepipe_speculative_kept_tokens_total" in metrics


def rule_reference(int4_pkg, fp32_pkg, prompt: str, **params) -> list[int]:
    """A sampled request decided by the speculative-sampling rule, in one process: the loop of
    ``test_speculative_sampling`` with the cluster's drafter (fp32, ``--draft-k 6``), up to the first EOS."""
    spec = Speculation(ModelDrafter(fp32_pkg.runner(0, len(fp32_pkg.manifest.units), threads=1, sampler=True), fp32_pkg.name), k_max=6)
    tokens, _ = speculative_tokens(int4_pkg.pipeline(verify_form=True, threads=1), spec, chat_ids(int4_pkg, prompt),
                                   api_params(**params), "ref")
    ends = [i for i, t in enumerate(tokens) if t in int4_pkg.manifest.eos_ids]
    return tokens[:ends[0]] if ends else tokens


@pytest.mark.slow  # by default test_beside_other_requests checks a sampled request's rule tokens, their repeat and the counters
def test_sampled_tokens_follow_the_sampling_rule(int4_pkg, fp32_pkg, spec_server):
    """A sampled request's model drafts go to the last stage with their distribution and it applies
    the speculative-sampling rule: through the coordinator and 3 workers, the tokens of the same
    rule run in one process (whose distribution ``test_speculative_sampling`` checks), and the
    same seed gives them again."""
    before = spec_server.status()["speculation"]
    choice = ask(spec_server, CHAT, max_tokens=40, temperature=0.8, top_p=0.95, seed=5)
    assert choice["token_ids"] == rule_reference(int4_pkg, fp32_pkg, CHAT, max_tokens=40, temperature=0.8, top_p=0.95, seed=5)
    after = spec_server.status()["speculation"]
    assert after["by_rule"] > before["by_rule"] and after["kept"] > before["kept"]
    assert ask(spec_server, CHAT, max_tokens=40, temperature=0.8, top_p=0.95, seed=5)["token_ids"] == choice["token_ids"]
    metrics = {line.split()[0]: float(line.split()[1]) for line in spec_server.client.get("/metrics").text.splitlines()
               if line.startswith("edgepipe_speculative_")}
    status = spec_server.status()["speculation"]  # a pass the rule cut short still counts every draft it carried
    assert (metrics["edgepipe_speculative_drafted_tokens_total"], metrics["edgepipe_speculative_kept_tokens_total"]) == (
        status["drafted"], status["kept"])


def test_sampled_with_logprobs_keeps_the_seeded_tokens(int4_pkg, spec_server):
    """With logprobs (the head's are of its own sample) a sampled request keeps a draft where it
    equals the target's seeded sample: the tokens are those of decoding without speculation."""
    before = spec_server.status()["speculation"]
    choice = ask(spec_server, CHAT, max_tokens=40, temperature=0.8, top_p=0.95, seed=5, logprobs=True)
    assert choice["token_ids"] == without_eos(int4_pkg, reference(int4_pkg, CHAT, max_tokens=40, temperature=0.8, top_p=0.95,
                                                                  seed=5).tokens)
    after = spec_server.status()["speculation"]
    assert after["passes"] > before["passes"] and after["by_rule"] == before["by_rule"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "numbers": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "numbers"]}


def test_a_response_format_speculates_with_a_mask_per_position(int4_pkg, spec_server):
    """Structured output: drafts as far as the grammar allows them, verified against a mask per
    position; the JSON is the one decoding one token per step under the same mask gives."""
    from edgepipe.api import structured

    prompt = "Give a JSON object with your name and the numbers one to twelve."
    vocab = int4_pkg.manifest.config["vocab_size"]
    constraint = structured.constraint_for(int4_pkg.tokenizer, vocab, structured.from_openai("json_schema", {"name": "n", "schema": SCHEMA}))
    tok = int4_pkg.tokenizer
    ref = generate(int4_pkg.pipeline(verify_form=True, threads=1), chat_ids(int4_pkg, prompt), GenerationParams(max_tokens=60),
                   tok.decode, int4_pkg.manifest.eos_ids, token_mask=constraint.token_mask())
    before = spec_server.status()["speculation"]
    choice = ask(spec_server, prompt, max_tokens=60, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}})
    assert choice["token_ids"] == without_eos(int4_pkg, ref.tokens)
    after = spec_server.status()["speculation"]
    assert after["passes"] > before["passes"] and after["kept"] > before["kept"]


@pytest.mark.slow  # a few seconds too long for the default suite's bound; -m slow runs it
def test_beside_other_requests(int4_pkg, fp32_pkg, spec_server):
    """A greedy speculating request, a sampled one (speculating by the rule) and one with a logit
    bias (decoding a token per step in a lane) at once: each gets its solo tokens. The sampled one,
    asked again after what the server served since, repeats its seed's tokens (a draft length that
    started from the server's history would not), and the counters equal the status."""
    bias = {str(int4_pkg.tokenizer.encode(" the")[0]): -5}
    jobs = [(EDIT, dict(max_tokens=40, temperature=0)),
            (CHAT, dict(max_tokens=24, temperature=0.8, seed=7)),
            (CHAT, dict(max_tokens=24, temperature=0, logit_bias=bias))]
    before = spec_server.status()["speculation"]["passes"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(pool.map(lambda job: ask(spec_server, job[0], **job[1]), jobs))
    expected = [reference(int4_pkg, EDIT, max_tokens=40),
                rule_reference(int4_pkg, fp32_pkg, CHAT, max_tokens=24, temperature=0.8, seed=7),
                reference(int4_pkg, CHAT, max_tokens=24, logit_bias=tuple((int(k), float(v)) for k, v in bias.items()))]
    for choice, ref in zip(choices, expected):
        assert choice["token_ids"] == (ref if isinstance(ref, list) else without_eos(int4_pkg, ref.tokens))
    assert spec_server.status()["speculation"]["passes"] > before
    assert ask(spec_server, CHAT, **jobs[1][1])["token_ids"] == expected[1]
    metrics = {line.split()[0]: float(line.split()[1]) for line in spec_server.client.get("/metrics").text.splitlines()
               if line.startswith("edgepipe_speculative_")}
    status = spec_server.status()["speculation"]  # a pass the rule cut short still counts every draft it carried
    assert (metrics["edgepipe_speculative_drafted_tokens_total"], metrics["edgepipe_speculative_kept_tokens_total"]) == (
        status["drafted"], status["kept"]) and status["by_rule"] > 0


def stream_text(server, prompt: str, max_tokens: int, on_piece=None) -> str:
    pieces = []
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces += [choice["delta"].get("content", "") for choice in json.loads(line[6:])["choices"]]
                if on_piece is not None:
                    on_piece(len(pieces))
    return "".join(pieces)


@pytest.mark.slow  # ~12-14 s: the default suite's 12-minute bound; speculative decoding's tokens stay checked by test_greedy_tokens_and_logprobs_equal_one_token_per_step
def test_a_drafter_worker_drafts_and_its_loss_loses_nothing(int4_pkg, spec_server):
    """A worker started with ``--role drafter`` holds no stage: it fetches the draft model's files,
    times its steps and drafts over the control channel; the greedy tokens are those of decoding
    one token per step. SIGKILLed mid-stream, its drafts are made in the coordinator again and
    the stream's text is unchanged."""
    plan = spec_server.status()["plan"]
    drafter = spec_server.worker("--role", "drafter", "--name", "drafter", "--threads", "1")
    try:
        status = spec_server.wait_for(lambda s: s["speculation"]["site"] != "coordinator", timeout=120)
        site = status["speculation"]["site"]
        assert site.endswith("drafter") and status["plan"]["draft"] == site and status["plan"]["stages"] == plan["stages"]
        assert next(w for w in status["workers"] if w["id"] == site)["role"] == "drafter"  # and no stage: the plan did not change
        placement = status["speculation"]["placement"]
        assert placement["workers"][site]["step_ms"] > 0 and placement["coordinator_step_ms"] > 0

        expected = int4_pkg.tokenizer.decode(without_eos(int4_pkg, reference(int4_pkg, EDIT, max_tokens=40, ignore_eos=True).tokens))
        assert stream_text(spec_server, EDIT, 40) == expected
        drafted = spec_server.status()["speculation"]["placement"]["remote_drafts"]
        assert drafted > 0

        killed = threading.Event()

        def kill_at(n: int) -> None:
            if n >= 12 and not killed.is_set():
                os.kill(drafter.pid, signal.SIGKILL)
                killed.set()

        assert stream_text(spec_server, EDIT, 40, kill_at) == expected
        assert killed.is_set()
        after = spec_server.wait_for(lambda s: s["speculation"]["site"] == "coordinator", timeout=30)["speculation"]
        assert after["placement"]["workers"] == {} and after["kept"] > 0
        kinds = [(e["kind"], e.get("site")) for e in spec_server.events()]
        assert ("draft_site", site) in kinds and ("draft_site", "coordinator") in kinds
    finally:
        if drafter.poll() is None:
            drafter.kill()
        drafter.wait()


@pytest.mark.slow
def test_worker_killed_mid_stream_is_replayed_exactly(int4_pkg, home):
    """n-gram drafting on a code edit; a stage is SIGKILLed mid-stream: the replay rebuilds the KV one
    token per step, and the accepted tokens come out the same."""
    expected = int4_pkg.tokenizer.decode(without_eos(int4_pkg, reference(int4_pkg, EDIT, max_tokens=80, ignore_eos=True).tokens))
    with Server(home, workers=2, args=("--precision", "int4", "--placement", "memory", "--speculative", "ngram")) as server:
        victim = server.status()["workers"][1]
        killed = threading.Event()
        pieces = []
        body = {"messages": [{"role": "user", "content": EDIT}], "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces += [choice["delta"].get("content", "") for choice in json.loads(line[6:])["choices"]]
                    if len(pieces) >= 20 and not killed.is_set():
                        os.kill(victim["pid"], signal.SIGKILL)
                        killed.set()
        assert killed.is_set()
        assert "".join(pieces) == expected
        assert server.status()["speculation"]["kept"] > 0
        kinds = [e["kind"] for e in server.client.get("/v1/cluster/events").json()["events"]]
        assert "leave" in kinds and "recovered" in kinds


@pytest.mark.slow
def test_forced_rebalance_mid_stream_moves_kv_with_drafts(int4_pkg, home):
    """A plan switch mid-stream moves the sequence's KV, rejected drafts' positions included: the
    next frame's ``rewind`` drops them on the new stages, and the text is unchanged."""
    expected = int4_pkg.tokenizer.decode(without_eos(int4_pkg, reference(int4_pkg, EDIT, max_tokens=80, ignore_eos=True).tokens))
    with Server(home, workers=2, args=("--precision", "int4", "--placement", "memory", "--speculative", "ngram")) as server:
        stages = server.status()["plan"]["stages"]
        a, b = stages[0]["worker"], stages[1]["worker"]
        moved, pieces = {}, []
        body = {"messages": [{"role": "user", "content": EDIT}], "max_tokens": 80, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces += [choice["delta"].get("content", "") for choice in json.loads(line[6:])["choices"]]
                    if len(pieces) >= 20 and not moved:
                        moved["reply"] = httpx.post(server.url + "/v1/cluster/rebalance", timeout=120, json={"stages": [
                            {"worker": a, "start": 0, "end": 10}, {"worker": b, "start": 10, "end": 32}], "pin_s": 600}).json()
        assert "".join(pieces) == expected
        up = [e for e in server.client.get("/v1/cluster/events").json()["events"] if e["kind"] == "up" and e["plan"] == moved["reply"]["plan"]]
        assert up and up[0]["kv_moved"] == 1
        assert server.status()["speculation"]["kept"] > 0
