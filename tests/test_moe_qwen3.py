"""qwen3moe (Qwen3-30B-A3B's layer: QK norm, NEOX rope, 128 experts, top 8, renormalised) on a
synthetic GGUF of its per-layer shapes, against a numpy reference of llama.cpp's graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgepipe.model.gguf_header import read_header, unsupported_reasons
from edgepipe.model.store import bundled_gguf, local_form, prepare_local_form, resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from edgepipe.bench.moe_files import qwen3moe_reference, synthetic_qwen3moe

PROMPT = "The experts of a mixture are chosen per token."


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    return synthetic_qwen3moe(tmp_path_factory.mktemp("qwen3moe") / "qwen3moe-synthetic.gguf", bundled_gguf())


def test_qwen3moe_equals_llama_cpp_reference(home, qwen3moe):
    path, weights = qwen3moe
    assert unsupported_reasons(read_header(path)) == []
    layers = weights["shapes"]["layers"]
    for precision, tolerance in (("fp32", 1e-5), (None, 3e-2)):  # float weights; then the file's blocks in the form run here
        pkg = resolve(str(path), precision or "native", home)
        if precision is None:
            prepare_local_form(pkg)
            precision = local_form(pkg)
        cfg = pkg.manifest.config
        assert (cfg["n_experts"], cfg["n_experts_used"], cfg["expert_intermediate_size"], cfg["qk_norm"]) == (128, 8, 96, True)
        ids = pkg.tokenizer.encode(PROMPT)
        hidden = pkg.runner(0, layers + 1, precision).run("s", np.array([ids]))[0]
        ref_hidden, ref_logits = qwen3moe_reference(weights, ids)
        error = np.linalg.norm(hidden - ref_hidden, axis=-1) / np.linalg.norm(ref_hidden, axis=-1)
        assert error.max() < tolerance, (precision, error)
        result = generate(pkg.pipeline([2], precision=precision), ids, GenerationParams(max_tokens=1), pkg.tokenizer.decode, eos_ids=())
        assert result.tokens == [int(np.argmax(ref_logits[-1]))], precision


def test_qwen3moe_with_mxfp4_experts_in_both_forms(home, tmp_path):
    """The experts as gpt-oss stores them (MXFP4): the kernel form keeps the 3-D blocks and runs
    them through GgufMoEMatMul, the fallback form holds them exactly as 8-bit MatMulNBits blocks;
    each hidden state equals the reference of the dequantized weights but for the 8-bit
    activations, and the next token is the reference's."""
    from edgepipe.native import kernel_handles

    assert kernel_handles("MXFP4")
    path, weights = synthetic_qwen3moe(tmp_path / "qwen3moe-mxfp4.gguf", bundled_gguf(), expert_type="MXFP4", layers=1, experts=32, used=4)
    assert {t.type_id for n, t in read_header(path).tensors.items() if "_exps" in n} == {39}
    ids = None
    for precision in ("gguf", "native"):
        pkg = resolve(str(path), precision, home)
        graph = Path(pkg.blob(pkg.stage_graph(0, 2, precision))).read_bytes()
        assert (b"GgufMoEMatMul" in graph) == (precision == "gguf"), precision  # the kernel form reads the blocks as stored
        ids = ids or pkg.tokenizer.encode(PROMPT)
        hidden = pkg.runner(0, 2, precision).run("s", np.array([ids]))[0]
        ref_hidden, ref_logits = qwen3moe_reference(weights, ids)
        error = np.linalg.norm(hidden - ref_hidden, axis=-1) / np.linalg.norm(ref_hidden, axis=-1)
        assert error.max() < 3e-2, (precision, error)
        result = generate(pkg.pipeline([1], precision=precision), ids, GenerationParams(max_tokens=1), pkg.tokenizer.decode, eos_ids=())
        assert result.tokens == [int(np.argmax(ref_logits[-1]))], precision


def test_layers_too_big_to_measure_are_priced_by_their_routed_bytes(qwen3moe, tmp_path, monkeypatch):
    """A Qwen3-30B-A3B's or a Mixtral's every layer passes the import's measuring bound: each is
    then estimated from the bytes a one-row step reads (shared weights and k experts), never 0
    (it was: no layer measured gave a rate of 0, layers cost nothing, and the join calibration
    found no two costs to fit a speed to)."""
    from edgepipe.model import importer
    from edgepipe.model.package import Package

    path, weights = qwen3moe
    monkeypatch.setattr(importer, "plan_measurements", lambda kinds, sizes: [None] * len(kinds))  # nothing loaded: all estimated
    pkg = Package(importer.import_model(path, tmp_path / "models", "gguf", measure_cost=True))
    units = pkg.manifest.units
    E, k = weights["shapes"]["experts"], weights["shapes"]["used"]
    for u in units[1:-1]:
        v = u.variants["gguf"]
        assert u.experts == E and v.expert_bytes > 0
        routed = v.weight_bytes - (E - k) * v.expert_bytes
        assert u.cost_s == pytest.approx(importer.ESTIMATED_S_PER_BYTE * routed, rel=1e-6)
        assert u.cost_s < importer.ESTIMATED_S_PER_BYTE * v.weight_bytes / 4  # k of E experts, not all of them
    from edgepipe.cluster.rules.profiling import ClusterProfile

    profile = ClusterProfile(pkg.manifest)
    profile.calibrated("w", [(profile.unit_cost(1, 2), 0.002), (profile.unit_cost(1, 3), 0.003)])
    assert profile.of("w").speed > 0
