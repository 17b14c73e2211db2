"""Q4_K on Intel AMX tiles (gguf_amx.c): products of 16 rows or more take the tiles where the CPU and
Linux allow it (ISA `avx512vnni+amx`), and give the bits of the one-row (decode) path and of the AVX
tiles, whatever the row count; forcing avx512vnni or avx2 gives those same bits.

Calls the library's direct entry point (`edgepipe_gguf_matmul`, one thread) and the ONNX Runtime op
(one and two threads). The AMX tests skip where the CPU has no AMX; the cross-ISA ones run on every
AVX2 machine.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from test_gguf_kernel import check_product, dequantized, random_blocks, run_op

Q4_K = 12
AMX = "avx512vnni+amx"


@pytest.fixture(scope="module")
def lib(library):
    handle = ctypes.CDLL(library)
    handle.edgepipe_gguf_best_isa.restype = ctypes.c_char_p
    handle.edgepipe_gguf_matmul.restype = ctypes.c_char_p
    handle.edgepipe_gguf_matmul.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return handle


@pytest.fixture(scope="module")
def library():
    from edgepipe.native import gguf_kernel_library, native_library
    path = gguf_kernel_library()
    assert path is not None, native_library().reason
    return str(path)


def best(lib) -> str:
    return lib.edgepipe_gguf_best_isa().decode()


def has_amx_cpu() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "amx_tile" in flags and "amx_int8" in flags


def matmul(lib, isa: str, x: np.ndarray, raw: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    raw = np.ascontiguousarray(raw)
    m, k = x.shape
    y = np.zeros((m, raw.shape[0]), np.float32)
    error = lib.edgepipe_gguf_matmul(Q4_K, isa.encode(), x.ctypes.data, m, k, raw.ctypes.data, raw.shape[0], raw.shape[1],
                                     y.ctypes.data)
    assert error is None, error.decode()
    return y


def bits(y: np.ndarray) -> np.ndarray:
    return y.view(np.uint32)


def one_by_one(lib, isa: str, x: np.ndarray, raw: np.ndarray) -> np.ndarray:
    return np.concatenate([matmul(lib, isa, x[i:i + 1], raw) for i in range(len(x))])


@pytest.fixture
def amx(lib):
    if best(lib) != AMX:
        if has_amx_cpu():  # the CPU has it: then the library must have found it (or the kernel refused: say so)
            pytest.fail(f"the CPU reports AMX but the library picked {best(lib)} (no -mamx-int8, or Linux refused tile state)")
        pytest.skip("no AMX on this CPU")
    return AMX


def real_shaped(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Q4_K rows shaped like a quantizer's: scales and minimums up to 63 (so scale x code passes 255),
    fp16 d, dmin around 1e-3."""
    raw = random_blocks("Q4_K", n, k, rng).reshape(n, k // 256, 144)
    halves = (np.abs(rng.standard_normal((n, k // 256, 2))) * 2e-3).astype(np.float16)
    raw[:, :, 0:4] = halves.view(np.uint8).reshape(n, k // 256, 4)
    raw[:, 0, 4:16] = 0xFF  # a block with every scale and minimum 63
    return raw.reshape(n, -1)


@pytest.mark.parametrize("k", [1536, 8960])
def test_amx_gives_the_one_row_bits_at_every_row_count(lib, amx, k):
    """Rows 1..100 (16-row groups and padded partial ones) on AMX equal each row run alone (the
    decode path, AVX) bit for bit, on random and quantizer-shaped blocks, at both real K."""
    rng = np.random.default_rng(k)
    n = 48 + 16 * (k == 1536)
    for raw in (random_blocks("Q4_K", n, k, rng), real_shaped(rng, n, k)):
        x = rng.standard_normal((100, k)).astype(np.float32)
        x[7, :256] = 0.0  # an all-zero activation block
        x[40] *= 1e3  # a row at another scale
        alone = one_by_one(lib, amx, x, raw)
        assert np.array_equal(bits(alone), bits(one_by_one(lib, "avx512vnni", x, raw)))  # rows = 1 never uses the tiles
        for m in (1, 15, 16, 17, 31, 32, 33, 47, 64, 100):
            got = matmul(lib, amx, x[:m], raw)
            assert np.array_equal(bits(got), bits(alone[:m])), f"K={k}, {m} rows: AMX differs from the one-row path"
        check_product(got[None], x[None], dequantized(raw, "Q4_K", k), "Q4_K")


def test_amx_and_the_avx_tiles_agree_on_every_weight_row_count(lib, amx):
    """Weight row counts that are not whole groups of 16 (AMX for the groups, the AVX tiles for the rest)."""
    rng = np.random.default_rng(5)
    k = 512
    x = rng.standard_normal((37, k)).astype(np.float32)
    for n in (16, 17, 31, 40, 64, 65, 130):
        raw = real_shaped(rng, n, k)
        expected = matmul(lib, "avx512vnni", x, raw)
        assert np.array_equal(bits(matmul(lib, amx, x, raw)), bits(expected)), f"{n} weight rows"
        assert np.array_equal(bits(expected), bits(one_by_one(lib, "avx512vnni", x, raw)))


def test_amx_through_the_op_with_one_and_two_threads(library, lib, amx, monkeypatch):
    """The ONNX Runtime op (thread pool splitting weight rows, activations packed in tasks) on AMX:
    the bits of rows run one at a time, with one thread and with two."""
    rng = np.random.default_rng(9)
    k, n = 1536, 256 + 16 + 5
    raw = real_shaped(rng, n, k)
    x = rng.standard_normal((1, 70, k)).astype(np.float32)
    monkeypatch.setenv("EDGEPIPE_GGUF_ISA", amx)
    one = run_op(library, "Q4_K", x, raw, threads=1)
    two = run_op(library, "Q4_K", x, raw, threads=2)
    alone = one_by_one(lib, "avx512vnni", x[0], raw)
    assert np.array_equal(bits(one[0]), bits(alone)) and np.array_equal(bits(two[0]), bits(alone))


def test_forcing_a_lower_isa_gives_the_same_bits(library, lib, monkeypatch):
    """EDGEPIPE_GGUF_ISA=avx512vnni or avx2 (AMX off) gives the bits of the best ISA, with many rows
    (tiles of 8, and AMX where there is one) and with one."""
    ladder = [isa for isa in ("avx2", "avx512vnni", AMX) if isa == best(lib) or isa in ("avx2", "avx512vnni")]
    if best(lib) not in ladder:
        pytest.skip("no AVX2 here")
    ladder = ladder[: ladder.index(best(lib)) + 1]
    rng = np.random.default_rng(21)
    k, n = 1536, 64
    raw = real_shaped(rng, n, k)
    x = rng.standard_normal((1, 40, k)).astype(np.float32)
    outputs = {}
    for isa in ladder:
        monkeypatch.setenv("EDGEPIPE_GGUF_ISA", isa)
        outputs[isa] = (run_op(library, "Q4_K", x, raw), run_op(library, "Q4_K", x[:, :1], raw))
    first = ladder[0]
    for isa, (many, one) in outputs.items():
        assert np.array_equal(bits(many), bits(outputs[first][0])), f"{isa} vs {first}, 40 rows"
        assert np.array_equal(bits(one), bits(outputs[first][1])), f"{isa} vs {first}, 1 row"
        assert np.array_equal(bits(one[0, 0]), bits(many[0, 0]))


def test_the_amx_isa_is_reported_and_refused_where_absent(lib, monkeypatch, library):
    """The library names AMX in its ISA (edgepipe_gguf_best_isa); asking for it where it is absent is an error."""
    if has_amx_cpu():
        assert best(lib) == AMX
    else:
        assert best(lib) != AMX
        monkeypatch.setenv("EDGEPIPE_GGUF_ISA", AMX)
        x = np.zeros((1, 1, 256), np.float32)
        with pytest.raises(Exception, match=r"EDGEPIPE_GGUF_ISA=avx512vnni\+amx: this CPU or build supports up to"):
            run_op(library, "Q4_K", x, random_blocks("Q4_K", 16, 256, np.random.default_rng(0)))
