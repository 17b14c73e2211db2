"""Bad model input: one clear line, a non-zero exit, and no half-written package."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from edgepipe.model.gguf_source import CorruptModel
from edgepipe.model.importer import import_model
from edgepipe.model.manifest import HashMismatch
from edgepipe.model.config import UnsupportedModel
from edgepipe.model.package import Package
from edgepipe.model.store import bundled_gguf, local_form


def cli(*args, home):
    env = {"EDGEPIPE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "edgepipe", *args], capture_output=True, text=True, env=env, timeout=300)


def assert_one_line_error(result, *words):
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:")
    for w in words:
        assert w in lines[0], lines[0]


def no_leftovers(models_dir):
    return not models_dir.exists() or not any(p.name.startswith(".tmp") or not (p / "manifest.json").exists() for p in models_dir.iterdir())


def test_truncated_gguf(tmp_path):
    src = tmp_path / "cut.gguf"
    src.write_bytes(bundled_gguf().read_bytes()[: 5_000_000])
    with pytest.raises(CorruptModel, match="truncated"):
        import_model(src, tmp_path / "models", "int4")
    assert no_leftovers(tmp_path / "models")
    assert_one_line_error(cli("import", str(src), home=tmp_path), "truncated")
    assert no_leftovers(tmp_path / "models")


def test_garbage_with_gguf_magic(tmp_path):
    src = tmp_path / "junk.gguf"
    src.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(4096))
    assert_one_line_error(cli("import", str(src), home=tmp_path), "junk.gguf")
    assert no_leftovers(tmp_path / "models")


def test_not_a_model_file(tmp_path):
    src = tmp_path / "notes.bin"
    src.write_bytes(b"hello")
    assert_one_line_error(cli("import", str(src), home=tmp_path), "not a GGUF")


def test_unsupported_architecture(tmp_path):
    gguf = pytest.importorskip("gguf")
    src = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(src), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="bert"):
        import_model(src, tmp_path / "models", "int4")
    assert_one_line_error(cli("import", str(src), home=tmp_path), "'bert' is not supported")
    assert no_leftovers(tmp_path / "models")


def test_weight_file_with_wrong_hash(native_pkg, tmp_path):
    copy = tmp_path / "damaged"
    shutil.copytree(native_pkg.root, copy)
    pkg = Package(copy)
    form = local_form(pkg)  # what `generate` runs: its files are the ones checked
    victim = pkg.blob(pkg.manifest.variant(5, form).files[0])
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(HashMismatch, match="sha256"):
        pkg.pipeline(precision=form)
    assert_one_line_error(cli("generate", "hi", "--model", str(copy), home=tmp_path), "sha256")


def test_prompt_longer_than_context(native_pkg, home):
    import_model(bundled_gguf(), home / "models", "native", name="smollm2-ctx64", max_context=64, measure_cost=False)
    result = cli("generate", "word " * 80, "--model", "smollm2-ctx64", "-n", "4", home=home)
    assert_one_line_error(result, "exceeds the context of 64")
    result = cli("generate", "hi", "-m", "smollm2", "-n", "100000", home=home)
    assert_one_line_error(result, "exceeds the context")
