"""`edgepipe plan --devices devices.yaml` prints the plan table; bad files give one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[1] / "examples" / "devices.yaml"


def run(*args, home):
    return subprocess.run([sys.executable, "-m", "edgepipe", "plan", *args], capture_output=True, text=True, timeout=120,
                          env={"EDGEPIPE_HOME": str(home), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})


def test_plan_table_with_runners_up(home, native_pkg):
    r = run("--devices", str(EXAMPLE), "--top-k", "3", home=home)
    assert r.returncode == 0, r.stderr
    assert "best:" in r.stdout and "rank" in r.stdout and "desktop" in r.stdout
    ranks = [line for line in r.stdout.splitlines() if line[:1].isdigit() and "ms" not in line and "[" in line]
    assert len(ranks) >= 2  # the best plan and at least one runner-up


def test_energy_objective_reports_target(home, native_pkg):
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


def test_json_output(home, native_pkg):
    import json

    r = run("--devices", str(EXAMPLE), "--json", "--objective", "energy", "--tpot-target-ms", "30", home=home)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["objective"] == "energy" and doc["best"]["complete"] is True
    assert doc["best"]["stages"][0]["start"] == 0 and doc["best"]["stages"][-1]["end"] == doc["units"]
    assert doc["best"]["predicted"]["tpot_s"] <= 0.030 and doc["best"]["meets_target"] is True
    assert doc["gap"] is None or doc["gap"] >= 0


def test_gap_printed(home, native_pkg):
    r = run("--devices", str(EXAMPLE), home=home)
    assert r.returncode == 0, r.stderr
    assert "gap to bound 0.000%" in r.stdout


def test_partial_plan_exit_2_without_throughput(home, native_pkg, tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text("devices:\n  - id: a\n    memory: 100MB\n    speed: 1\n")
    r = run("--devices", str(small), home=home)
    assert r.returncode == 2, r.stderr
    assert "PARTIAL PLAN" in r.stdout and "tok/s" not in r.stdout and "J/token" not in r.stdout
    r = run("--devices", str(small), "--json", home=home)
    assert r.returncode == 2
    import json

    best = json.loads(r.stdout)["best"]
    assert best["complete"] is False and "predicted" not in best


def test_flags_that_do_not_apply_are_refused(home, native_pkg, tmp_path):
    for args, needle in [
        (("--tpot-target-ms", "30"), "--tpot-target-ms applies to the energy objective only"),
        (("--sequences", "4"), "--sequences applies to the throughput and energy objectives"),
        (("--model", native_pkg.manifest.name, "--precision", "int8"), "--precision int8 does not apply"),
        (("--objective", "fastest"), "--objective 'fastest' is not one of"),
    ]:
        r = run("--devices", str(EXAMPLE), *args, home=home)
        assert r.returncode == 1, (args, r.stdout)
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and needle in lines[0], (args, r.stderr)


def test_devices_file_error_names_line(home, native_pkg, tmp_path):
    bad = tmp_path / "devices.yaml"
    bad.write_text('devices:\n  - id: x\n    memory: 1GiB\n    speed: 1\n    relay: "false"\n')
    r = run("--devices", str(bad), home=home)
    assert r.returncode == 1
    assert f"{bad}:5:" in r.stderr and "without quotes" in r.stderr
