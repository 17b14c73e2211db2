"""The native GGUF kernel (`edgepipe.native`, op `edgepipe.gguf.GgufMatMul`) against numpy.

The op quantizes each activation row per block to 8 bits and multiplies by the GGUF blocks as
stored. Its output must equal ``quantize8(x) @ dequantize(W).T`` (gguf's own dequantization) up
to float accumulation order, for every type, every ISA this CPU has, one row and many rows, one
thread and two; and it must differ from the fp32 product only by that activation quantization.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from gguf.constants import GGML_QUANT_SIZES
from onnx import TensorProto, helper

from edgepipe.model.store import missing_reference, reference_gguf
from edgepipe.native import DOMAIN, GATHER_OP, MATMUL_OP, gguf_kernel_library, native_library, reset_for_tests
from edgepipe.native.build import BuildError, build_library
from edgepipe.native.quant_types import BY_NAME, QUANT_TYPES

TYPES = [t.name for t in QUANT_TYPES]  # every row of the type table
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": []}  # byte offsets of fp16 scales in a block
E8M0_FIELDS = {"MXFP4": 0}  # byte offset of an E8M0 block exponent
ISA_LADDERS = [["portable", "avx2", "avx512vnni", "avx512vnni+amx"], ["portable", "neon", "neon_dotprod"]]


@pytest.fixture(scope="module")
def library() -> str:
    path = gguf_kernel_library()
    assert path is not None, native_library().reason
    return str(path)


@pytest.fixture(scope="module")
def isas(library) -> list[str]:
    """Every kernel path this CPU can run, portable first."""
    handle = ctypes.CDLL(library)
    handle.edgepipe_gguf_best_isa.restype = ctypes.c_char_p
    best = handle.edgepipe_gguf_best_isa().decode()
    ladder = next(candidate for candidate in ISA_LADDERS if best in candidate)
    return ladder[: ladder.index(best) + 1]


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows ``[n, row_bytes]``: random codes, finite fp16 scales, one block with scale 0."""
    values, size = GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for offset in HALF_FIELDS[kind]:
        scales = (rng.standard_normal((n, k // values)) * 0.02).astype(np.float16)
        scales[0, 0] = 0
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // values, 2)
    if kind in E8M0_FIELDS:  # exponents 2^-28..2^-1, and one block at the smallest, 2^-128 (a subnormal scale)
        raw[:, :, E8M0_FIELDS[kind]] = rng.integers(100, 128, size=(n, k // values), dtype=np.uint8)
        raw[0, 0, E8M0_FIELDS[kind]] = 0
    return raw.reshape(n, -1)


def quantize8(x: np.ndarray, block: int) -> np.ndarray:
    """The op's activation rounding in numpy: d = amax / 127, q = rint(x * (127 / amax)), x ~ q d."""
    blocks = x.reshape(-1, block).astype(np.float32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    return (np.rint(blocks * inverse) * (amax / np.float32(127))).reshape(x.shape)


def dequantized(raw: np.ndarray, kind: str, k: int) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(-1, k)


def matmul_model(kind: str | int, k: int) -> bytes:
    qtype = kind if isinstance(kind, int) else int(gguf.GGMLQuantizationType[kind])
    node = helper.make_node(MATMUL_OP, ["x", "w"], ["y"], domain=DOMAIN, qtype=qtype)
    graph = helper.make_graph(
        [node], "gguf_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", k]),
         helper.make_tensor_value_info("w", TensorProto.UINT8, ["n", "row_bytes"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    return model.SerializeToString()


def run_op(library: str, kind: str, x: np.ndarray, w: np.ndarray, threads: int = 1) -> np.ndarray:
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(matmul_model(kind, x.shape[-1]), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "w": w})[0]


def check_product(y: np.ndarray, x: np.ndarray, weights: np.ndarray, kind: str) -> None:
    """y equals the product of the 8-bit activations within float rounding, and the fp32 product
    only within the activation quantization."""
    block = BY_NAME[kind].activation
    x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
    xq = quantize8(x.reshape(-1, x.shape[-1]), block).astype(np.float64)
    w64 = weights.astype(np.float64)
    magnitude = np.abs(xq) @ np.abs(w64).T + 1e-30  # bound on each output's rounding scale
    got = y.reshape(x2.shape[0], -1).astype(np.float64)
    rounding_error = np.abs(got - xq @ w64.T) / magnitude
    assert rounding_error.max() < 2e-6, f"{kind}: off the quantized-activation product by {rounding_error.max():.2e}"
    quantization_error = np.abs(got - x2 @ w64.T) / magnitude
    assert quantization_error.max() < 0.01, f"{kind}: off the fp32 product by {quantization_error.max():.2e}"
    # the activation rounding is real: the op is measurably nearer the 8-bit product than the fp32 one
    assert np.median(quantization_error) > 20 * np.median(rounding_error)


@pytest.mark.parametrize("kind", TYPES)
def test_every_type_and_isa_matches_the_quantized_product(kind, library, isas, monkeypatch):
    rng = np.random.default_rng(TYPES.index(kind))
    k, n = 512, 40
    raw = random_blocks(kind, n, k, rng)
    weights = dequantized(raw, kind, k)
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    x[0, 1, :32] = 0.0  # an all-zero activation block
    outputs = {}
    for isa in isas:
        monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
        for rows in (1, 5):
            y = run_op(library, kind, x[:, :rows], raw)
            assert y.shape == (1, rows, n)
            check_product(y, x[:, :rows], weights, kind)
        outputs[isa] = y
    for isa, y in outputs.items():  # the paths agree with each other to float rounding
        np.testing.assert_allclose(y, outputs["portable"], rtol=1e-5, atol=1e-5 * np.abs(y).max(), err_msg=isa)


@pytest.mark.parametrize("kind", TYPES)
def test_a_row_gives_the_same_bits_alone_or_in_a_batch(kind, library, isas, monkeypatch):
    """Batch invariance: the multi-row path (one weight block unpacked for a tile of rows) keeps
    each row's arithmetic that of the one-row path, so a row's output does not depend on how many
    rows share the call or where in a tile it falls (11 rows: tiles of 8 and 3; rows 1-9: 8 and 1)."""
    rng = np.random.default_rng(200 + TYPES.index(kind))
    k, n = 512, 24
    raw = random_blocks(kind, n, k, rng)
    x = rng.standard_normal((1, 11, k)).astype(np.float32)
    x[0, 2, :256] = 0.0  # an all-zero activation block inside a tile
    for isa in isas:
        monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
        batched = run_op(library, kind, x, raw)
        alone = np.concatenate([run_op(library, kind, x[:, i:i + 1], raw) for i in range(11)], axis=1)
        shifted = run_op(library, kind, x[:, 1:10], raw)  # every row at another place in its tile
        assert np.array_equal(batched.view(np.uint32), alone.view(np.uint32)), f"{kind} {isa}: batch of 11 vs one by one"
        assert np.array_equal(batched[:, 1:10].view(np.uint32), shifted.view(np.uint32)), f"{kind} {isa}: rows 1-9"



def test_mxfp4_odd_block_count_is_batch_invariant_and_equal_across_x86_paths(library, isas, monkeypatch):
    """MXFP4's AVX-512 kernel takes two blocks per register (an odd last block alone) and keeps the
    AVX2 kernel's even/odd chains lane for lane: an odd block count (17) is batch-invariant on
    every ISA, within rounding of the quantized product, and the AVX-512 path equals AVX2 bit for bit."""
    rng = np.random.default_rng(417)
    k, n = 17 * 32, 24
    raw = random_blocks("MXFP4", n, k, rng)
    x = rng.standard_normal((1, 11, k)).astype(np.float32)
    x[0, 3, -32:] = 0.0  # the lone last block all zero in one row
    outputs = {}
    for isa in isas:
        monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
        batched = run_op(library, "MXFP4", x, raw)
        alone = np.concatenate([run_op(library, "MXFP4", x[:, i:i + 1], raw) for i in range(11)], axis=1)
        assert np.array_equal(batched.view(np.uint32), alone.view(np.uint32)), f"MXFP4 {isa}: batch of 11 vs one by one"
        check_product(batched, x, dequantized(raw, "MXFP4", k), "MXFP4")
        outputs[isa] = batched
    if "avx512vnni" in outputs:
        assert np.array_equal(outputs["avx512vnni"].view(np.uint32), outputs["avx2"].view(np.uint32))

def test_two_threads_give_the_same_bits(library):
    rng = np.random.default_rng(7)
    k, n = 1024, 300
    raw = random_blocks("Q4_K", n, k, rng)
    x = rng.standard_normal((1, 6, k)).astype(np.float32)
    assert np.array_equal(run_op(library, "Q4_K", x, raw, threads=1), run_op(library, "Q4_K", x, raw, threads=2))


def test_real_qwen_tensors(library):
    """One real tensor per type of the 0.5B Qwen file (Q5_0, Q8_0, Q4_K, Q6_K), rows as stored."""
    if missing := missing_reference("qwen05"):
        pytest.fail(missing)
    reader = gguf.GGUFReader(reference_gguf("qwen05"))
    seen = set()
    rng = np.random.default_rng(11)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in TYPES or kind in seen:
            continue
        seen.add(kind)
        k = int(tensor.shape[0])
        raw = np.ascontiguousarray(tensor.data[:256])  # first 256 output rows
        x = rng.standard_normal((1, 3, k)).astype(np.float32)
        check_product(run_op(library, kind, x, raw), x, dequantized(raw, kind, k), kind)
    assert seen == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_bad_input_says_what_is_wrong(library, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 1, 512)).astype(np.float32)
    with pytest.raises(Exception, match=r"weight rows have 144 bytes, type 12 with K=512 needs 288 \(2 blocks of 144\)"):
        run_op(library, "Q4_K", x, random_blocks("Q4_K", 8, 256, rng))
    with pytest.raises(Exception, match="K=100 is not a positive multiple of type 2's 32-value blocks"):
        run_op(library, "Q4_0", x[..., :100], random_blocks("Q4_0", 8, 128, rng))
    with pytest.raises(Exception, match="GGML type 1 is not supported"):
        run_op(library, 1, x, random_blocks("Q4_0", 8, 512, rng))
    monkeypatch.setenv("EDGEPIPE_GGUF_ISA", "sse9")
    with pytest.raises(Exception, match="EDGEPIPE_GGUF_ISA=sse9: not one of portable, avx2, avx512vnni"):
        run_op(library, "Q4_0", x, random_blocks("Q4_0", 8, 512, rng))


def test_library_absent_or_unbuildable_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEPIPE_NATIVE_CACHE", str(tmp_path))
    with pytest.raises(BuildError, match="does not run"):
        build_library(compiler=str(tmp_path / "no-such-cc"))
    try:
        monkeypatch.setenv("EDGEPIPE_NATIVE", "0")
        reset_for_tests()
        assert gguf_kernel_library() is None and native_library().reason == "turned off by EDGEPIPE_NATIVE=0"
        monkeypatch.setenv("EDGEPIPE_NATIVE", "1")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        reset_for_tests()
        assert gguf_kernel_library() is None and "does not run" in native_library().reason
        monkeypatch.delenv("CC")
        reset_for_tests()
        built = gguf_kernel_library()  # a fresh cache dir: built here, from source
        assert built is not None and built.is_relative_to(tmp_path)
    finally:
        reset_for_tests()


@pytest.mark.parametrize("kind", TYPES)
def test_gather_dequantizes_rows_exactly(kind, library):
    """GgufGather's rows equal gguf's dequantize bit for bit (up to the sign of zero)."""
    rng = np.random.default_rng(100 + TYPES.index(kind))
    k, rows = 512, 30
    raw = random_blocks(kind, rows, k, rng)
    node = helper.make_node(GATHER_OP, ["table", "ids"], ["y"], domain=DOMAIN, qtype=int(gguf.GGMLQuantizationType[kind]))
    graph = helper.make_graph([node], "gather", [helper.make_tensor_value_info("table", TensorProto.UINT8, ["rows", "bytes"]),
                                                 helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", k])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ids = np.array([[0, 29, 7, 7, 13]], np.int64)
    y = session.run(None, {"table": raw, "ids": ids})[0]
    expected = dequantized(raw, kind, k)[ids] + np.float32(0)
    assert y.shape == (1, 5, k) and np.array_equal((y + np.float32(0)).view(np.uint32), expected.view(np.uint32))
    with pytest.raises(Exception, match="GgufGather: id 30 is outside the table's 30 rows"):
        session.run(None, {"table": raw, "ids": np.array([[30]], np.int64)})
