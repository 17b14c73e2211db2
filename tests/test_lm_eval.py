"""lm-evaluation-harness against ``/v1/completions`` through 3 real workers (issue 15, must-show 1).

lm_eval's own ``local-completions`` model runs two tiny local tasks (tests/data/lm_eval: a
multiple-choice one, scored by loglikelihood through ``echo`` + ``logprobs``, and a
generate-until one), offline, with ``tokenized_requests`` true (token ids on the wire) and false
(text). Its loglikelihoods must equal the single-process runner's (the same ids through
``runtime.local.generate`` with the prompt's logprobs) to within 1e-3, and its greedy generations
the runner's text. The text variant is ``-m slow`` (the default suite keeps the token-id one).
lm_eval tokenizes with a Hugging Face tokenizer saved from the package's own
``tokenizer.json``, so both sides cut context and continuation into the same ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form


TASKS = Path(__file__).parent / "data" / "lm_eval"
TOL = 1e-3
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    """lm_eval imported offline, its Hugging Face caches in a temporary folder."""
    cache = tmp_path_factory.mktemp("hf-home")
    saved = {k: os.environ.get(k) for k in [*OFFLINE, "HF_HOME"]}
    os.environ.update({**OFFLINE, "HF_HOME": str(cache)})
    mod = pytest.importorskip("lm_eval")
    import datasets

    datasets.config.HF_HUB_OFFLINE = True  # in case datasets was imported before the variables were set
    yield mod
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def server(three_workers):
    return three_workers


@pytest.fixture(scope="module")
def hf_tokenizer_dir(native_pkg, tmp_path_factory) -> Path:
    """The package's tokenizer as a Hugging Face folder (what lm_eval loads to count context tokens)."""
    tok = native_pkg.tokenizer
    path = tmp_path_factory.mktemp("hf-tokenizer")
    (path / "tokenizer.json").write_text(tok.tokenizer.to_str())
    eos = tok.tokenizer.id_to_token(tok.eos_ids[0])
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                                            "model_max_length": native_pkg.manifest.max_context}))
    return path


@pytest.fixture(scope="module")
def reference(native_pkg):
    pipe, tok, eos = native_pkg.pipeline(precision=local_form(native_pkg)), native_pkg.tokenizer, native_pkg.manifest.eos_ids

    def loglikelihood(context: str, continuation: str) -> float:
        """lm_eval's split (TemplateLM._encode_pair), scored from the prompt's logprobs of one prefill."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = tok.encode(context)
        whole = tok.encode(context + continuation)
        result = generate(pipe, whole, GenerationParams(max_tokens=1, logprobs=True, top_logprobs=1, prompt_logprobs=True), tok.decode, eos)
        return sum(e.logprob for e in result.prompt_logprobs[len(ctx):])

    def greedy(context: str, until: tuple[str, ...], max_tokens: int) -> str:
        return generate(pipe, tok.encode(context), GenerationParams(max_tokens=max_tokens, stop=until), tok.decode, eos).text

    return loglikelihood, greedy


def run_tasks(lm_eval, server, tokenizer_dir: Path, tokenized: bool, monkeypatch) -> dict:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the task files name their data relative to this folder
    args = {"model": "smollm2", "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer_dir), "tokenized_requests": tokenized, "num_concurrent": 1, "max_retries": 1,
            "max_length": 2048}
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["edgepipe_mc", "edgepipe_gen"],
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), log_samples=True, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def arguments(sample: dict) -> list[tuple]:
    """Each request's arguments of a logged sample (lm_eval logs them as a dict of dicts)."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(a.values()) if isinstance(a, dict) else tuple(a) for a in args.values()]
    return [tuple(a) for a in args]


@pytest.mark.parametrize("tokenized", [pytest.param(True, id="token-ids"),  # default suite: ~25 s at load 9 (+ the server)
                                       pytest.param(False, id="text", marks=pytest.mark.slow)])
def test_lm_eval_matches_single_process(lm_eval, server, hf_tokenizer_dir, reference, tokenized, monkeypatch):
    loglikelihood, greedy = reference
    out = run_tasks(lm_eval, server, hf_tokenizer_dir, tokenized, monkeypatch)
    mc = out["samples"]["edgepipe_mc"]
    assert len(mc) == 3
    for sample in mc:
        requests = arguments(sample)
        got = [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in sample["resps"]]
        want = [loglikelihood(ctx, cont) for ctx, cont, *_ in requests]
        assert len(got) == len(want) == len(sample["doc"]["choices"])
        assert all(abs(g - w) < TOL for g, w in zip(got, want)), (requests, got, want)
        assert all(g < 0 for g in got)
    assert 0.0 <= out["results"]["edgepipe_mc"]["acc,none"] <= 1.0
    gen = out["samples"]["edgepipe_gen"]
    assert len(gen) == 2
    for sample in gen:
        (context, kwargs, *_), = arguments(sample)
        until = tuple(kwargs["until"])
        text = sample["resps"][0][0]
        assert text == greedy(context, until, kwargs["max_gen_toks"]), (context, text)
