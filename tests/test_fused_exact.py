"""Products fused along N (Q/K/V, gate/up: one MatMulNBits and one block-offset matmul) give
every output column the same bits as the separate products, at one row and in a batch.

Each output column of MatMulNBits (and of the offsets' MatMul) is its own dot product over K, so
stacking weight rows must not change a bit; the importer and graphs rely on it (``concat_rows``,
``_native_linear``). Checked for the native layouts: 4-bit / 32 with per-block offsets (Q4_1,
Q4_K), 8-bit / 32 (Q5_0, Q8_0) and 8-bit / 16 (Q6_K), a lone row and 3 rows.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgepipe.model.graphs import _Graph
from edgepipe.model.weights import BlockQuantized, concat_rows

K = 256


def random_blocks(rng, n: int, bits: int, block: int, offsets: bool) -> BlockQuantized:
    q = rng.integers(0, 2**bits, (n, K), dtype=np.uint8)
    scales = (rng.random((n, K // block)) * 0.02 + 1e-3).astype(np.float32)
    off = (rng.standard_normal((n, K // block)) * 0.05).astype(np.float32) if offsets else None
    return BlockQuantized(bits, block, q, scales, None, off)


def session(weights: list[BlockQuantized], fused: bool) -> ort.InferenceSession:
    g = _Graph("t.")
    if fused:
        g.linear("x", concat_rows(weights), "w", out="y")
    else:
        parts = [g.linear("x", w, f"w{i}") for i, w in enumerate(weights)]
        g.op("Concat", parts, out=["y"], axis=-1)
    model = g.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], "fused")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("layout", [(4, 32, True), (8, 32, False), (8, 32, True), (8, 16, False)], ids=str)
def test_fused_product_equals_separate_products_bit_for_bit(layout):
    bits, block, offsets = layout
    rng = np.random.default_rng(bits * 100 + block)
    weights = [random_blocks(rng, n, bits, block, offsets) for n in (64, 32, 32)]  # q, k, v
    fused, separate = session(weights, True), session(weights, False)
    x = rng.standard_normal((3, 1, K)).astype(np.float32)
    for rows in (x[:1], x):  # a lone decode row and a batch of three
        a, b = fused.run(None, {"x": rows})[0], separate.run(None, {"x": rows})[0]
        assert a.shape == (len(rows), 1, 128)
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    pair = fused.run(None, {"x": x[:2]})[0]  # rows keep their bits in any batch of two or more (what --batch-invariant relies on)
    assert np.array_equal(pair.view(np.uint32), fused.run(None, {"x": x})[0][:2].view(np.uint32))
