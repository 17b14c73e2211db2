"""The verify form (graphs.verify_form): a verify pass of k drafted tokens gives, at every position,
the same bits as one decode step per token, through several stages; rejected drafts' KV is rewound
and decoding goes on as if they had never been fed; the model drafter keeps its own KV in step."""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.runtime.speculative import ModelDrafter, accept_greedy
from edgepipe.runtime.stage_runner import SamplingBatch
from edgepipe.model.store import local_form

CUTS = [11, 22]
WANT = [{"seq": "s", "sampling": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "uniform": 0.0,
                                  "logprobs": True, "top": 3}}]


def _prompt(pkg) -> list[int]:
    tok = pkg.tokenizer
    return tok.encode(tok.format_chat([{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]))


def _run(pipe, seq: str, ids: list[int], verify: bool = False):
    """Feed ``ids``; the head's tokens (one, or one per position with ``verify``) and logprob entries."""
    x = np.array([ids], np.int64)
    head = pipe.runners[-1]
    sampling = SamplingBatch.from_wire([{**WANT[0], "seq": seq}], head.vocab)
    for runner in pipe.runners:
        x = runner.run(seq, x, sampling if runner.emits_tokens else None, verify=verify and runner.emits_tokens)
    entries = head.logprobs_field([{**WANT[0], "seq": seq}], verify)["logprobs"][0]
    return [int(t) for t in np.atleast_1d(x)], entries if verify else [entries]


@pytest.fixture(scope="module")
def verify_pipe(native_pkg):
    return native_pkg.pipeline(CUTS, verify_form=True, threads=1, precision=local_form(native_pkg))


@pytest.fixture(scope="module")
def reference(native_pkg, verify_pipe):
    """Decode steps one token at a time: tokens and logprob entries."""
    prompt = _prompt(native_pkg)
    tokens, entries = _run(verify_pipe, "ref", prompt)
    for _ in range(12):
        t, e = _run(verify_pipe, "ref", tokens[-1:])
        tokens += t
        entries += e
    verify_pipe.drop("ref")
    return prompt, tokens, entries


def test_verify_pass_equals_decode_steps_bit_for_bit(verify_pipe, reference):
    prompt, tokens, entries = reference
    first, _ = _run(verify_pipe, "v", prompt)
    assert first == tokens[:1]
    verified, verified_entries = _run(verify_pipe, "v", tokens[:9], verify=True)  # the last token and 8 correct drafts
    verify_pipe.drop("v")
    assert verified == tokens[1:10]
    assert verified_entries == entries[1:10]  # logprobs and top alternatives: the same floats


def test_rejected_drafts_are_rewound(verify_pipe, reference):
    prompt, tokens, _ = reference
    _run(verify_pipe, "r", prompt)
    drafts = tokens[1:3] + [tokens[3] + 1, tokens[4]]  # the third draft is wrong
    verified, _ = _run(verify_pipe, "r", tokens[:1] + drafts, verify=True)
    kept = accept_greedy(drafts, verified)
    assert kept == tokens[1:4]  # two drafts kept, then the target's own third token
    held = len(prompt) + 1 + len(drafts)
    assert all(r.length("r") == held for r in verify_pipe.runners if r.layers)
    for runner in verify_pipe.runners:
        runner.rewind("r", len(prompt) + len(kept))
    out = tokens[:1] + kept
    while len(out) < len(tokens):
        out += _run(verify_pipe, "r", out[-1:])[0]
    verify_pipe.drop("r")
    assert out == tokens


def test_plain_stage_refuses_to_verify(native_pkg):
    head = native_pkg.runner(CUTS[-1], len(native_pkg.manifest.units), threads=1, precision=local_form(native_pkg))
    with pytest.raises(ValueError, match="verify form"):
        head.run("x", np.zeros((1, 3, native_pkg.manifest.hidden_size), np.float32), SamplingBatch.greedy(1), verify=True)


def test_model_drafter_follows_the_sequence(native_pkg):
    """SmolLM2 drafting for itself (plain form, one runner): its drafts are its own greedy tokens,
    and after the target diverges its KV is rewound to what both share."""
    pipe = native_pkg.pipeline(threads=1, precision=local_form(native_pkg))
    prompt = _prompt(native_pkg)
    greedy = [pipe.step("g", prompt, SamplingBatch.greedy(1))]
    for _ in range(9):
        greedy.append(pipe.step("g", greedy[-1:], SamplingBatch.greedy(1)))
    drafter = ModelDrafter(native_pkg.runner(0, len(native_pkg.manifest.units), threads=1, precision=local_form(native_pkg)))
    assert drafter.draft("d", prompt, 4) == greedy[:4]
    assert drafter.draft("d", prompt + greedy[:3], 4) == greedy[3:7]  # kept three: fed, drafting goes on
    diverged = prompt + greedy[:2] + [greedy[2] + 1]
    fresh = ModelDrafter(native_pkg.runner(0, len(native_pkg.manifest.units), threads=1, precision=local_form(native_pkg)))
    assert drafter.draft("d", diverged, 3) == fresh.draft("d", diverged, 3)
    drafter.forget("d")
    assert drafter.runner.sequences() == []


def test_the_verify_forms_names_agree():
    from edgepipe.model import graphs
    from edgepipe.runtime import stage_runner

    assert (graphs.DECODE_ROWS_KEY, graphs.HEAD_POSITIONS) == (stage_runner.DECODE_ROWS_KEY, stage_runner.HEAD_POSITIONS)


def test_sampled_verify_pass_equals_sampled_steps(native_pkg, verify_pipe):
    """Each position of a verify pass samples with its own token's seeded draw (a list of draws in
    the frame): the target's samples are the ones decoding one step at a time gives."""
    from edgepipe.runtime import controls
    from edgepipe.runtime.sequence import GenerationParams, uniform_draw

    params = GenerationParams(temperature=0.9, top_p=0.95, seed=11)
    prompt = _prompt(native_pkg)
    head = verify_pipe.runners[-1]

    def sampling(step: int, positions: int = 0) -> SamplingBatch:
        wire = controls.wire_sampling(params, step)
        if positions:
            wire["uniform"] = [uniform_draw(params.seed, step + i) for i in range(positions)]
        return SamplingBatch.from_wire([{"seq": "x", "sampling": wire}], head.vocab)

    tokens = [verify_pipe.step("one", prompt, sampling(0))]
    for step in range(1, 10):
        tokens.append(verify_pipe.step("one", tokens[-1:], sampling(step)))
    verify_pipe.drop("one")
    assert verify_pipe.step("v", prompt, sampling(0)) == tokens[0]
    x = np.array([tokens[:9]], np.int64)
    for runner in verify_pipe.runners:
        x = runner.run("v", x, sampling(1, 9) if runner.emits_tokens else None, verify=runner.emits_tokens)
    verify_pipe.drop("v")
    assert [int(t) for t in x] == tokens[1:10]
    assert len(set(tokens)) > 3  # sampled, not one repeated token


def test_primed_drafter_drafts_the_same(native_pkg):
    primed = ModelDrafter(native_pkg.runner(0, len(native_pkg.manifest.units), threads=1, precision=local_form(native_pkg)))
    cold = ModelDrafter(native_pkg.runner(0, len(native_pkg.manifest.units), threads=1, precision=local_form(native_pkg)))
    prompt = _prompt(native_pkg)
    primed.prime("p", prompt)
    assert primed.runner.length("p") == len(prompt)
    first = cold.draft("c", prompt, 1)
    assert primed.draft("p", prompt + first, 3) == cold.draft("c", prompt + first, 3)


def test_verify_pass_equals_decode_steps_in_fp32(fp32_pkg):
    """The float form too (its attention alone took the one-row kernels)."""
    pipe = fp32_pkg.pipeline(CUTS, verify_form=True, threads=1)
    prompt = _prompt(fp32_pkg)
    tokens = [pipe.step("one", prompt, SamplingBatch.greedy(1))]
    for _ in range(6):
        tokens.append(pipe.step("one", tokens[-1:], SamplingBatch.greedy(1)))
    assert pipe.step("v", prompt, SamplingBatch.greedy(1)) == tokens[0]
    x = np.array([tokens[:6]], np.int64)
    for runner in pipe.runners:
        x = runner.run("v", x, SamplingBatch.greedy(1) if runner.emits_tokens else None, verify=runner.emits_tokens)
    assert [int(t) for t in x] == tokens[1:7]


def test_steps_and_verify_passes_of_every_width_alternate(verify_pipe, reference):
    """Decode steps and verify passes of 1 and 2 drafts on the same runners (bound outputs are
    reused between runs of one shape, never of another)."""
    prompt, tokens, _ = reference
    out = _run(verify_pipe, "w", prompt)[0]
    for drafts in (0, 1, 0, 2, 1, 0, 1):
        fed = out[-1:] + tokens[len(out):len(out) + drafts]
        got = _run(verify_pipe, "w", fed, verify=drafts > 0)[0]
        out += got
    verify_pipe.drop("w")
    assert out == tokens  # 1 + 7 passes + 5 drafts kept


def test_a_draft_model_with_another_tokenizer_is_refused(native_pkg):
    from types import SimpleNamespace

    from edgepipe.cluster.shells.speculation import build_speculation

    target = SimpleNamespace(name="other-model", manifest=SimpleNamespace(tokenizer="0" * 64))
    with pytest.raises(ValueError, match="another tokenizer"):
        build_speculation(str(native_pkg.root), target)
    assert build_speculation("ngram", target).drafter.name == "ngram"


def test_a_replay_in_one_chunk_rebuilds_the_same_kv_in_the_verify_form(verify_pipe, reference):
    """Recovery (issue 30): in the verify form every position of a chunk has a decode step's bits,
    so a sequence's KV is rebuilt by one prefill of prompt + generated tokens instead of one
    decode step per generated token; the KV and the next token are those of the original run."""
    prompt, tokens, entries = reference
    x = np.array([prompt], np.int64)
    for runner in verify_pipe.runners:  # the original run again: prompt prefill, then decode steps
        x = runner.run("orig", x, SamplingBatch.greedy(1) if runner.emits_tokens else None)
    for t in tokens[:11]:
        x = np.array([[t]], np.int64)
        for runner in verify_pipe.runners:
            x = runner.run("orig", x, SamplingBatch.greedy(1) if runner.emits_tokens else None)
    replayed, _ = _run(verify_pipe, "replay", prompt + tokens[:11])  # one chunk
    assert replayed == tokens[11:12] == [int(np.atleast_1d(x)[0])]
    for runner in verify_pipe.runners:
        a, b = runner.export_kv("orig"), runner.export_kv("replay")
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), "the rebuilt KV differs"
    verify_pipe.drop("orig")
    verify_pipe.drop("replay")


