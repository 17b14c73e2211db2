"""Weight tensors as the importer hands them to the graph builder.

A linear layer's weight is either a float matrix ``[N, K]`` (out, in) or a block-quantized
matrix already laid out for ONNX Runtime's ``MatMulNBits``. The quantizer here is plain numpy
(asymmetric, per block along K), so import needs neither torch nor ORT's quantization tools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Precision = str  # "fp32" | "int8" | "int4"
PRECISIONS: tuple[str, ...] = ("int4", "int8", "fp32")


@dataclass(frozen=True)
class BlockQuantized:
    """``W[n, k] = (q[n, k] - zero[n, k // block]) * scale[n, k // block]``."""

    bits: int  # 4 or 8
    block_size: int
    q: np.ndarray  # [N, K] uint8, values in [0, 2**bits)
    scales: np.ndarray  # [N, K // block] float32
    zero_points: np.ndarray | None  # [N, K // block] float32, or None for the default 2**(bits-1)

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
        zero = np.broadcast_to(zero, self.scales.shape)
        return ((blocks - zero[..., None]) * self.scales[..., None]).reshape(n, k)


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
    if isinstance(w, BlockQuantized) and w.bits == bits and w.has_integer_zeros:
        return w
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
    zeros = None
    if any(p.zero_points is not None for p in parts):  # mixed: spell out the default zero point
        default = np.float32(2 ** (first.bits - 1))
        zeros = np.concatenate([p.zero_points if p.zero_points is not None else np.full_like(p.scales, default) for p in parts])
    return BlockQuantized(
        first.bits, first.block_size, np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]), zeros
    )


def quantize_symmetric8(w: np.ndarray, block_size: int = 32) -> BlockQuantized:
    """Symmetric 8-bit blocks (zero point 128): the layout GatherBlockQuantized reads."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // block_size, block_size)
    scale = np.abs(blocks).max(axis=2) / 127.0
    scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
    q = np.clip(np.round(blocks / scale[..., None]), -127, 127).astype(np.int16) + 128
    return BlockQuantized(8, block_size, q.astype(np.uint8).reshape(n, k), scale, None)
