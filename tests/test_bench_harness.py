"""The benchmarks' one harness (``edgepipe.bench``): its machine line, its result writers, its
launcher failing fast, and the benchmarks using it rather than ``sys.path`` or ``tests/``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgepipe.bench.cluster import Server
from edgepipe.bench.machine import Conditions, machine_line
from edgepipe.bench.results import read_results, write_results

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def test_conditions_line_names_date_machine_and_both_loads():
    run = Conditions.start()
    assert run.load_after is None and "at end" not in run.line()
    run.finish()
    line = run.line()
    assert line.startswith(run.date + " · " + machine_line(run.machine) + " · load average ")
    assert re.search(r"load average \d+\.\d\d \d+\.\d\d \d+\.\d\d at start, \d+\.\d\d \d+\.\d\d \d+\.\d\d at end$", line), line
    assert f"{run.machine['nproc']} cores" in line
    again = Conditions.from_dict(json.loads(json.dumps(run.as_dict())))
    assert again.line() == line


def test_results_are_written_as_json_and_markdown_and_read_back(tmp_path):
    data = {"rows": [{"tok_s": 12.5}], "machine": {"nproc": 2}}
    written = write_results("demo", data, "# Demo\n\n| a |\n|---|", tmp_path / "out")
    assert [p.name for p in written] == ["demo.json", "demo.md"]
    assert read_results("demo", tmp_path / "out") == data
    assert (tmp_path / "out" / "demo.md").read_text() == "# Demo\n\n| a |\n|---|\n"
    assert write_results("only-md", None, "text", tmp_path) == [tmp_path / "only-md.md"]
    assert read_results("only-md", tmp_path) is None


def test_server_that_exits_fails_fast_with_its_exit_code(tmp_path):
    with pytest.raises(RuntimeError, match=r"server exited with 2"):
        Server(tmp_path, workers=0, args=("--no-such-flag",), timeout=60)


def test_benchmarks_use_the_harness_not_sys_path():
    assert len(BENCHMARKS) > 20
    for path in BENCHMARKS:
        text = path.read_text()
        assert "sys.path" not in text, f"{path.name} edits sys.path"
        assert not re.search(r"^\s*(from|import) (tests|harness|browser|placement|decode|quant_layouts)\b", text, re.M), \
            f"{path.name} imports tests/ or another script"
    for path in (ROOT / "edgepipe" / "bench").glob("*.py"):
        assert not re.search(r"^\s*(from|import) (tests|harness)\b", path.read_text(), re.M), f"edgepipe/bench/{path.name} imports tests/"


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_every_benchmark_answers_help(path):
    """Every script parses its flags before it measures anything: --help exits 0 without a run."""
    done = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:200]
