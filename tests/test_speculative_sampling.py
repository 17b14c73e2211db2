"""The speculative-sampling rule end to end: a model drafter's sampled drafts go with the
distribution they were drawn from (``ModelDrafter.draft_sampled``), the verify pass carries them
to the last stage (``rule_fields``), and the last stage keeps or replaces them against its own
sampler's distribution (``head_tokens`` on ``graphs.sampler_form``'s outputs, as a worker does).

On a tiny random model (a 3-layer target; its first 2 layers as the draft, so the two agree
often, not always) whose sampler keeps 2 tokens per position, 5 tokens from each of many seeds
are counted per sequence and checked against the target's exact distribution (chi-square); the
same check rejects a rule with a wrong replacement draw. The passes are driven as
``cluster.requests`` drives them (drafts, verify, keep, rewind). Through 3 worker processes on
the bundled model, a sampled request through the real coordinator and workers gives the tokens of
that same loop run in one process, token for token.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from scipy.stats import chisquare

from edgepipe.cluster.shells.speculation import Speculation
from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.runtime import controls, speculative
from edgepipe.runtime.sequence import GenerationParams, SequenceState, uniform_draw
from edgepipe.runtime.speculative import ModelDrafter, accept_greedy, head_tokens, rule_fields
from edgepipe.runtime.stage_runner import SamplingBatch

from test_families import write_tiny_gguf

LENGTH, TOP_K, TEMPERATURE, RUNS = 5, 2, 10.0, 1000


def speculative_tokens(pipe, spec: Speculation, prompt: list[int], params: GenerationParams, seq: str) -> tuple[list[int], int]:
    """Sample ``params.max_tokens`` tokens as a speculative cluster does, in one process: a plain
    step without drafts, else a verify pass of the drafter's proposal, decided by the last stage
    (the rule for a drafter that states its distributions), the rejected drafts rewound. Returns
    the tokens and the drafts kept."""
    vocab = pipe.runners[-1].vocab

    def run(feed: list[int], sampling: dict, verify: bool):
        x = np.array([feed], np.int64)
        for r in pipe.runners:
            batch = SamplingBatch.from_wire([{"seq": seq, "sampling": sampling}], vocab) if r.emits_tokens else None
            x = r.run(seq, x, batch, verify=verify and r.emits_tokens)
        return x

    async def go():
        state = SequenceState(list(prompt), params, lambda ids: "", ())
        kept, feed = 0, list(prompt)
        while len(state.generated) < params.max_tokens:
            step = len(state.generated)
            sampling = controls.wire_sampling(params, step)
            proposal = None
            if not state.generated:
                spec.prime(seq, state)  # as the coordinator does: the drafter takes in the prompt beside the prefill
            else:
                proposal = await spec.propose(seq, state, params.max_tokens - step - 1, rule=spec.by_rule(state, {}))
            if proposal:
                drafts = proposal.tokens
                sampling["uniform"] = [uniform_draw(params.seed, step + i) for i in range(len(drafts) + 1)]
                if proposal.q is not None:
                    sampling.update(rule_fields(drafts, list(proposal.q), params.seed, step))
                entry = {"seq": seq, "sampling": sampling}
                tokens = accept_greedy(drafts, [int(t) for t in head_tokens(pipe.runners[-1], entry, run(feed + drafts, sampling, True))])
                spec.learn(seq, len(drafts), len(tokens) - 1)
                kept += len(tokens) - 1
                for r in pipe.runners:
                    r.rewind(seq, len(state.all_ids) + len(tokens) - 1)
            else:
                tokens = [int(run(feed, sampling, False)[0])]
            state.generated += tokens[:params.max_tokens - step]
            feed = state.generated[-1:]
        pipe.drop(seq)
        spec.forget(seq)
        return state.generated, kept

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random qwen2 target (verify form, 2 stages) and its first 2 layers as a draft."""
    root = tmp_path_factory.mktemp("tiny-speculative")
    target = Package(import_model(write_tiny_gguf(root / "target.gguf", "qwen2", seed=5), root / "models", "fp32", name="tiny-target",
                                  max_context=128, measure_cost=False))
    draft = Package(import_model(write_tiny_gguf(root / "draft.gguf", "qwen2", seed=5, spec={"n_layers": 2}), root / "models", "fp32",
                                 name="tiny-draft", max_context=128, measure_cost=False))
    prompt = target.tokenizer.encode("def fibonacci(n): the quick brown fox")
    return target.pipeline([2], verify_form=True, threads=1), draft, prompt


def _draft_spec(draft: Package) -> Speculation:
    runner = draft.runner(0, len(draft.manifest.units), threads=1, sampler=True)
    return Speculation(ModelDrafter(runner, draft.name), k_max=3, worth=0.1)  # k up to 3 at a ~50% acceptance


