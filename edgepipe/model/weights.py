"""Weight tensors as the importer hands them to the graph builder.

A linear layer's weight is either a float matrix ``[N, K]`` (out, in) or a block-quantized
matrix already laid out for ONNX Runtime's ``MatMulNBits``. ``decode_native`` turns GGUF's own
blocks into that layout without changing a value (see ``NATIVE_TYPES``); the quantizer below is
plain numpy (asymmetric, per block along K), used only when a package is asked to re-quantize.

Exactness of the native decode: every GGUF block value is ``s * q + c`` with ``s * q`` exact in
float32 (at most 22 significant bits), so one float32 rounding of ``s * q + c`` is all gguf's
``dequantize`` does. We store ``u = q + shift`` so that ``u - zero`` (MatMulNBits' default zero
point ``2**(bits-1)``) equals ``q - z`` for a small integer ``z``, and the per-block offset
``c + z * s``; when that offset is exact in float32 (checked, and true for every block of the real
files we tried) ``(u - zero) * s + offset`` rounds the same real number once: bit for bit equal.
A tensor with an inexact block instead keeps explicit zero points ``z = 0`` and offset ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Precision = str  # "native" | "fp32" | "int8" | "int4" | "gguf"
# "native" keeps the file's own blocks; the others re-quantize (or dequantize) every linear.
# "gguf" keeps the file's bytes as stored, for the edgepipe.gguf kernel library (edgepipe.native).
PRECISIONS: tuple[str, ...] = ("native", "int4", "int8", "fp32", "gguf")


@dataclass(frozen=True)
class BlockQuantized:
    """``W[n, k] = (q[n, k] - zero[n, k // block]) * scale[n, k // block] (+ offset[n, k // block])``.

    The offset (GGUF's block minimum, shifted) runs as a second, small matmul:
    ``x @ W.T = MatMulNBits(x) + BlockSum(x) @ offset.T`` with ``BlockSum`` summing each block of x.
    """

    bits: int  # 4 or 8
    block_size: int
    q: np.ndarray  # [N, K] uint8, values in [0, 2**bits)
    scales: np.ndarray  # [N, K // block] float32
    zero_points: np.ndarray | None  # [N, K // block] float32, or None for the default 2**(bits-1)
    offsets: np.ndarray | None = None  # [N, K // block] float32, added after scaling

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def packed(self) -> np.ndarray:
        """``[N, K // block, block * bits // 8]`` uint8, the MatMulNBits ``B`` layout."""
        n, k = self.q.shape
        q = self.q
        if self.bits == 4:
            q = q[:, 0::2] | (q[:, 1::2] << 4)  # element 2i in the low nibble
        return np.ascontiguousarray(q.reshape(n, k // self.block_size, -1), dtype=np.uint8)

    @property
    def has_integer_zeros(self) -> bool:
        """MatMulNBits has a fast path only for integer zero points (float ones are ~50x slower)."""
        z = self.zero_points
        return z is None or bool(np.all(z == np.round(z)) and z.min() >= 0 and z.max() < 2**self.bits)

    def packed_zero_points(self) -> np.ndarray:
        """uint8 zero points; 4-bit ones two to a byte per row, ``[N * ceil(blocks / 2)]``."""
        z = np.asarray(self.zero_points, np.float32).astype(np.uint8)
        if self.bits == 8:
            return z.reshape(-1)
        if z.shape[1] % 2:
            z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
        return (z[:, 0::2] | (z[:, 1::2] << 4)).reshape(-1)

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        blocks = self.q.reshape(n, k // self.block_size, self.block_size).astype(np.float32)
        zero = self.zero_points if self.zero_points is not None else np.float32(2 ** (self.bits - 1))
        zero = np.broadcast_to(np.asarray(zero, np.float32), self.scales.shape)
        values = (blocks - zero[..., None]) * self.scales[..., None]
        if self.offsets is not None:
            values = values + self.offsets[..., None]
        return values.reshape(n, k)


Weight = np.ndarray | BlockQuantized


def quantize_blocks(w: np.ndarray, bits: int, block_size: int = 32) -> BlockQuantized:
    """Asymmetric min/max quantization per block of ``block_size`` along the input axis."""
    n, k = w.shape
    if k % block_size:
        raise ValueError(f"input width {k} is not a multiple of the block size {block_size}")
    levels = 2**bits - 1
    blocks = w.astype(np.float32).reshape(n, k // block_size, block_size)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scale = (hi - lo) / levels
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, levels)
    q = np.clip(np.round(blocks / scale[..., None] + zero[..., None]), 0, levels).astype(np.uint8)
    return BlockQuantized(bits, block_size, q.reshape(n, k), scale, zero.astype(np.float32))


def to_precision(w: Weight, precision: Precision) -> Weight:
    """Convert a linear weight to the package precision, keeping native blocks where exact."""
    if precision == "fp32":
        return w.dequantize() if isinstance(w, BlockQuantized) else np.asarray(w, np.float32)
    bits = 4 if precision == "int4" else 8
    if isinstance(w, BlockQuantized) and w.bits == bits and w.has_integer_zeros and w.offsets is None:
        return w  # already plain blocks of this width (Q4_0 for int4; Q8_0, Q5_0 for int8): exact
    dense = w.dequantize() if isinstance(w, BlockQuantized) else w
    return quantize_blocks(dense, bits)


def concat_rows(parts: list[Weight]) -> Weight:
    """Stack several linears that read the same input into one (fused QKV, gate+up)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)
    if not all(isinstance(p, BlockQuantized) for p in parts):
        raise TypeError("cannot fuse float and quantized weights")
    first = parts[0]
    if not all(p.bits == first.bits and p.block_size == first.block_size for p in parts):
        raise TypeError("cannot fuse weights with different bit widths or block sizes")
    zeros = offsets = None
    if any(p.zero_points is not None for p in parts):  # mixed: spell out the default zero point
        default = np.float32(2 ** (first.bits - 1))
        zeros = np.concatenate([p.zero_points if p.zero_points is not None else np.full_like(p.scales, default) for p in parts])
    if any(p.offsets is not None for p in parts):
        offsets = np.concatenate([p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in parts])
    return BlockQuantized(
        first.bits, first.block_size, np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]), zeros, offsets
    )


def quantize_symmetric8(w: np.ndarray, block_size: int = 32) -> BlockQuantized:
    """Symmetric 8-bit blocks (zero point 128): the layout GatherBlockQuantized reads."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // block_size, block_size)
    scale = np.abs(blocks).max(axis=2) / 127.0
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.round(blocks / scale[..., None]), -127, 127).astype(np.int16) + 128
    return BlockQuantized(8, block_size, q.astype(np.uint8).reshape(n, k), scale, None)


# -- GGUF's own block types, decoded exactly ---------------------------------------------------

QK_K = 256


@dataclass(frozen=True)
class NativeType:
    """How one GGUF block type maps onto MatMulNBits blocks."""

    block_elems: int  # elements per GGUF block
    block_bytes: int  # bytes per GGUF block
    bits: int  # MatMulNBits bits (4 or 8)
    block_size: int  # MatMulNBits block size
    shift: int  # stored u = q + shift, so that u - 2**(bits-1) = q - z
    has_offset: bool  # the type has a per-block minimum (d * q + m)


NATIVE_TYPES: dict[str, NativeType] = {
    "Q4_0": NativeType(32, 18, 4, 32, 0, False),  # d * (q - 8)
    "Q4_1": NativeType(32, 20, 4, 32, 0, True),  # d * q + m
    "Q5_0": NativeType(32, 22, 8, 32, 112, False),  # d * (q - 16)
    "Q5_1": NativeType(32, 24, 8, 32, 112, True),  # d * q + m
    "Q8_0": NativeType(32, 34, 8, 32, 128, False),  # d * q, q int8
    "Q4_K": NativeType(256, 144, 4, 32, 0, True),  # (d * sc) * q - dmin * mn, 8 sub-blocks of 32
    "Q5_K": NativeType(256, 176, 8, 32, 112, True),  # same with 5-bit q
    "Q6_K": NativeType(256, 210, 8, 16, 96, False),  # (d * sc) * (q - 32), 16 sub-blocks of 16
    "MXFP4": NativeType(32, 17, 8, 32, 128, False),  # 2^(e - 128) * 2 * fp4(q): an E8M0 exponent, 4-bit e2m1 values (gpt-oss's experts)
}
# MXFP4's e2m1 values doubled to integers (ggml's kvalues_mxfp4): a block is 2^(e - 128) times these.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int16)
FLOAT_TYPES = ("F32", "F16", "BF16")


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of ``k`` elements of GGUF type ``kind``."""
    if kind in FLOAT_TYPES:
        return k * (4 if kind == "F32" else 2)
    t = NATIVE_TYPES[kind]
    return k // t.block_elems * t.block_bytes


def decode_float(raw: np.ndarray, kind: str, k: int) -> np.ndarray:
    """F32 / F16 / BF16 rows (raw bytes ``[n, row_bytes]``) as float32 ``[n, k]`` (exact)."""
    raw = np.ascontiguousarray(raw)
    if kind == "F32":
        return raw.view(np.float32).reshape(-1, k)
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(-1, k)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, k)


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """``[..., groups * L]`` bytes -> ``[..., groups * 2 * L]``: per group, low nibbles then high ones."""
    qs = qs.reshape(*qs.shape[:-1], groups, 1, -1)
    out = np.empty(qs.shape[:-2] + (2, qs.shape[-1]), np.uint8)
    np.bitwise_and(qs[..., 0, :], 0x0F, out=out[..., 0, :])
    np.right_shift(qs[..., 0, :], 4, out=out[..., 1, :])
    return out


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit scales and eight 6-bit minima, ``[..., 8]``."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode_native(raw: np.ndarray, kind: str, k: int) -> BlockQuantized:
    """Rows of GGUF blocks (raw bytes ``[n, row_bytes(kind, k)]``) as MatMulNBits blocks.

    ``decode_native(...).dequantize()`` equals ``gguf.quants.dequantize`` of the same bytes bit
    for bit (``tests/test_quant_exact.py``); nothing is re-quantized."""
    t = NATIVE_TYPES[kind]
    if k % t.block_elems:
        raise ValueError(f"a {kind} row holds a multiple of {t.block_elems} weights, not {k}")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, k // t.block_elems, t.block_bytes)
    nb = blocks.shape[1]
    offset64 = None  # per-block c + z * s in float64 before the exactness check
    z = 2 ** (t.bits - 1) - t.shift  # u - 2**(bits-1) = q - z
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(blocks, 0)  # [n, nb]
        if kind == "Q8_0":
            q = blocks[..., 2:34] ^ np.uint8(0x80)  # int8 q + 128, as uint8
        else:
            body = 4 if kind in ("Q4_1", "Q5_1") else 2
            if kind in ("Q5_0", "Q5_1"):
                high = np.unpackbits(blocks[..., body : body + 4], axis=-1, bitorder="little")  # bit j -> element j
                q = _nibbles(blocks[..., body + 4 : body + 20], 1).reshape(n, nb, 32)
                q |= high << 4
            else:
                q = _nibbles(blocks[..., body : body + 16], 1).reshape(n, nb, 32)
            if t.shift:
                q += np.uint8(t.shift)
        scales = d
        if t.has_offset:
            offset64 = _f16(blocks, 2).astype(np.float64) + z * d.astype(np.float64)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = _k_scale_min(blocks[..., 4:16])
        scales = (d[..., None] * sc.astype(np.float32)).reshape(n, nb * 8)  # float32, as gguf rounds it
        dm = (dmin[..., None] * mn.astype(np.float32)).reshape(n, nb * 8)
        if kind == "Q4_K":
            q = _nibbles(blocks[..., 16:144], 4).reshape(n, nb, QK_K)
        else:
            q = _nibbles(blocks[..., 48:176], 4).reshape(n, nb, 8, 32)
            qh = blocks[..., 16:48].reshape(n, nb, 1, 32)
            q |= ((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)) << 4
            q += np.uint8(t.shift)
            q = q.reshape(n, nb, QK_K)
        offset64 = z * scales.astype(np.float64) - dm.astype(np.float64)
        nb = nb * 8
    elif kind == "MXFP4":  # block_mxfp4: e (uint8), then 16 bytes: element j in the low nibble of byte j, j + 16 in its high nibble
        scales = np.ldexp(np.float32(1.0), blocks[..., 0].astype(np.int32) - 128).astype(np.float32)  # ggml_e8m0_to_fp32_half
        q = (_MXFP4_VALUES[_nibbles(blocks[..., 1:17], 1).reshape(n, nb, 32)] + 128).astype(np.uint8)
    elif kind == "Q6_K":
        ql = _nibbles(blocks[..., 0:128], 2).reshape(n, -1, 8, 32)  # [n, nbk, 8, 32]
        qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        qh = (qh & np.uint8(3)).reshape(n, -1, 8, 32)
        ql |= qh << 4
        ql += np.uint8(t.shift)
        q = ql.reshape(n, -1, QK_K)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [n, nbk, 16]
        scales = (_f16(blocks, 208)[..., None] * sc).reshape(n, -1)
        nb = scales.shape[1]
    else:
        raise ValueError(f"GGUF type {kind} has no exact MatMulNBits layout")
    q = np.ascontiguousarray(q, np.uint8).reshape(n, k)
    scales = np.ascontiguousarray(scales, np.float32).reshape(n, nb)
    if offset64 is None:
        return BlockQuantized(t.bits, t.block_size, q, scales, None)
    offset64 = offset64.reshape(n, nb)
    offsets = offset64.astype(np.float32)
    if np.array_equal(offsets.astype(np.float64), offset64):
        return BlockQuantized(t.bits, t.block_size, q, scales, None, offsets)
    # Some block's shifted offset is not a float32: store q itself (zero point z = 0 below it)
    # and the unshifted offset c, which is a float16 or a product of two, so always exact.
    zero = np.float32(2 ** (t.bits - 1) - z)
    unshifted = (offset64 - z * scales.astype(np.float64)).astype(np.float32)
    return BlockQuantized(t.bits, t.block_size, q, scales, np.full((n, nb), zero, np.float32), unshifted)


@dataclass(frozen=True)
class Stored:
    """Bytes already written to the package as one content-addressed blob."""

    sha: str
    nbytes: int


@dataclass(frozen=True)
class StoredBlocks:
    """A :class:`BlockQuantized` whose big arrays the importer streamed straight to blobs.

    ``packed`` holds ``BlockQuantized.packed()`` bytes (the MatMulNBits ``B`` layout, which is also
    GatherBlockQuantized's ``[N, K * bits / 8]`` layout), ``scales`` float32 ``[N, K / block]``,
    ``zero_points`` ``BlockQuantized.packed_zero_points()`` or None for the default. ``offsets``
    stays in memory: it is 1/32 (or 1/16) of the weight count and is transposed for the graph."""

    bits: int
    block_size: int
    shape: tuple[int, int]  # [N, K]
    packed: Stored
    scales: Stored
    zero_points: Stored | None
    offsets: np.ndarray | None  # [N, K // block] float32


@dataclass(frozen=True)
class StoredGGUF:
    """Rows of one GGUF block type, byte for byte as in the file (precision ``gguf``): the
    ``edgepipe.gguf`` GgufMatMul op reads them as stored, so the package is the file's size."""

    kind: str  # a GGUF type the kernel library runs (edgepipe.native.GGML_TYPE_IDS)
    shape: tuple[int, int]  # [N, K]
    raw: Stored  # uint8 [N, row_bytes(kind, K)]


# What graphs.linear accepts: float, in-memory blocks, stored blocks, or row groups to concatenate
# (a fused QKV whose parts have different GGUF types).
LinearWeight = np.ndarray | BlockQuantized | StoredBlocks | StoredGGUF | list
