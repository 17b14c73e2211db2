"""A lone decode row: alone at M = 1 by default, or with the batch's bits under ``--batch-invariant``.

MLAS gives a one-row 4-bit MatMulNBits (M = 1) sums of its own, 20-25% faster than its M >= 2
kernel, which gives every row the same bits in any batch. By default a lone row runs at M = 1
(as llama.cpp and vLLM do); the batch-invariant form of a stage graph (``graphs.pad_lone_rows``)
runs a lone row's 4-bit products on two rows, so a sequence gets the same bits alone as batched.
Checked on the hidden state after the first half of the layers (every float bit) and on the
head's tokens, for the native Q4_1 package (4-bit blocks + offsets, Q8_0 head) and the
re-quantized int4 one.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.model.store import resolve
from edgepipe.runtime.stage_runner import SamplingBatch

PROMPTS = ["Name a fruit.", "Say hi."]


@pytest.mark.parametrize("precision", ["native", "int4"])
def test_invariant_lone_row_equals_its_row_in_a_batch_bit_for_bit(home, precision):
    pkg = resolve("smollm2", precision, home)
    tok, half = pkg.tokenizer, len(pkg.manifest.units) // 2
    first = pkg.runner(0, half, batch_invariant=True)
    ids = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in PROMPTS]
    for i, p in enumerate(ids):
        first.run(f"s{i}", np.array([p], np.int64))
    nxt = np.array([[ids[0][-1]], [ids[1][-1]]], np.int64)
    alone = first.run("s0", nxt[:1])  # [1, 1, H], B = 1: the graph pads its 4-bit products
    first._pool.length["s0"] -= 1  # replay the same position, now batched with s1
    batched = first.run_batch(["s0", "s1"], nxt)
    assert alone.shape == (1, 1, pkg.manifest.config["hidden_size"])
    assert np.array_equal(alone[0].view(np.uint32), batched[0].view(np.uint32))


def test_only_the_invariant_graph_pads_and_only_its_4bit_products(home):
    """The default stage graph runs a lone row as it is; the invariant one pads each 4-bit
    product (and nothing else), and a graph without 4-bit products is its own invariant form."""
    import onnx

    pkg = resolve("smollm2", "native", home)
    n = len(pkg.manifest.units)

    def ops(sha: str) -> list[onnx.NodeProto]:
        return list(onnx.load(str(pkg.blob(sha)), load_external_data=False).graph.node)

    plain, invariant = ops(pkg.stage_graph(0, n)), ops(pkg.stage_graph(0, n, batch_invariant=True))
    four_bit = [x for x in plain if x.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 4 for a in x.attribute)]
    assert four_bit and not any(x.op_type == "Pad" for x in plain)
    padded = {x.output[0] for x in invariant if x.op_type == "Pad"}
    assert sum(x.input[0] in padded for x in invariant if x.op_type == "MatMulNBits") == len(four_bit)
    assert len(invariant) > len(plain)
    fp32 = resolve("smollm2", "fp32", home)
    assert fp32.stage_graph(0, 3, batch_invariant=True) == fp32.stage_graph(0, 3)


def test_invariant_lone_head_step_equals_batched_head_step(home):
    pkg = resolve("smollm2", "native", home)
    pipe, tok = pkg.pipeline(batch_invariant=True), pkg.tokenizer
    ids = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in PROMPTS]
    solo = []
    for i, p in enumerate(ids):
        out = [pipe.step(f"a{i}", p, SamplingBatch.greedy(1))]
        for _ in range(6):
            out.append(pipe.step(f"a{i}", out[-1:], SamplingBatch.greedy(1)))
        solo.append(out)
    runner = pipe.runners[0]
    got = [[runner.run(f"b{i}", np.array([p], np.int64), SamplingBatch.greedy(1))[0]] for i, p in enumerate(ids)]
    for _ in range(6):
        x = np.array([[int(g[-1])] for g in got], np.int64)
        for g, t in zip(got, runner.run_batch(["b0", "b1"], x, SamplingBatch.greedy(2))):
            g.append(t)
    assert [[int(t) for t in g] for g in got] == solo


@pytest.mark.parametrize("threads", [1, 2])
def test_graph_linear_gives_a_row_the_same_bits_in_any_batch_of_two_or_more(threads):
    """Unit level: one 4-bit/32 linear with block offsets as the graph builds it gives row i the
    same bits in every batch of M = 2..6 (MLAS's M >= 2 kernel is row-independent), which is what
    the bystander row of a batch-invariant runner relies on."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from edgepipe.model.graphs import _Graph
    from edgepipe.model.weights import BlockQuantized

    rng = np.random.default_rng(threads)
    n, k = 192, 256
    w = BlockQuantized(4, 32, rng.integers(0, 16, (n, k), dtype=np.uint8), (rng.random((n, k // 32)) * 0.02).astype(np.float32),
                       None, (rng.standard_normal((n, k // 32)) * 0.05).astype(np.float32))
    g = _Graph("t.")
    g.linear("x", w, "w", out="y")
    model = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], "linear")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((6, 1, k)).astype(np.float32)
    pairs = np.concatenate([s.run(None, {"x": x[i : i + 2]})[0][:1] for i in range(5)] + [s.run(None, {"x": x[4:6]})[0][1:]])
    assert pairs.shape == (6, 1, n)
    for m in range(2, 7):
        assert np.array_equal(s.run(None, {"x": x[:m]})[0].view(np.uint32), pairs[:m].view(np.uint32)), m
