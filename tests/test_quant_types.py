"""A GGUF block type is one row of one table (issue 38, item 5): `edgepipe/native/quant_types.py`.

The C side is generated from it (`src/gguf_types.h`, X-macros the enum, block geometry, dispatch
and messages expand from), and each Python site reads it. These tests check that the committed
header is the generated one, that a row without its portable C kernel does not compile, that every
reading site sees every row, that the rows agree with gguf-py, and that no hand-written type list
is left in the package (a scanner with a test that it catches each kind of list it looks for).
"""

from __future__ import annotations

import ast
import ctypes
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from edgepipe.native import quant_types
from edgepipe.native.build import COMMON_FLAGS, SOURCE_DIR, find_compiler
from edgepipe.native.quant_types import BY_NAME, FLOAT_TYPES, QUANT_TYPES, kernel_handles

PACKAGE = Path(quant_types.__file__).resolve().parents[1]  # edgepipe/
TYPE_NAMES = {t.name for t in QUANT_TYPES}
_C_TYPE = "GGUF_(?:" + "|".join(sorted(TYPE_NAMES)) + ")"  # a type's C identifier


@pytest.mark.pure
def test_committed_header_is_the_generated_one():
    assert quant_types.TARGET == SOURCE_DIR / "gguf_types.h"
    assert quant_types.TARGET.read_text() == quant_types.render(), \
        "src/gguf_types.h differs from edgepipe/native/quant_types.py: run python -m edgepipe.native.quant_types --write"


@pytest.mark.pure
def test_a_new_row_fails_the_check_until_regenerated(monkeypatch, tmp_path, capsys):
    stale = tmp_path / "gguf_types.h"
    stale.write_text(quant_types.TARGET.read_text())
    assert quant_types.main(["--check", "--file", str(stale)]) == 0
    monkeypatch.setattr(quant_types, "QUANT_TYPES", QUANT_TYPES + (replace(BY_NAME["Q8_0"], name="Q9_9", ggml_id=41),))
    assert quant_types.main(["--check", "--file", str(stale)]) == 1
    assert "--write" in capsys.readouterr().err
    assert quant_types.main(["--write", "--file", str(stale)]) == 0
    assert "X(Q9_9, q9_9, 41, 32, 34, 32)" in stale.read_text() and quant_types.main(["--check", "--file", str(stale)]) == 0


def test_a_row_without_its_portable_kernel_does_not_compile(monkeypatch, tmp_path):
    """The portable dispatch is expanded from the X-macro: a row is a compile error until its
    `dot_<name>` exists, so no type can reach the op without a kernel on every ISA."""
    compiler = find_compiler()
    assert compiler, "no C compiler"
    for path in SOURCE_DIR.iterdir():
        shutil.copy(path, tmp_path / path.name)
    compile_portable = [compiler, *COMMON_FLAGS, "-c", str(tmp_path / "gguf_portable.c"), "-o", str(tmp_path / "p.o")]
    assert subprocess.run(compile_portable, capture_output=True, text=True).returncode == 0
    monkeypatch.setattr(quant_types, "QUANT_TYPES", QUANT_TYPES + (replace(BY_NAME["Q8_0"], name="Q9_9", ggml_id=41),))
    quant_types.main(["--write", "--file", str(tmp_path / "gguf_types.h")])
    done = subprocess.run(compile_portable, capture_output=True, text=True)
    assert done.returncode != 0 and "dot_q9_9" in done.stderr


@pytest.mark.pure
def test_rows_agree_with_gguf_py():
    assert len({t.ggml_id for t in QUANT_TYPES}) == len({t.name for t in QUANT_TYPES}) == len(QUANT_TYPES)
    for t in QUANT_TYPES:
        qtype = gguf.GGMLQuantizationType[t.name]
        assert (int(qtype), (t.block_values, t.block_bytes)) == (t.ggml_id, gguf.GGML_QUANT_SIZES[qtype]), t.name
        assert t.activation == t.block_values, f"{t.name}: the op sizes activation rows by the weight block"
        assert quant_types.type_name(t.ggml_id) == t.name
    for name, ggml_id in FLOAT_TYPES.items():
        assert int(gguf.GGMLQuantizationType[name]) == ggml_id
    for ggml_id, name in quant_types.GGML_TYPE_NAMES.items():
        assert gguf.GGMLQuantizationType(ggml_id).name == name


