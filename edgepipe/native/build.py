"""Builds the GGUF custom-op library (`src/`) with the system C compiler.

One shared library per source hash, compiler and machine, cached under the user cache dir
(`~/.cache/edgepipe/native/<key>/` on Linux): `scripts/bootstrap.sh` builds it at install, and
`edgepipe.native` builds it on first use where bootstrap did not. Only the per-ISA translation
units get ISA flags (-mavx2 ...), so the library loads on any CPU of the architecture and picks
its kernels by cpuid at run time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

SOURCE_DIR = Path(__file__).parent / "src"
LIBRARY_NAME = "libedgepipe_gguf.so"
# -ffp-contract=off: no fused a*b+c, so dequantized values equal gguf-py's; an undeclared function is
# an error (a type-table row whose kernel is missing must not build a library that fails to load)
COMMON_FLAGS = ("-O3", "-fPIC", "-fvisibility=hidden", "-std=gnu11", "-Wall", "-ffp-contract=off", "-Werror=implicit-function-declaration")


@dataclass(frozen=True)
class TranslationUnit:
    source: str
    flags: tuple[str, ...] = ()


class BuildError(RuntimeError):
    """The library could not be built; the message is one line saying why."""


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _is_arm64() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


ARM64_UNITS = [  # NEON is baseline on ARMv8-A; the dot-product unit is chosen by HWCAP at run time
    TranslationUnit("gguf_portable.c"),
    TranslationUnit("kv_attention.c"),
    TranslationUnit("kv_attention_neon.c"),
    TranslationUnit("gguf_neon.c"),
    TranslationUnit("gguf_neon_dotprod.c", ("-march=armv8.2-a+dotprod",)),
    TranslationUnit("gguf_op.c", ("-DEDGEPIPE_HAVE_NEON", "-DEDGEPIPE_HAVE_NEON_DOTPROD")),
]


def translation_units() -> list[TranslationUnit]:
    """The sources to compile on this machine, each with its own ISA flags."""
    if _is_arm64():
        return ARM64_UNITS
    if not _is_x86_64():
        return [TranslationUnit("gguf_portable.c"), TranslationUnit("kv_attention.c"), TranslationUnit("gguf_op.c")]
    avx512 = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
    units = [
        TranslationUnit("gguf_portable.c"),
        TranslationUnit("kv_attention.c"),
        TranslationUnit("gguf_avx2.c", ("-mavx2", "-mfma", "-mf16c")),
        TranslationUnit("kv_attention_avx2.c", ("-mavx2", "-mfma", "-mf16c")),
        TranslationUnit("gguf_avx512vnni.c", avx512),
        TranslationUnit("gguf_vnni_wide.c", avx512),
    ]
    op_flags = ("-DEDGEPIPE_HAVE_AVX2", "-DEDGEPIPE_HAVE_AVX512VNNI")
    if _compiler_has_amx(find_compiler()):  # AMX int8 tiles: a compiler without -mamx-int8 builds the rest
        units.append(TranslationUnit("gguf_amx.c", (*avx512, *AMX_FLAGS)))
        op_flags += ("-DEDGEPIPE_HAVE_AMX",)
    return [*units, TranslationUnit("gguf_op.c", op_flags)]


AMX_FLAGS = ("-mamx-tile", "-mamx-int8")


@functools.lru_cache(maxsize=None)
def _compiler_has_amx(compiler: str | None) -> bool:
    """Whether `compiler` builds AMX tile intrinsics (gcc 11+, clang 12+)."""
    if compiler is None:
        return False
    probe = "#include <immintrin.h>\nvoid f(void) { _tile_zero(0); _tile_dpbusd(0, 1, 2); _tile_release(); }\n"
    try:
        done = subprocess.run([compiler, *AMX_FLAGS, "-x", "c", "-c", "-o", os.devnull, "-"], input=probe,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def find_compiler() -> str | None:
    """$CC, else `cc`, `gcc` or `clang` on PATH."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"]) or os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_identity(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"C compiler {compiler} does not run: {error}") from error


def build_key(compiler: str) -> str:
    """Hash of the sources, headers, flags, compiler version and machine."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for unit in translation_units():
        digest.update(repr(unit).encode())
    digest.update(repr(COMMON_FLAGS).encode() + _compiler_identity(compiler).encode() + platform.machine().encode())
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    return Path(os.environ.get("EDGEPIPE_NATIVE_CACHE") or Path(user_cache_dir("edgepipe")) / "native")


def build_library(compiler: str | None = None) -> Path:
    """The built library's path, compiling it if this source/compiler pair has not been built yet.

    Raises BuildError (one line) when no compiler is found or compilation fails.
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found (set $CC or install cc/gcc/clang)")
    target = cache_root() / build_key(compiler) / LIBRARY_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = []
        for unit in translation_units():
            obj = Path(scratch) / (unit.source + ".o")
            _run([compiler, *COMMON_FLAGS, *unit.flags, "-c", str(SOURCE_DIR / unit.source), "-o", str(obj)])
            objects.append(str(obj))
        linked = Path(scratch) / LIBRARY_NAME
        _run([compiler, "-shared", "-o", str(linked), *objects, "-lm"])
        os.replace(linked, target)  # atomic: concurrent builders all end with one whole file
    return target


def _run(command: list[str]) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"{command[0]} failed to run: {error}") from error
    if result.returncode != 0:
        first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr.strip()[:200])
        raise BuildError(f"compiling the GGUF kernels failed: {first}")


if __name__ == "__main__":
    print(build_library())
