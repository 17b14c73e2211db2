"""GGUF blocks kept exactly: our decode of every supported type equals gguf's ``dequantize``.

"Bit for bit" up to the sign of zero: where gguf computes ``s * 0 - 0`` with a negative
scale it gets -0.0 and we get +0.0 (equal as numbers, and in every matmul). Real tensors come
from the bundled SmolLM2 file and, when present, the 0.5B Qwen and Gemma files (rows sampled
across each tensor); random blocks are made with ``gguf.quants.quantize`` where gguf has a
quantizer and as random bytes (with finite scales) for the k-quants.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgepipe.model.gguf_source import GGUFSource, UnsupportedTensorType
from edgepipe.model.store import bundled_gguf, missing_reference, reference_gguf
from edgepipe.model.weights import FLOAT_TYPES, NATIVE_TYPES, BlockQuantized, decode_float, decode_native

REAL_FILES = {"smollm2": None, "qwen05": "qwen05", "gemma270m": "gemma270m"}


def same_values(ours: np.ndarray, ref: np.ndarray) -> bool:
    """Identical float32 bit patterns once -0.0 is folded into +0.0."""
    a, b = np.asarray(ours, np.float32) + np.float32(0), np.asarray(ref, np.float32) + np.float32(0)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def reference(raw: np.ndarray, kind: str, k: int) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(-1, k)


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid raw GGUF rows ``[n, row_bytes]``: quantized by gguf where it can, else random bytes."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "BF16"):
        w = (rng.standard_normal((n, k)) * rng.uniform(0.001, 1.0, (n, 1))).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block (d == 0)
        return gguf.quants.quantize(w, qtype).reshape(n, -1)
    if kind == "F16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8).reshape(n, -1)
    if kind == "F32":
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8).reshape(n, -1)
    t = NATIVE_TYPES[kind]
    raw = rng.integers(0, 256, (n, k // t.block_elems, t.block_bytes), dtype=np.uint8)
    scales = lambda: (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)  # noqa: E731
    if kind == "Q6_K":
        raw[..., 208:210] = scales()
    else:
        raw[..., 0:2], raw[..., 2:4] = scales(), scales()
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", list(FLOAT_TYPES) + list(NATIVE_TYPES))
def test_random_blocks_decode_exactly(kind):
    rng = np.random.default_rng(sum(map(ord, kind)))
    n, k = 24, 1024
    raw = random_blocks(kind, n, k, rng)
    ours = decode_float(raw, kind, k) if kind in FLOAT_TYPES else decode_native(raw, kind, k).dequantize()
    assert same_values(ours, reference(raw, kind, k))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q5_K"])
def test_offset_not_exact_in_float32_falls_back_to_zero_point_zero(kind):
    """A block whose shifted minimum ``m + z * d`` needs more than float32's 24 bits."""
    rng = np.random.default_rng(1)
    raw = random_blocks(kind, 2, 256, rng)
    t = NATIVE_TYPES[kind]
    blocks = raw.reshape(2, -1, t.block_bytes)
    blocks[0, 0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # huge d ...
    blocks[0, 0, 2:4] = np.array([1e-7], np.float16).view(np.uint8)  # ... tiny minimum
    bq = decode_native(raw, kind, 256)
    assert bq.zero_points is not None and bq.has_integer_zeros
    assert same_values(bq.dequantize(), reference(raw, kind, 256))


def test_layouts_need_no_zero_points_and_have_offsets_only_where_the_type_does():
    rng = np.random.default_rng(2)
    for kind, t in NATIVE_TYPES.items():
        bq = decode_native(random_blocks(kind, 4, 256, rng), kind, 256)
        assert (bq.bits, bq.block_size) == (t.bits, t.block_size)
        assert (bq.offsets is not None) == t.has_offset
        assert int(bq.q.max()) < 2**bq.bits


def _sampled_rows(src: GGUFSource, name: str, count: int = 6) -> list[tuple[int, int]]:
    rows = src.tensor(name).rows
    starts = sorted({0, rows - 1, *np.linspace(0, rows - 1, count).astype(int).tolist()})
    return [(s, min(s + 2, rows)) for s in starts]


@pytest.mark.parametrize("alias", REAL_FILES.values(), ids=REAL_FILES.keys())
def test_real_tensors_decode_exactly(alias):
    if alias and (missing := missing_reference(alias)):
        pytest.fail(missing)
    path = reference_gguf(alias) if alias else bundled_gguf()
    src = GGUFSource(path)
    seen: set[str] = set()
    for name, t in src._tensors.items():  # one tensor per type, plus both ends of the model
        if t.kind in seen and name not in ("token_embd.weight", "output.weight"):
            continue
        seen.add(t.kind)
        for a, b in _sampled_rows(src, name):
            raw = src.raw_rows(name, a, b)
            ours = src.rows(name, a, b)
            ours = ours.dequantize() if isinstance(ours, BlockQuantized) else ours
            assert same_values(ours, reference(raw, t.kind, t.shape[-1])), f"{path.name}:{name} rows {a}..{b} ({t.kind})"
    assert seen & set(NATIVE_TYPES)


def test_writer_round_trip_every_type(tmp_path):
    """A GGUF written by gguf's writer with one tensor per type reads back exactly."""
    rng = np.random.default_rng(3)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    raws = {}
    for kind in list(FLOAT_TYPES) + list(NATIVE_TYPES):
        raw = random_blocks(kind, 8, 512, rng)
        raws[kind] = raw
        dtype = {"F32": np.float32, "F16": np.float16}.get(kind)
        data = raw.view(dtype).reshape(8, 512) if dtype else raw
        w.add_tensor(f"t.{kind}", data, raw_dtype=None if dtype else gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from edgepipe.model.gguf_source import read_gguf_header

    _, tensors = read_gguf_header(path)
    for kind, raw in raws.items():
        t = tensors[f"t.{kind}"]
        assert (t.kind, t.shape) == (kind, (8, 512))
        with open(path, "rb") as f:
            f.seek(t.offset)
            assert f.read(t.nbytes) == raw.tobytes()


def test_unsupported_type_is_refused_from_the_header_naming_the_tensor(tmp_path):
    from edgepipe.model.gguf_source import TensorEntry, refuse_unsupported_types

    tensors = {"blk.0.ffn_up.weight": TensorEntry("blk.0.ffn_up.weight", "IQ2_XXS", (64, 256), 0, 0),
               "blk.1.ffn_up.weight": TensorEntry("blk.1.ffn_up.weight", "IQ2_XXS", (64, 256), 0, 0)}
    with pytest.raises(UnsupportedTensorType) as err:
        refuse_unsupported_types(Path("m.gguf"), tensors)
    msg = str(err.value)
    assert "blk.0.ffn_up.weight" in msg and "IQ2_XXS" in msg and "\n" not in msg


def _unpack4(packed: np.ndarray, n: int, cols: int) -> np.ndarray:
    """Inverse of the 4-bit packing: element 2i in the low nibble, 2i+1 in the high one."""
    packed = packed.reshape(n, -1)
    out = np.empty((n, packed.shape[1] * 2), np.uint8)
    out[:, 0::2], out[:, 1::2] = packed & 0x0F, packed >> 4
    return out[:, :cols]


def test_streamed_import_of_a_tensor_in_chunks_is_exact(tmp_path, monkeypatch):
    """Rows converted a few at a time, with a block that needs explicit zero points in a later
    chunk and a fused second tensor: the blobs still dequantize to gguf's values."""
    import edgepipe.model.importer as importer

    rng = np.random.default_rng(5)
    n, k = 10, 256
    first, second = random_blocks("Q4_1", n, k, rng), random_blocks("Q4_1", 4, k, rng)
    blocks = first.reshape(n, -1, 20)
    blocks[7, 3, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # an offset m + 8d that float32 cannot hold
    blocks[7, 3, 2:4] = np.array([1e-7], np.float16).view(np.uint8)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a.weight", first, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("b.weight", second, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    class Source(GGUFSource):
        def __init__(self, p):  # tensors only: no architecture to check
            from edgepipe.model.gguf_source import read_gguf_header

            self.path, self._file = p, None
            self._meta, self._tensors = read_gguf_header(p)

    monkeypatch.setattr(importer, "CHUNK_WEIGHTS", 3 * k)  # three rows at a time
    writer = importer._BlobWriter(tmp_path / "blobs")
    stored = importer._native_linear(Source(path), ["a.weight", "b.weight"], writer, importer._ReadMeter(lambda *_: None, 1))
    rows, nb = n + 4, k // 32
    assert stored.shape == (rows, k) and stored.zero_points is not None
    blob = lambda s: np.fromfile(tmp_path / "blobs" / s.sha, np.uint8)  # noqa: E731
    q = _unpack4(blob(stored.packed), rows, k)
    scales = blob(stored.scales).view(np.float32).reshape(rows, nb)
    zeros = _unpack4(blob(stored.zero_points), rows, nb).astype(np.float32)
    ours = BlockQuantized(4, 32, q, scales, zeros, stored.offsets).dequantize()
    ref = np.concatenate([reference(first, "Q4_1", k), reference(second, "Q4_1", k)])
    assert same_values(ours, ref)
    assert set(zeros[:6].ravel()) == {8.0} and set(zeros[6:9].ravel()) == {0.0}  # default before the fallback chunk
