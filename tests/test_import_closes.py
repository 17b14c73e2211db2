"""An import and a variant build close the GGUF file they read tensors from (the file was left to
the garbage collector: a ResourceWarning in the API tests, and a descriptor held in a serving
coordinator after each browser variant it built)."""

from __future__ import annotations

import pytest

from edgepipe.model import importer
from edgepipe.model.store import bundled_gguf


def reading_then_failing(seen: list):
    def write(src, *args, **kwargs):
        src.raw_rows(src.tensor_names()[0], 0, 1)  # opens the file, as the real writer does
        seen.append(src)
        raise RuntimeError("stopped after the first read")

    return write


def test_an_import_closes_its_gguf(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(importer, "_write_package", reading_then_failing(seen))
    with pytest.raises(RuntimeError, match="first read"):
        importer.import_model(bundled_gguf(), tmp_path / "models", "native", measure_cost=False)
    assert seen and seen[0]._file is None
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".tmp-")]  # nothing left half-written


def test_a_variant_build_closes_its_gguf(native_pkg, monkeypatch):
    # a (unit, variant) not built yet: the session's package may have gained fp32 units in other tests
    unit, precision = next((u.index, p) for p in ("fp32", "int8", "int4") for u in native_pkg.manifest.units if p not in u.variants)
    before = (native_pkg.root / "manifest.json").read_text()
    seen = []
    monkeypatch.setattr(importer, "_write_package", reading_then_failing(seen))
    with pytest.raises(RuntimeError, match="first read"):
        importer.add_variant(native_pkg.root, precision, units=[unit])
    assert seen and seen[0]._file is None
    assert (native_pkg.root / "manifest.json").read_text() == before
