"""Precision `gguf`: linears as the file's bytes, run by the native kernel library's GgufMatMul.

The bundled SmolLM2 (Q4_1 layers, tied Q8_0 table) gets a `gguf` variant beside its `native`
one: its layers are the file's size, cuts stay exact, it agrees with the MatMulNBits graphs up to
the activation rounding, and without the library it says so in one line while `native` still runs.
"""

from __future__ import annotations

import gguf
import numpy as np
import onnx
import pytest

from edgepipe.model.importer import add_variant
from edgepipe.model.store import bundled_gguf, resolve
from edgepipe.native import reset_for_tests
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.runtime.stage_runner import SamplingBatch

PROMPT = "List three facts about the Moon."


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    package = resolve("smollm2", "native", tmp_path_factory.mktemp("kernel-home"))
    add_variant(package.root, "gguf")
    package.reload()
    return package


def tokens(pkg, precision, cuts=(), n=24):
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    return generate(pkg.pipeline(list(cuts), precision=precision), ids, GenerationParams(max_tokens=n), tok.decode, eos_ids=()).tokens


def teacher_forced(pkg, ids, precision):
    pipe, greedy = pkg.pipeline([], precision=precision), SamplingBatch.greedy(1)
    out = [pipe.step("tf", ids[:8], greedy)]
    out += [pipe.step("tf", [t], greedy) for t in ids[8:-1]]
    pipe.drop("tf")
    return out


def test_layers_are_the_files_bytes_run_by_the_kernel(pkg):
    reader = gguf.GGUFReader(bundled_gguf())
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    m = pkg.manifest
    for unit in m.units[1:-1]:
        layer = unit.index - 1
        in_file = sum(b for name, b in file_bytes.items() if name.startswith(f"blk.{layer}."))
        assert in_file <= unit.variants["gguf"].weight_bytes <= 1.01 * in_file  # + nothing but the norms
        assert unit.variants["gguf"].weight_bytes < 0.85 * unit.variants["native"].weight_bytes
    graph = onnx.load(pkg.blob(m.variant(1, "gguf").graph), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("GgufMatMul") == 4 and "MatMulNBits" not in ops  # qkv, attn_output, gate_up, ffn_down
    # the tied Q8_0 table: one blob of the file's bytes, gathered by the embedding, multiplied by the head
    embed, head = m.variant(0, "gguf"), m.variant(len(m.units) - 1, "gguf")
    assert set(embed.files) <= set(head.files) and embed.weight_bytes == file_bytes["token_embd.weight"]
    assert "GgufGather" in [n.op_type for n in onnx.load(pkg.blob(embed.graph), load_external_data=False).graph.node]


def test_kv_moves_between_the_kernel_forms_fp16_cache_and_the_fallbacks_fp32_one(pkg):
    """The kernel form keeps its KV in fp16, the fallback in fp32: a move converts at import. fp16 ->
    fp32 is exact, so KV that goes kernel -> fallback -> kernel comes back bit for bit and the
    sequence continues with the very tokens it would have; fp32 -> fp16 rounds to nearest even."""
    greedy, ids = SamplingBatch.greedy(1), pkg.tokenizer.encode(PROMPT)
    kernel, fallback = pkg.pipeline([], precision="gguf"), pkg.pipeline([], precision="native")
    assert "KvAttention" in [n.op_type for n in onnx.load(pkg.blob(pkg.manifest.variant(1, "gguf").graph), load_external_data=False).graph.node]
    assert pkg.manifest.kv_bytes_per_token(1, "gguf") * 2 == pkg.manifest.kv_bytes_per_token(1, "native")
    from edgepipe.cluster.rules.profiling import ClusterProfile

    profiles = {p: ClusterProfile(pkg.manifest, context_tokens=256).model_profile(p) for p in ("gguf", "native")}
    assert [2 * u.kv_bytes_per_token for u in profiles["gguf"].units] == [u.kv_bytes_per_token for u in profiles["native"].units]
    assert profiles["gguf"].stage_bytes(1, 5, 1) < profiles["native"].stage_bytes(1, 5, 1)  # the planner's budget follows
    token = kernel.step("s", ids, greedy)
    kv16, length = kernel.runners[0].export_kv("s"), kernel.runners[0].length("s")
    assert {t.dtype for t in kv16.values()} == {np.dtype(np.float16)}
    fallback.runners[0].import_kv("s", kv16, length)
    assert 2 * kernel.runners[0].kv_bytes == fallback.runners[0].kv_bytes > 0  # one row of the same capacity: half the bytes
    kv32 = fallback.runners[0].export_kv("s")
    assert all(kv32[n].dtype == np.float32 and np.array_equal(kv32[n], kv16[n].astype(np.float32)) for n in kv16)
    back = pkg.pipeline([], precision="gguf")
    back.runners[0].import_kv("s", kv32, length)
    assert all(np.array_equal(back.runners[0].export_kv("s")[n].view(np.uint16), kv16[n].view(np.uint16)) for n in kv16)
    continued, moved = [token], [token]
    for _ in range(8):
        continued.append(kernel.step("s", [continued[-1]], greedy))
        moved.append(back.step("s", [moved[-1]], greedy))
    assert moved == continued
    # the fallback's own fp32 KV into the kernel form: rounded as numpy rounds
    fallback.step("f", ids, greedy)
    own32 = fallback.runners[0].export_kv("f")
    back.runners[0].import_kv("f", own32, length)
    rounded = back.runners[0].export_kv("f")
    assert all(np.array_equal(rounded[n].view(np.uint16), own32[n].astype(np.float16).view(np.uint16)) for n in own32)
    assert any(not np.array_equal(rounded[n].astype(np.float32), own32[n]) for n in own32)  # the rounding is real


def test_batched_rows_equal_alone_in_the_kernel_form(pkg):
    """GgufMatMul and KvAttention give a row the same bits at any batch (rows of other lengths beside
    it, a gap in the pool), so batched decode equals solo decode, logprobs too, without the
    batch-invariant option."""
    runner = pkg.runner(0, len(pkg.manifest.units), precision="gguf")
    tok = pkg.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("Hello there!"), tok.encode(PROMPT + " In one line, please.")]
    sampling = lambda n: SamplingBatch(False, np.ones(n, np.float32), np.zeros(n, np.int64), np.ones(n, np.float32),  # noqa: E731
                                       np.zeros(n, np.float32), num_top=3)
    solo = []
    for i, ids in enumerate(prompts):
        got = [int(runner.run(f"solo{i}", np.array([ids], np.int64), sampling(1))[0])]
        logprobs = []
        for _ in range(10):
            got.append(int(runner.run(f"solo{i}", np.array([[got[-1]]], np.int64), sampling(1))[0]))
            logprobs.append(runner.last_head[1].top_logprobs[0].copy())
        solo.append((got, np.stack(logprobs)))
        runner.drop(f"solo{i}")
    seqs, got = [f"b{i}" for i in range(3)], []
    for i, (s, ids) in enumerate(zip(seqs, prompts)):
        got.append([int(runner.run(s, np.array([ids], np.int64), sampling(1))[0])])
        if i == 0:  # a sequence between the batch's rows: the pool moves rows to run the batch
            runner.run("other", np.array([prompts[1]], np.int64), sampling(1))
    logprobs = [[] for _ in seqs]
    for _ in range(10):
        tokens = runner.run_batch(seqs, np.array([[g[-1]] for g in got], np.int64), sampling(3))
        for g, lp, t, row in zip(got, logprobs, tokens, runner.last_head[1].top_logprobs):
            g.append(int(t))
            lp.append(row.copy())
    for (tokens, lp), g, blp in zip(solo, got, logprobs):
        assert g == tokens
        assert np.array_equal(np.stack(blp), lp)  # bit for bit


