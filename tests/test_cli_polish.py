"""The command line's small promises (issue 42's polish): ``--version``, ``models`` as a table
with sizes, ``rm``, a package named after its file stem, one newline after generated text in a
pipe, and progress as plain lines when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgepipe import __version__
from edgepipe.cli import app
from edgepipe.model.store import bundled_gguf, find_packages, stem
from edgepipe.progress import PlainLines

ROOT = Path(__file__).resolve().parents[1]


def edgepipe(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "EDGEPIPE_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "edgepipe", *args], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@pytest.mark.pure
def test_version_prints_the_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"edgepipe {__version__}"


def _fake_package(models: Path, name: str, manifest: dict, blob_bytes: int) -> Path:
    root = models / name
    (root / "blobs").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({**manifest, "name": name}))
    (root / "blobs" / "weights").write_bytes(b"\0" * blob_bytes)
    return root


@pytest.fixture
def fake_home(tmp_path, native_pkg):
    """A home with two packages of the stem ``qwen15`` and one of ``tiny`` (the bundled model's
    manifest, a blob of a known size each)."""
    manifest = json.loads((native_pkg.root / "manifest.json").read_text())
    models = tmp_path / "models"
    _fake_package(models, "qwen15-native", manifest, 3_000_000)
    _fake_package(models, "qwen15-int4", {**manifest, "precision": "int4"}, 2_000_000)
    _fake_package(models, "tiny-native", manifest, 5_000_000)
    return tmp_path


def test_models_is_a_table_with_a_header_and_sizes(fake_home):
    result = CliRunner().invoke(app, ["models", "--home", str(fake_home)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PRECISION", "ARCH", "LAYERS", "MODIFIED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"qwen15-native", "qwen15-int4", "tiny-native"}
    assert re.search(r"qwen15-native\s+3 MB\s+native\s+llama\s+30\s+just now", rows["qwen15-native"]), rows
    assert re.search(r"tiny-native\s+5 MB\s", rows["tiny-native"]), rows


def test_a_package_is_found_by_its_file_stem(fake_home):
    assert stem("qwen15-native") == "qwen15" and stem("mine") == "mine"
    models = fake_home / "models"
    assert find_packages("qwen15", fake_home, "native") == [models / "qwen15-native"]
    assert find_packages("qwen15", fake_home, "int4") == [models / "qwen15-int4"]
    assert find_packages("qwen15", fake_home) == [models / "qwen15-int4", models / "qwen15-native"]  # both: rm asks which
    assert find_packages("tiny", fake_home, "int4") == [models / "tiny-native"]  # the one there is
    assert find_packages("qwen15-int4", fake_home) == [models / "qwen15-int4"]
    assert find_packages("qwen", fake_home) == []


def test_rm_deletes_one_package_and_refuses_what_it_cannot_name(fake_home):
    runner = CliRunner()
    models = fake_home / "models"
    result = runner.invoke(app, ["rm", "tiny", "--home", str(fake_home)])
    assert result.exit_code == 0 and result.output.strip() == "deleted tiny-native", result.output
    assert not (models / "tiny-native").exists()
    result = runner.invoke(app, ["rm", "qwen15", "--home", str(fake_home)])  # two of that stem: name one
    assert result.exit_code == 1 and "qwen15-int4, qwen15-native" in result.output, result.output
    assert (models / "qwen15-int4").is_dir() and (models / "qwen15-native").is_dir()
    result = runner.invoke(app, ["rm", "tiny", "--home", str(fake_home)])
    assert result.exit_code == 1 and "no imported model 'tiny'" in result.output, result.output
    outside = fake_home / "elsewhere"
    shutil.copytree(models / "qwen15-int4", outside)
    result = runner.invoke(app, ["rm", str(outside), "--home", str(fake_home)])  # a path is not a package name
    assert result.exit_code == 1 and outside.is_dir(), result.output


def test_import_then_generate_by_stem_ends_its_text_with_one_newline(tmp_path):
    source = tmp_path / "qwen15.gguf"
    shutil.copyfile(bundled_gguf(), source)
    home = tmp_path / "home"
    imported = edgepipe("import", str(source), home=home)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("qwen15-native: ")
    # stderr is a pipe: progress as plain lines, none for a phase over within a second (PlainLines, tested above)
    assert "Traceback" not in imported.stderr and "\r" not in imported.stderr, imported.stderr
    generated = edgepipe("generate", "-m", "qwen15", "-n", "3", "-t", "0", "--raw", "The sky is", home=home)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.endswith("\n") and not generated.stdout.endswith("\n\n") and generated.stdout.strip(), repr(generated.stdout)
    assert re.search(r"3 generated", generated.stderr), generated.stderr


@pytest.mark.pure
def test_plain_progress_lines_are_few_and_end_with_a_rate():
    p = PlainLines(every_s=5, quiet_s=1)
    assert p.line("weights", 0, 100_000_000, 0.0) is None  # a phase says nothing before it has lasted a second
    assert p.line("weights", 10_000_000, 100_000_000, 1.0) == "converting weights: 10 MB of 100 MB (10.0 MB/s)"
    assert p.line("weights", 20_000_000, 100_000_000, 2.0) is None  # too soon
    assert p.line("weights", 60_000_000, 100_000_000, 6.0) == "converting weights: 60 MB of 100 MB (10.0 MB/s)"
    assert p.line("build", 1, 4, 6.0) is None
    assert p.line("build", 2, 4, 7.0) == "importing units: 2/4"
    assert p.line("build", 4, 4, 7.5) == "importing units: 4/4, done in 1.5 s"
    assert p.line("build", 4, 4, 8.0) is None
    assert p.line("hash", 1, 1, 8.0) is None and p.line("hash", 1, 1, 9.5) is None  # over at once: silent
    assert p.line("weights", 0, 0, 20.0) is None and p.line("weights", 0, 0, 30.0) is None  # nothing to convert: silent
    # a meter that never reaches its total is closed where it got to
    assert p.finish(10.0) == ["converting weights: 60 MB of 100 MB (6.0 MB/s), done in 10.0 s"]


@pytest.mark.pure
def test_a_worker_download_says_its_rate_as_it_goes(caplog):
    import logging
    import time

    from edgepipe.net.messages import plan_label
    from edgepipe.worker.ports import DownloadMeter

    assert (plan_label(3), plan_label(-10_001), plan_label(-2), plan_label(0)) == ("plan 3", "calibration", "the spare plan", "a link probe")
    meter = DownloadMeter(plan_label(-10_001), time.monotonic() - 2.0, every_s=1.0)
    with caplog.at_level(logging.INFO, logger="edgepipe.worker"):
        meter.add(50_000_000)  # 2 s after the start: a line
        meter.add(1_000_000)  # at once after it: none
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and re.fullmatch(r"calibration: downloading, 50 MB so far \(2\d\.\d MB/s\)", lines[0]), lines
