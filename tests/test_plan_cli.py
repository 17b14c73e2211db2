"""`edgepipe plan --devices devices.yaml` prints the plan table; bad files give one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "devices.yaml"


def run(*args, home):
    return subprocess.run([sys.executable, "-m", "edgepipe", "plan", *args], capture_output=True, text=True, timeout=120,
                          env={"EDGEPIPE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})


def test_plan_table_with_runners_up(home, int4_pkg):
    r = run("--devices", str(EXAMPLE), "--top-k", "3", home=home)
    assert r.returncode == 0, r.stderr
    assert "best:" in r.stdout and "rank" in r.stdout and "desktop" in r.stdout
    ranks = [line for line in r.stdout.splitlines() if line[:1].isdigit() and "ms" not in line and "[" in line]
    assert len(ranks) >= 2  # the best plan and at least one runner-up


def test_energy_objective_reports_target(home, int4_pkg):
    r = run("--devices", str(EXAMPLE), "--objective", "energy", "--tpot-target-ms", "30", home=home)
    assert r.returncode == 0, r.stderr
    assert "meets target" in r.stdout


def test_bad_devices_file(home, tmp_path):
    bad = tmp_path / "devices.yaml"
    bad.write_text("devices:\n  - id: x\n    memory: lots\n")
    r = run("--devices", str(bad), home=home)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:")