@pytest.mark.pure
def test_every_reading_site_sees_every_row():
    """The sites that once wrote their own list, each now reading the table."""
    from edgepipe import native
    from edgepipe.model import gguf_header, weights

    names = [t.name for t in QUANT_TYPES]
    assert native.GGML_TYPE_IDS == {t.name: t.ggml_id for t in QUANT_TYPES}  # graphs.py, moe.py: GgufMatMul's qtype
    assert [k for k in names if native.kernel_handles(k)] == names  # importer, moe.py: the kernel form's types
    assert list(weights.NATIVE_TYPES) == [t.name for t in QUANT_TYPES if t.fallback]  # the fallback form (importer)
    assert all(weights.row_bytes(t.name, 1024) == 1024 // t.block_values * t.block_bytes for t in QUANT_TYPES)
    assert set(gguf_header.TENSOR_TYPES) == {t.ggml_id for t in QUANT_TYPES} | set(FLOAT_TYPES.values())
    assert weights.FLOAT_TYPES == tuple(FLOAT_TYPES)


def test_the_library_names_every_row_it_refuses_with(tmp_path):
    """The op's "not supported" message is expanded from the table (GGUF_TYPES_SUPPORTED)."""
    import numpy as np

    from edgepipe.native import gguf_kernel_library, native_library

    library = gguf_kernel_library()
    assert library is not None, native_library().reason
    handle = ctypes.CDLL(str(library))
    handle.edgepipe_gguf_matmul.restype = ctypes.c_char_p
    x, y, w = np.zeros(32, np.float32), np.zeros(1, np.float32), np.zeros(64, np.uint8)
    message = handle.edgepipe_gguf_matmul(1, b"portable", x.ctypes.data, 1, 32, w.ctypes.data, 1, 64, y.ctypes.data).decode()
    assert "GGML type 1 is not supported" in message
    assert all(f"{t.name}={t.ggml_id}" in message for t in QUANT_TYPES), message


@pytest.mark.pure
def test_kernel_handles_answers_for_the_graph_builder():
    assert kernel_handles("MXFP4") and kernel_handles("Q4_K")
    assert not kernel_handles("Q2_K") and not kernel_handles("F32") and not kernel_handles("IQ4_NL")
    assert quant_types.fallback_handles("MXFP4") and not quant_types.fallback_handles("Q2_K")


# -- no hand-written type list left -------------------------------------------------------------------

C_LIST_PATTERNS = {  # the shapes the C lists had
    "designated initializer": re.compile(rf"\[{_C_TYPE}\]\s*="),
    "table entry": re.compile(rf"\bENTRY\({_C_TYPE}\b"),
    "enum value": re.compile(rf"\b{_C_TYPE}\s*=\s*\d+"),
    "kernel instantiation": re.compile(r"^\s*(KERNELS|ROWS_BY_DOT)\([a-z0-9_]+\)\s*$", re.M),
    "id list in a string": re.compile(r"\b[A-Z][A-Z0-9_]*=\d+ [A-Z][A-Z0-9_]*=\d+"),
}


def _type_name(node: ast.AST) -> str | None:
    """A type named by a string literal ("Q4_K") or an attribute (Q.Q4_K)."""
    if isinstance(node, ast.Constant) and node.value in TYPE_NAMES:
        return node.value
    if isinstance(node, ast.Attribute) and node.attr in TYPE_NAMES:
        return node.attr
    return None


def python_type_lists(source: str) -> list[int]:
    """Lines where a tuple/list/set names 3+ types or a dict maps 2+ types (keys or values)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = {_type_name(e) for e in node.elts} - {None}
            if len(named) >= 3:
                found.append(node.lineno)
        elif isinstance(node, ast.Dict):
            keys = {_type_name(k) for k in node.keys if k is not None} - {None}
            values = {_type_name(v) for v in node.values} - {None}
            if len(keys) >= 2 or len(values) >= 2:
                found.append(node.lineno)
    return found


def c_type_lists(source: str) -> list[str]:
    return [kind for kind, pattern in C_LIST_PATTERNS.items() if pattern.search(source)]


def type_lists(package: Path) -> list[str]:
    """Every hand-written type list under ``package`` (edgepipe/), as ``path:line`` or ``path: kind``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name != "quant_types.py":
            found += [f"{path.relative_to(package)}:{line}" for line in python_type_lists(path.read_text())]
    for path in sorted((package / "native" / "src").glob("*.[ch]")):
        if path.name != "gguf_types.h":
            found += [f"{path.relative_to(package)}: {kind}" for kind in c_type_lists(path.read_text())]
    return found


@pytest.mark.pure
def test_no_hand_written_type_list_is_left():
    assert type_lists(PACKAGE) == []


@pytest.mark.pure
@pytest.mark.parametrize("snippet", [
    'IDS = {"Q4_0": 2, "Q8_0": 8}',
    'NAMES = {2: "Q4_0", 8: "Q8_0"}',
    'if kind in ("Q4_0", "Q4_1", "Q8_0"):\n    pass',
    'block = {Q.Q4_K: (256, 144), Q.Q6_K: (256, 210)}',
])
def test_the_python_scanner_catches_a_list(snippet):
    assert python_type_lists(snippet), snippet


@pytest.mark.pure
@pytest.mark.parametrize("snippet", [
    "static const info T[16] = {[GGUF_Q4_0] = {32, 18}};",
    "    ENTRY(GGUF_Q4_0, q4_0);",
    "enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3 };",
    "KERNELS(q4_0)\nKERNELS(q4_1)",
    'snprintf(e, n, "type %d is not supported (Q4_0=2 Q4_1=3)", t);',
])
def test_the_c_scanner_catches_a_list(snippet):
    assert c_type_lists(snippet), snippet


@pytest.mark.pure
def test_the_scanner_leaves_per_type_code_alone():
    """A decoder's own branch and a kernel's switch on its type are the type's implementation."""
    assert python_type_lists('if kind == "MXFP4":\n    pass\nelif kind in ("Q4_K", "Q5_K"):\n    pass') == []
    assert c_type_lists("case GGUF_MXFP4: q = lookup(w + 1); break;\nint five = qtype == GGUF_Q5_0 || qtype == GGUF_Q5_1;") == []
