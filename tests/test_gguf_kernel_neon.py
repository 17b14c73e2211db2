"""The ARM64 NEON kernels, cross-compiled and run under emulation: every block type, plain NEON and
NEON with dot products, equal to the portable path bit for bit (one row and a batch of 11), and the
run-time choice following the CPU (a Cortex-A53 has no dot product; `-cpu max` has it). The fp16-KV
attention's NEON and portable C loops against the numpy reference, its cache bit for bit.

Needs Debian's gcc-aarch64-linux-gnu and qemu-user, which `scripts/bootstrap.sh test` installs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from edgepipe.native.build import ARM64_UNITS, COMMON_FLAGS, SOURCE_DIR
from edgepipe.native.quant_types import QUANT_TYPES

CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
CHECK_SOURCE = Path(__file__).parent / "native" / "neon_check.c"
ATTENTION_CHECK_SOURCE = Path(__file__).parent / "native" / "kv_attention_check.c"
TYPES = [t.name for t in QUANT_TYPES]  # neon_check.c writes blocks of each (it names them: a row missing there fails here)


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
    subprocess.run([CROSS_CC, "-O2", "-static", f"-I{SOURCE_DIR}", str(ATTENTION_CHECK_SOURCE), *objects, "-o", str(out / "kv_attention_check"),
                    "-lm"], check=True, capture_output=True, text=True)
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


@pytest.mark.parametrize("kernels", ["portable", "neon"])
@pytest.mark.parametrize("case", [dict(window=-1, do_rotary=1, interleaved=0, softcap=0.0),
                                  dict(window=6, do_rotary=0, interleaved=0, softcap=30.0),
                                  dict(window=-1, do_rotary=1, interleaved=1, softcap=0.0)])
def test_fp16_kv_attention_on_arm64(check_binary, tmp_path, case, kernels):
    import numpy as np
    from test_kv_attention import check, random_case, reference, tables

    batch, seq, heads, kv_heads, dim, capacity = 2, 3, 14, 2, 64, 24
    rng = np.random.default_rng(17)
    qkv, key, value, lengths = random_case(rng, batch, seq, heads, kv_heads, dim, capacity, [9, 20])
    cos, sin = tables(64, dim // 2) if case["do_rotary"] else (np.zeros((64, 1), np.float32),) * 2  # (the case file's tables: width 1 unrotated)
    scale = 1 / np.sqrt(dim)
    header = np.array([batch, seq, heads, kv_heads, dim, capacity, 64, dim // 2 if case["do_rotary"] else 0, case["interleaved"],
                       case["window"]], np.int64).tobytes() + np.array([scale, case["softcap"]], np.float32).tobytes()
    (tmp_path / "case.bin").write_bytes(header + b"".join(a.tobytes() for a in (qkv, lengths, cos, sin, key, value)))
    done = subprocess.run([QEMU, "-cpu", "max", str(check_binary.parent / "kv_attention_check"), str(tmp_path / "case.bin"),
                           str(tmp_path / "out.bin"), kernels], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    raw = (tmp_path / "out.bin").read_bytes()
    n_out = batch * seq * heads * dim * 4
    got = np.frombuffer(raw[:n_out], np.float32).reshape(batch, seq, heads * dim)
    got_key, got_value = np.frombuffer(raw[n_out:], np.uint16).reshape(2, batch, kv_heads, capacity, dim)
    want, want_key, want_value = reference(qkv, key, value, lengths, heads, kv_heads, rotary=bool(case["do_rotary"]),
                                           interleaved=bool(case["interleaved"]), window=case["window"], scale=scale, softcap=case["softcap"])
    assert np.array_equal(got_key, want_key.view(np.uint16)) and np.array_equal(got_value, want_value.view(np.uint16))
    check(got, want)
