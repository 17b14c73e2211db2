"""Any contiguous cut of the units into stage runners gives the single runner's tokens."""

from __future__ import annotations

import random

import pytest

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

PROMPT = "List three facts about the Moon."


def reference(pkg, params, cuts=()):
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    return generate(pkg.pipeline(list(cuts)), ids, params, tok.decode, eos_ids=()).tokens


@pytest.fixture(scope="module")
def int4_single(int4_pkg):
    """The one-runner tokens every random cut is compared with (computed once for the module)."""
    return reference(int4_pkg, GenerationParams(max_tokens=24))


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_random_cuts_equal_one_runner(int4_pkg, int4_single, stages):
    n_units = len(int4_pkg.manifest.units)
    rng = random.Random(1000 + stages)
    params, single = GenerationParams(max_tokens=24), int4_single
    for _ in range(2):
        cuts = sorted(rng.sample(range(1, n_units), stages - 1))
        assert reference(int4_pkg, params, cuts) == single, f"cuts {cuts}"


def test_fp32_cuts_equal_one_runner(fp32_pkg):
    params = GenerationParams(max_tokens=24)
    assert reference(fp32_pkg, params, [1, 16, 31]) == reference(fp32_pkg, params)


def test_seeded_sampling_is_reproducible_across_cuts(int4_pkg):
    params = GenerationParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    first = reference(int4_pkg, params)
    assert reference(int4_pkg, params, [9, 22]) == first
    other = reference(int4_pkg, GenerationParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=8))
    assert other != first  # the seed matters


def test_top_k_one_is_greedy(int4_pkg):
    greedy = reference(int4_pkg, GenerationParams(max_tokens=16))
    assert reference(int4_pkg, GenerationParams(max_tokens=16, temperature=1.3, top_k=1, seed=3)) == greedy
