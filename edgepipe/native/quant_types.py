"""The GGUF block types edgepipe keeps exactly: one row per type, read by Python and (generated) by C.

Adding a type is one `QuantType` row in `QUANT_TYPES`, its numpy decode in `model/weights.py`, and
its kernels in `src/`: `python -m edgepipe.native.quant_types --write` regenerates
`src/gguf_types.h`, whose X-macros the C enum, block geometry, dispatch tables and the "supported"
message are expanded from, so a row without a portable kernel (or an ISA named in `simd` without
its kernel) does not compile. Every Python site reads this table: the header's refusal
(`model/gguf_header.py`), the importer and the GGUF source (`model/weights.NATIVE_TYPES`, derived
from `fallback`), the graph builders (`GGML_TYPE_IDS`, `kernel_handles`), the synthetic-file writer.

Why Python is the source and C the generated side: a row carries more than C needs (the
MatMulNBits layout of the fallback form, the ggml name for refusals), Python runs where no
compiler does (import, planning, a GPU worker), and writing a header is a few lines while parsing C
would be a parser; `tests/test_quant_types.py` fails while the committed header is stale, as
`net/protocol_js.py` does for the browser's constants.

Layering: `edgepipe.native` is below `edgepipe.model` (model imports it), so the table lives here
and imports nothing from edgepipe.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import generated

Isa = Literal["avx2", "neon"]  # a kernel file: gguf_avx2.c (also built as avx512vnni), gguf_neon.c (also neon_dotprod)


@dataclass(frozen=True)
class MatMulNBitsLayout:
    """How the fallback form (ONNX Runtime's MatMulNBits, no kernel library) holds the type exactly
    (``model/weights.decode_native``)."""

    bits: int  # MatMulNBits bits (4 or 8)
    block_size: int  # MatMulNBits block size
    shift: int  # stored u = q + shift, so that u - 2**(bits-1) = q - z
    has_offset: bool  # the type has a per-block minimum (d * q + m)


@dataclass(frozen=True)
class QuantType:
    """One GGUF block type: its geometry, the activation blocks its kernels pair with, which kernel
    forms run it."""

    name: str  # ggml's name, as gguf-py's GGMLQuantizationType spells it
    ggml_id: int  # the number in a GGUF tensor header
    block_values: int  # weights per block
    block_bytes: int  # bytes per block as stored
    activation: Literal[32, 256]  # activation rows quantized to 8 bits per 32 (act_block32) or per 256 with 16-sums
    simd: frozenset[Isa]  # kernel files with their own kernel; every other ISA runs the portable C one
    fallback: MatMulNBitsLayout | None  # the fallback form's exact layout; None: only the kernel form runs it
    formula: str  # value of a weight, for the reader

    @property
    def c_name(self) -> str:
        return self.name.lower()


_BOTH: frozenset[Isa] = frozenset({"avx2", "neon"})

QUANT_TYPES: tuple[QuantType, ...] = (
    QuantType("Q4_0", 2, 32, 18, 32, _BOTH, MatMulNBitsLayout(4, 32, 0, False), "d * (q - 8)"),
    QuantType("Q4_1", 3, 32, 20, 32, _BOTH, MatMulNBitsLayout(4, 32, 0, True), "d * q + m"),
    QuantType("Q5_0", 6, 32, 22, 32, _BOTH, MatMulNBitsLayout(8, 32, 112, False), "d * (q - 16)"),
    QuantType("Q5_1", 7, 32, 24, 32, _BOTH, MatMulNBitsLayout(8, 32, 112, True), "d * q + m"),
    QuantType("Q8_0", 8, 32, 34, 32, _BOTH, MatMulNBitsLayout(8, 32, 128, False), "d * q, q int8"),
    QuantType("Q4_K", 12, 256, 144, 256, _BOTH, MatMulNBitsLayout(4, 32, 0, True), "(d * sc) * q - dmin * mn, 8 sub-blocks of 32"),
    QuantType("Q5_K", 13, 256, 176, 256, _BOTH, MatMulNBitsLayout(8, 32, 112, True), "same with 5-bit q"),
    QuantType("Q6_K", 14, 256, 210, 256, _BOTH, MatMulNBitsLayout(8, 16, 96, False), "(d * sc) * (q - 32), 16 sub-blocks of 16"),
    # gpt-oss's experts: one E8M0 exponent byte e, 16 bytes of 4-bit E2M1 codes; 2^(e-128) x the doubled
    # E2M1 value kvalues[q] (-12..12), so the fallback holds kvalues[q] + 128 as 8-bit codes exactly
    QuantType("MXFP4", 39, 32, 17, 32, _BOTH, MatMulNBitsLayout(8, 32, 128, False), "2^(e - 128) * kvalues[q]"),
)

FLOAT_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "BF16": 30}  # name -> ggml id; read as float32 exactly

# ggml's names of its other type ids, only to name a refused tensor type (not a list of what runs)
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
}

BY_NAME: dict[str, QuantType] = {t.name: t for t in QUANT_TYPES}
BY_ID: dict[int, QuantType] = {t.ggml_id: t for t in QUANT_TYPES}
GGML_TYPE_IDS: dict[str, int] = {t.name: t.ggml_id for t in QUANT_TYPES}  # what GgufMatMul's `qtype` attribute takes


def kernel_handles(kind: str) -> bool:
    """Whether the kernel library runs GGUF type ``kind`` (every row has at least the portable C
    kernel, on every ISA): a graph builder picks the kernel form for it, else a fallback. Whether
    the library is built on a given worker is `edgepipe.native.gguf_kernel_library`'s question."""
    return kind in BY_NAME


def fallback_handles(kind: str) -> bool:
    """Whether the fallback form (MatMulNBits) holds ``kind``'s blocks exactly."""
    return kind in BY_NAME and BY_NAME[kind].fallback is not None


def type_name(ggml_id: int) -> str:
    """ggml's name of a type id, for messages."""
    return GGML_TYPE_NAMES.get(ggml_id, f"ggml type {ggml_id}")


TARGET = Path(__file__).parent / "src" / "gguf_types.h"


def render() -> str:
    """The C header of X-macros written from `QUANT_TYPES`."""
    def rows(macro: str, args: str, types) -> list[str]:
        body = [f"    X({args.format(t=t)})" for t in types]
        return [f"#define {macro}(X) \\"] + [line + " \\" for line in body[:-1]] + body[-1:] + [""]

    lines = [
        "/* Generated by `python -m edgepipe.native.quant_types --write` from edgepipe/native/quant_types.py:",
        " * do not edit (tests/test_quant_types.py fails while this file is stale). */",
        "#ifndef EDGEPIPE_GGUF_TYPES_H",
        "#define EDGEPIPE_GGUF_TYPES_H",
        "",
        "/* X(NAME, name, ggml_id, block_values, block_bytes, activation_values): every type, each with a",
        " * portable kernel dot_<name> in gguf_portable.c */",
        *rows("GGUF_TYPES", "{t.name}, {t.c_name}, {t.ggml_id}, {t.block_values}, {t.block_bytes}, {t.activation}", QUANT_TYPES),
    ]
    for isa in ("avx2", "neon"):
        lines += [f"/* X(NAME, name): the types gguf_{isa}.c has its own kernel rows_<name> for; the others run the portable one */",
                  *rows(f"GGUF_TYPES_{isa.upper()}", "{t.name}, {t.c_name}", [t for t in QUANT_TYPES if isa in t.simd])]
    supported = " ".join(f"{t.name}={t.ggml_id}" for t in QUANT_TYPES)
    lines += [f"#define GGUF_TYPE_SLOTS {max(t.ggml_id for t in QUANT_TYPES) + 1}",
              f'#define GGUF_TYPES_SUPPORTED "{supported}"', "", "#endif", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return generated.main(argv, module="edgepipe.native.quant_types", describe=__doc__.splitlines()[0], target=TARGET, source="edgepipe/native/quant_types.py",
                          render=render)


if __name__ == "__main__":
    sys.exit(main())