def _exact(pipe, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every sequence of LENGTH tokens the target's sampler can give, with its probability: the
    product of the sampler's distribution (``sampler_form``) after each prefix."""
    head, out = pipe.runners[-1], {(): 1.0}
    sampling = {"do_sample": True, "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": 1.0, "uniform": 0.5}
    for _ in range(LENGTH):
        grown = {}
        for prefix, prob in out.items():
            x = np.array([prompt + list(prefix)], np.int64)
            wanted = replace(SamplingBatch.from_wire([{"seq": "exact", "sampling": sampling}], head.vocab), want_sampler=True)
            for r in pipe.runners:
                x = r.run("exact", x, wanted if r.emits_tokens else None)
            pipe.drop("exact")
            probs, ids = head.last_sampler.probs[0].astype(np.float64), head.last_sampler.ids[0]
            for token, weight in zip(ids, probs / probs.sum()):
                if weight > 0:
                    grown[prefix + (int(token),)] = prob * weight
        out = grown
    return out


def _chi_square_p(pipe, draft: Package, prompt: list[int]) -> tuple[float, float]:
    """(p-value, share of drafts kept) of RUNS seeded speculative samples against the exact distribution."""
    exact = _exact(pipe, prompt)
    spec = _draft_spec(draft)
    counts = dict.fromkeys(exact, 0)
    for seed in range(RUNS):
        params = GenerationParams(max_tokens=LENGTH, temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        tokens, _ = speculative_tokens(pipe, spec, prompt, params, f"s{seed}")
        counts[tuple(tokens)] += 1  # a KeyError: a sequence the target's sampler cannot give
    cells = sorted(exact)
    expected = np.array([exact[c] for c in cells]) * RUNS
    observed = np.array([counts[c] for c in cells], np.float64)
    keep = expected >= 5  # chi-square wants ~5 expected per cell: pool the rare ones
    pooled_obs, pooled_exp = np.append(observed[keep], observed[~keep].sum()), np.append(expected[keep], expected[~keep].sum())
    pvalue = float(chisquare(pooled_obs, pooled_exp * pooled_obs.sum() / pooled_exp.sum()).pvalue)
    return pvalue, spec.stats.acceptance


def test_sampled_speculation_follows_the_targets_distribution(tiny):
    pipe, draft, prompt = tiny
    pvalue, acceptance = _chi_square_p(pipe, draft, prompt)
    assert 0.2 < acceptance < 0.9, acceptance  # both ways of the rule were taken: drafts kept and drafts replaced
    assert pvalue > 1e-3, pvalue


def test_the_check_rejects_a_rule_without_the_ratio(tiny, monkeypatch):
    """Keeping every draft the target's sampler can give (no ``min(1, p / q)``) leans towards the
    draft's distribution: the same check must fail it."""
    pipe, draft, prompt = tiny
    right = speculative.accept_drawn

    def keep_what_p_allows(drafts, q, p, accept, replace, bonus):
        return right(drafts, q, p, [0.0 if p[i].prob(d) > 0 else a for i, (d, a) in enumerate(zip(drafts, accept))], replace, bonus)

    monkeypatch.setattr(speculative, "accept_drawn", keep_what_p_allows)
    pvalue, _ = _chi_square_p(pipe, draft, prompt)
    assert pvalue < 1e-6, pvalue


def test_a_draft_states_the_distribution_it_was_drawn_from(tiny):
    """Each sampled draft is one of its stated distribution's tokens, that distribution is the draft
    model's sampler cut to DRAFT_SUPPORT tokens and normalised, and the same seed drafts the same."""
    _, draft, prompt = tiny
    spec = _draft_spec(draft)
    params = GenerationParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=3)
    tokens, q = spec.drafter.draft_sampled("a", prompt, 4, params, 0)
    again, q_again = _draft_spec(draft).drafter.draft_sampled("b", prompt, 4, params, 0)
    assert tokens == again and len(q) == 4
    assert all(np.array_equal(a.weights, b.weights) for a, b in zip(q, q_again))
    for token, dist in zip(tokens, q):
        assert dist.prob(token) > 0 and abs(dist.total - 1) < 1e-9 and len(dist.ids) <= speculative.DRAFT_SUPPORT


@pytest.mark.parametrize("bad, match", [
    ({"drafts": [1, 2]}, "of 1 entries"),
    ({"draft_ids": [[10 ** 9]]}, "token ids"),
    ({"draft_probs": [[-1.0]]}, "draft distribution"),
    ({"accept": [1.5]}, "draws"),
    ({"draft_ids": [[4, 4]], "draft_probs": [[0.5, 0.5]]}, "once"),
])
def test_a_last_stage_refuses_rule_fields_that_do_not_fit(bad, match):
    fields = {"drafts": [4], "draft_ids": [[4]], "draft_probs": [[1.0]], "accept": [0.5], "replace": [0.5], **bad}
    probs, ids = np.array([[0.7, 0.3, 0.0], [1.0, 0.0, 0.0]], np.float32), np.array([[4, 5, 6], [5, 4, 6]], np.int64)
    with pytest.raises(ValueError, match=match):
        speculative.head_verdict(fields, probs, ids, [4, 5], 100)
