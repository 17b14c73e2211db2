"""Any contiguous cut of the units into stage runners gives the single runner's tokens."""

from __future__ import annotations

import random

import pytest

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form

PROMPT = "List three facts about the Moon."


def reference(pkg, params, cuts=()):
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    return generate(pkg.pipeline(list(cuts), precision=local_form(pkg)), ids, params, tok.decode, eos_ids=()).tokens


@pytest.fixture(scope="module")
def single_reference(native_pkg):
    """The one-runner tokens every random cut is compared with (computed once for the module)."""
    return reference(native_pkg, GenerationParams(max_tokens=24))


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_random_cuts_equal_one_runner(native_pkg, single_reference, stages):
    n_units = len(native_pkg.manifest.units)
    rng = random.Random(1000 + stages)
    params, single = GenerationParams(max_tokens=24), single_reference
    for _ in range(2):
        cuts = sorted(rng.sample(range(1, n_units), stages - 1))
        assert reference(native_pkg, params, cuts) == single, f"cuts {cuts}"


def test_fp32_cuts_equal_one_runner(fp32_pkg):
    params = GenerationParams(max_tokens=24)
    assert reference(fp32_pkg, params, [1, 16, 31]) == reference(fp32_pkg, params)


def test_seeded_sampling_is_reproducible_across_cuts(native_pkg):
    params = GenerationParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    first = reference(native_pkg, params)
    assert reference(native_pkg, params, [9, 22]) == first
    other = reference(native_pkg, GenerationParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, seed=8))
    assert other != first  # the seed matters


def test_top_k_one_is_greedy(native_pkg):
    greedy = reference(native_pkg, GenerationParams(max_tokens=16))
    assert reference(native_pkg, GenerationParams(max_tokens=16, temperature=1.3, top_k=1, seed=3)) == greedy