def test_gguf_cuts_equal_one_runner_and_agree_with_native(pkg):
    single = tokens(pkg, "gguf")
    assert tokens(pkg, "gguf", cuts=[5, 20]) == single
    ids = pkg.tokenizer.encode(PROMPT) + tokens(pkg, "native", n=48)
    agree = np.mean(np.array(teacher_forced(pkg, ids, "gguf")) == np.array(teacher_forced(pkg, ids, "native")))
    assert agree >= 0.9, agree  # same weights; 8-bit activations per block in both, rounded differently


def test_without_the_library_gguf_graphs_refuse_in_one_line(pkg, monkeypatch):
    monkeypatch.setenv("EDGEPIPE_NATIVE", "0")
    reset_for_tests()
    try:
        with pytest.raises(RuntimeError, match="uses edgepipe.gguf ops but the GGUF kernel library is unavailable: turned off"):
            pkg.runner(1, 2, "gguf")
        assert len(tokens(pkg, "native", n=4)) == 4  # the MatMulNBits graphs need nothing native
    finally:
        reset_for_tests()


def test_qwen_gguf_package_is_the_files_size(tmp_path):
    """The 0.5B Qwen (Q5_0/Q8_0/Q4_K/Q6_K, untied head): every weight as stored, ~the file's size."""
    from edgepipe.model.importer import import_model
    from edgepipe.model.package import Package
    from edgepipe.model.store import missing_reference, reference_gguf

    if missing := missing_reference("qwen05"):
        pytest.fail(missing)
    package = Package(import_model(reference_gguf("qwen05"), tmp_path, "gguf", measure_cost=False))
    m = package.manifest
    size = sum(package.blob(s).stat().st_size for s in m.stage_files(0, len(m.units)))
    assert size <= 1.05 * reference_gguf("qwen05").stat().st_size
    assert len(tokens(package, "gguf", cuts=[7], n=8)) == 8
