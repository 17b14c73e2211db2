"""Q4_K products of many rows on AVX-512 VNNI with the lanes over weight rows (gguf_vnni_wide.c): the
prefill path where there is no AMX (AMD EPYC, Intel before Sapphire Rapids) and for 12-15 rows where
there is. It must give the bits of the one-row (decode) path and of the AVX2 tiles at every row count,
weight row count and thread count.

Calls the library's direct entry point (one thread) and the ONNX Runtime op (one and two threads);
`edgepipe_gguf_product_path` says which path a product takes, so each test checks it ran where it
meant to. Skips where the CPU has no AVX-512 VNNI.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from test_gguf_amx import bits, lib, library, matmul, one_by_one, real_shaped  # noqa: F401 (fixtures)
from test_gguf_kernel import check_product, dequantized, random_blocks, run_op

Q4_K = 12
Q6_K = 14
WIDE = "avx512vnni"


@pytest.fixture(scope="module")
def wide(lib):
    lib.edgepipe_gguf_product_path.restype = ctypes.c_char_p
    lib.edgepipe_gguf_product_path.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int64]
    if lib.edgepipe_gguf_product_path(Q4_K, WIDE.encode(), 64) is None:
        pytest.skip("no AVX-512 VNNI on this CPU")
    return WIDE


def path(lib, qtype: int, isa: str, m: int) -> str:
    return lib.edgepipe_gguf_product_path(qtype, isa.encode(), m).decode()


def test_the_path_follows_the_row_count(lib, wide):
    """Tiles below 12 rows, the wide kernel from 12; AMX (where there is one) from 16; other types and AVX2 never."""
    assert [path(lib, Q4_K, wide, m) for m in (1, 8, 11, 12, 16, 512)] == ["tiles"] * 3 + ["wide"] * 3
    assert path(lib, Q6_K, wide, 512) == "tiles"
    assert path(lib, Q4_K, "avx2", 512) == "tiles"
    if lib.edgepipe_gguf_product_path(Q4_K, b"avx512vnni+amx", 16) is not None:
        assert [path(lib, Q4_K, "avx512vnni+amx", m) for m in (11, 12, 15, 16)] == ["tiles", "wide", "wide", "amx"]


@pytest.mark.parametrize("k", [1536, 8960])
def test_wide_gives_the_one_row_bits_at_every_row_count(lib, wide, k):
    """Rows 12..100 (groups of 4 and partial ones) equal each row run alone (the decode path) and the
    AVX2 tiles bit for bit, on random and quantizer-shaped blocks (scales and minimums up to 63), at
    both real K, with an all-zero activation block and a row at another scale."""
    rng = np.random.default_rng(k + 1)
    n = 48 + 16 * (k == 1536)
    for raw in (random_blocks("Q4_K", n, k, rng), real_shaped(rng, n, k)):
        x = rng.standard_normal((100, k)).astype(np.float32)
        x[13, :256] = 0.0
        x[41] *= 1e3
        alone = one_by_one(lib, wide, x, raw)
        for m in (12, 13, 14, 15, 16, 17, 31, 64, 100):
            got = matmul(lib, wide, x[:m], raw)
            assert np.array_equal(bits(got), bits(alone[:m])), f"K={k}, {m} rows: the wide kernel differs from the one-row path"
        assert np.array_equal(bits(got), bits(matmul(lib, "avx2", x, raw)))
        check_product(got[None], x[None], dequantized(raw, "Q4_K", k), "Q4_K")


def test_weight_rows_that_are_not_whole_groups_of_16(lib, wide):
    """The wide kernel takes whole groups of 16 weight rows; the rest runs on the tiles, same bits."""
    rng = np.random.default_rng(6)
    k = 512
    x = rng.standard_normal((37, k)).astype(np.float32)
    for n in (15, 16, 17, 31, 40, 64, 65, 130):
        raw = real_shaped(rng, n, k)
        assert np.array_equal(bits(matmul(lib, wide, x, raw)), bits(one_by_one(lib, wide, x, raw))), f"{n} weight rows"


def test_wide_through_the_op_with_one_and_two_threads(library, lib, wide, monkeypatch):
    """The ONNX Runtime op (weight rows split over the pool in whole groups of 16): the bits of rows run one at a time."""
    rng = np.random.default_rng(10)
    k, n = 1536, 256 + 16 + 5
    raw = real_shaped(rng, n, k)
    x = rng.standard_normal((1, 70, k)).astype(np.float32)
    monkeypatch.setenv("EDGEPIPE_GGUF_ISA", wide)
    one = run_op(library, "Q4_K", x, raw, threads=1)
    two = run_op(library, "Q4_K", x, raw, threads=2)
    alone = one_by_one(lib, wide, x[0], raw)
    assert np.array_equal(bits(one[0]), bits(alone)) and np.array_equal(bits(two[0]), bits(alone))
