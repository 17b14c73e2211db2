"""Native import: the GGUF's own blocks in the package, cut anywhere still exact, fp32 variant.

The bundled SmolLM2 (Q4_1, tied embedding/head) runs in the default suite; the 0.5B Qwen file
(Q4_K/Q5_0/Q6_K/Q8_0, untied head) in a slow test when it is on the machine.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from edgepipe.model.importer import add_variant, import_model
from edgepipe.model.package import Package
from edgepipe.model.store import bundled_gguf, missing_reference, reference_gguf, resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.runtime.stage_runner import SamplingBatch

QWEN = reference_gguf("qwen05")
PROMPT = "List three facts about the Moon."


@pytest.fixture(scope="module")
def native_pkg(home):
    return resolve("smollm2", "native", home)


def tokens(pkg, cuts=(), precision=None, n=24):
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    return generate(pkg.pipeline(list(cuts), precision=precision), ids, GenerationParams(max_tokens=n), tok.decode, eos_ids=()).tokens


def teacher_forced(pkg, ids, precision=None):
    pipe, greedy = pkg.pipeline([], precision=precision), SamplingBatch.greedy(1)
    out = [pipe.step("tf", ids[:8], greedy)]
    out += [pipe.step("tf", [t], greedy) for t in ids[8:-1]]
    pipe.drop("tf")
    return out


def test_native_package_keeps_the_files_blocks_and_shares_the_tied_table(native_pkg):
    m = native_pkg.manifest
    assert m.precision == "native"
    embed, head = m.variant(0), m.variant(len(m.units) - 1)
    shared = set(embed.files) & set(head.files)
    # the file's Q8_0 table (8-bit blocks and their scales): the same two files in both units
    assert shared == set(embed.files) and len(shared) == 2, (embed.files, head.files)
    size = sum(u.variants["native"].weight_bytes for u in m.units) - sum(  # (other tests may have added other forms)
        (native_pkg.blob(s).stat().st_size for s in shared))
    assert size < 1.25 * bundled_gguf().stat().st_size  # Q4_1: 20 bytes per 32 weights in the file, 24 here


@pytest.mark.parametrize("stages", [3])
def test_native_cuts_equal_one_runner(native_pkg, stages):
    single = tokens(native_pkg)
    rng = random.Random(13 + stages)
    cuts = sorted(rng.sample(range(1, len(native_pkg.manifest.units)), stages - 1))
    assert tokens(native_pkg, cuts) == single, f"cuts {cuts}"


@pytest.mark.slow
def test_fp32_variant_of_native_package_agrees_and_cuts_exactly(native_pkg):
    add_variant(native_pkg.root, "fp32")
    native_pkg.reload()
    ref = tokens(native_pkg, precision="fp32")
    assert tokens(native_pkg, [5, 20], precision="fp32") == ref
    # same weights; only MatMulNBits' int8 activations differ from fp32 MatMul
    ids = native_pkg.tokenizer.encode(PROMPT) + ref
    a, b = teacher_forced(native_pkg, ids), teacher_forced(native_pkg, ids, "fp32")
    assert np.mean(np.array(a) == np.array(b)) >= 0.9


def test_reimport_is_instant_and_content_addressed(native_pkg, tmp_path):
    manifest = native_pkg.root / "manifest.json"
    before = manifest.stat().st_mtime_ns
    assert import_model(bundled_gguf(), native_pkg.root.parent, "native", name=native_pkg.root.name) == native_pkg.root
    assert manifest.stat().st_mtime_ns == before
    cache = json.loads((native_pkg.root.parent.parent / "cache" / "source-hashes.json").read_text())
    assert any(k.startswith(str(bundled_gguf().resolve())) for k in cache)


@pytest.mark.slow
def test_qwen05_native_cut_anywhere(tmp_path):
    if missing := missing_reference("qwen05"):
        pytest.fail(missing)
    pkg = Package(import_model(QWEN, tmp_path / "models", "native", measure_cost=False))
    kinds = {json.dumps(sorted(u.variants["native"].files)) for u in pkg.manifest.units}
    assert len(kinds) == len(pkg.manifest.units)
    single = tokens(pkg, n=16)
    for cuts in ([1], [7, 19], [12, 25]):
        assert tokens(pkg, cuts, n=16) == single, f"cuts {cuts}"


def test_measurement_plan_bounds_memory_and_samples_equal_layers():
    from edgepipe.model.importer import plan_measurements

    kinds = ["embedding", "layer", "layer", "layer", "layer", "head"]
    sizes = [900, 100, 100, 120, 100, 700]
    assert plan_measurements(kinds, sizes, limit=500, samples=2) == [None, 1, 2, 3, 1, None]
