"""The native GGUF kernel library: its path once built and loadable, or the one-line reason why not.

`gguf_kernel_library()` builds the library on first use (see `build.py`), checks that it loads
and exports ONNX Runtime's registration entry, and remembers the answer for the process. A
session that runs `edgepipe.gguf` ops registers it with
`SessionOptions.register_custom_ops_library(path)`. Setting `EDGEPIPE_NATIVE=0` turns the library
off (the fallback path, on purpose).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

# The two forms of the file's own model: its blocks run by this library, or as MatMulNBits graphs
# (every worker without the library: no compiler, a GPU, a browser). Defined once, read everywhere.
KERNEL_FORM, FALLBACK_FORM = "gguf", "native"
DOMAIN = "edgepipe.gguf"
MATMUL_OP = "GgufMatMul"
GATHER_OP = "GgufGather"  # rows of a raw-block table, dequantized exactly (embeddings)
ATTENTION_OP = "KvAttention"  # attention over an fp16 KV cache (the kernel form's layers)
MOE_OP = "GgufMoEMatMul"  # one projection of a mixture of experts on its 3-D blocks, rows grouped by expert (model/moe.py)
# GGML type ids of the block types GgufMatMul runs (its `qtype` attribute), and whether it runs a
# type: both read the one type table (quant_types.py).
from .quant_types import GGML_TYPE_IDS, kernel_handles  # noqa: E402,F401 - re-exported for the graph builders


@dataclass(frozen=True)
class NativeLibrary:
    path: Path | None
    reason: str | None  # why `path` is None; None when the library is there


_lock = threading.Lock()
_cached: NativeLibrary | None = None


def _locate() -> NativeLibrary:
    if os.environ.get("EDGEPIPE_NATIVE", "1") == "0":
        return NativeLibrary(None, "turned off by EDGEPIPE_NATIVE=0")
    from edgepipe.native.build import BuildError, build_library  # here: `python -m ...build` imports this package first

    try:
        path = build_library()
    except BuildError as error:
        return NativeLibrary(None, str(error))
    try:
        handle = ctypes.CDLL(str(path))
        handle.RegisterCustomOps  # noqa: B018 - the attribute lookup is the check
    except (OSError, AttributeError) as error:
        return NativeLibrary(None, f"{path.name} does not load: {error}")
    return NativeLibrary(path, None)


def native_library() -> NativeLibrary:
    """The library, built and load-checked once per process."""
    global _cached
    with _lock:
        if _cached is None:
            _cached = _locate()
        return _cached


def gguf_kernel_library() -> Path | None:
    """Path of the custom-op library, or None (see `gguf_kernel_unavailable_reason`)."""
    return native_library().path


def gguf_kernel_unavailable_reason() -> str | None:
    """One line saying why there is no library, or None when there is one."""
    return native_library().reason


def reset_for_tests() -> None:
    """Forget the cached answer (tests that change EDGEPIPE_NATIVE or $CC)."""
    global _cached
    with _lock:
        _cached = None


def graph_needs_gguf_kernel(graph_path: str | Path) -> bool:
    """Whether an ONNX graph file uses the `edgepipe.gguf` domain (weights are external, so the
    file is small; a worker has no `onnx` package to parse it with)."""
    return DOMAIN.encode() in Path(graph_path).read_bytes()


def register_gguf_kernel(options, graph_path: str | Path) -> None:
    """Register the library with ONNX Runtime `options` when the graph needs it; raises
    RuntimeError with the one-line reason when it needs it and there is none."""
    if not graph_needs_gguf_kernel(graph_path):
        return
    library = native_library()
    if library.path is None:
        raise RuntimeError(f"{Path(graph_path).name} uses {DOMAIN} ops but the GGUF kernel library is unavailable: {library.reason}")
    options.register_custom_ops_library(str(library.path))
