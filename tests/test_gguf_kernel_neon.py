"""The ARM64 NEON kernels, cross-compiled and run under emulation: every block type, plain NEON and
NEON with dot products, equal to the portable path bit for bit (one row and a batch of 11), and the
run-time choice following the CPU (a Cortex-A53 has no dot product; `-cpu max` has it).

Needs Debian's gcc-aarch64-linux-gnu and qemu-user, which `scripts/bootstrap.sh test` installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from edgepipe.native.build import ARM64_UNITS, COMMON_FLAGS, SOURCE_DIR

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
CHECK_SOURCE = Path(__file__).parent / "native" / "neon_check.c"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def check_binary(tmp_path_factory) -> Path:
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    assert not missing, f"{', '.join(missing)} not installed: run `bash scripts/bootstrap.sh test` (apt: gcc-aarch64-linux-gnu qemu-user)"
    out = tmp_path_factory.mktemp("neon")
    objects = []
    for unit in ARM64_UNITS:  # the library's own ARM64 build: its units and flags
        obj = out / (unit.source + ".o")
        subprocess.run([CROSS_CC, *COMMON_FLAGS, *unit.flags, "-c", str(SOURCE_DIR / unit.source), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        objects.append(str(obj))
    binary = out / "neon_check"
    subprocess.run([CROSS_CC, "-O2", "-static", str(CHECK_SOURCE), *objects, "-o", str(binary), "-lm"],
                   check=True, capture_output=True, text=True)
    return binary


def run_check(binary: Path, cpu: str) -> tuple[int, list[str]]:
    done = subprocess.run([QEMU, "-cpu", cpu, str(binary)], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.splitlines()


def test_neon_and_dotprod_equal_the_portable_path_bit_for_bit(check_binary):
    code, lines = run_check(check_binary, "max")
    assert lines[0] == "best neon_dotprod", lines[:1]
    verdicts = {tuple(line.split()[:2]): line.split()[2] for line in lines[1:]}
    assert verdicts == {(t, isa): "equal" for t in TYPES for isa in ("neon", "neon_dotprod")}, "\n".join(lines)
    assert code == 0


def test_a_cpu_without_dot_products_runs_plain_neon(check_binary):
    code, lines = run_check(check_binary, "cortex-a53")
    assert lines[0] == "best neon", lines[:1]
    verdicts = {tuple(line.split()[:2]): line.split()[2] for line in lines[1:]}
    assert verdicts == {**{(t, "neon"): "equal" for t in TYPES}, **{(t, "neon_dotprod"): "unavailable:" for t in TYPES}}, "\n".join(lines)
    assert code == 0