def test_a_response_formats_masks_look_ahead_over_drafts(native_pkg):
    """TokenMask.lookahead: the mask after each draft the grammar allows (equal to advancing over
    them for real), ending at a draft it forbids, the matcher left where it was."""
    from edgepipe.api import structured

    tok, vocab = native_pkg.tokenizer, native_pkg.manifest.config["vocab_size"]
    constraint = structured.constraint_for(tok, vocab, structured.from_openai("json_object"))
    mask = constraint.token_mask()
    drafts = tok.encode('{"a": 1')
    after = mask.lookahead([], drafts + tok.encode("]"))
    assert len(after) == len(drafts)  # "]" cannot follow: the list ends there
    walked = constraint.token_mask()
    for i in range(len(drafts)):
        assert np.array_equal(after[i], walked(drafts[:i + 1]))
    assert np.array_equal(mask([]), constraint.token_mask()([])) and mask.matcher.tokens == []  # rolled back
    assert mask.lookahead([], tok.encode("x") + drafts) == []  # a first draft the grammar forbids: no masked drafts


def test_a_mask_per_position_forces_each_positions_token(verify_pipe, reference):
    """A verify entry's ``masks``: position i's token is the one its own mask allows (here one
    token each, not the greedy one), and a count of masks other than the positions is refused."""
    prompt, tokens, _ = reference
    head, vocab = verify_pipe.runners[-1], verify_pipe.runners[-1].vocab

    def only(token: int) -> bytes:
        bits = np.zeros(vocab, bool)
        bits[token] = True
        return np.packbits(bits, bitorder="little").tobytes()

    forced = [tokens[1] + 1, tokens[2] + 2, tokens[3] + 3]
    _run(verify_pipe, "m", prompt)
    entry = {"seq": "m", "verify": True, "sampling": {**WANT[0]["sampling"], "masks": [only(t) for t in forced]}}
    x = np.array([tokens[:3]], np.int64)
    for runner in verify_pipe.runners:
        x = runner.run("m", x, SamplingBatch.from_wire([entry], vocab) if runner.emits_tokens else None, verify=runner.emits_tokens)
    assert [int(t) for t in x] == forced
    entry["sampling"]["masks"] = entry["sampling"]["masks"][:2]
    x = np.array([tokens[3:6]], np.int64)
    for runner in verify_pipe.runners[:-1]:
        x = runner.run("m", x)
    with pytest.raises(ValueError, match="as many masks"):
        head.run("m", x, SamplingBatch.from_wire([entry], vocab), verify=True)
    verify_pipe.drop("m")
