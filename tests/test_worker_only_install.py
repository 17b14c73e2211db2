"""A worker-only install (issue 31): edgepipe without extras in a fresh virtual environment.

``pip install`` of this checkout with no extras (the README's install for a device) into a new
venv without the system's site packages: ``edgepipe worker --help`` works, and a command that
needs the coordinator's extras (``generate``, ``import``) says so in one line naming the extra
and the pip command, with exit status 2 and no traceback. Dependencies come from pip's cache or
the local wheel index (~20 s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("worker-only")
    source = work / "src"  # a copy, so the build leaves nothing in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "edgepipe", source / "edgepipe", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env_dir = work / "venv"
    # The venv gets no pip of its own (ensurepip costs ~6 s): this interpreter's pip installs into
    # it with --python. --no-compile skips byte-compiling numpy, onnxruntime, pygments... (~5 s):
    # what is installed, and from where, is unchanged.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                           "--disable-pip-version-check", str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return env_dir


def run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return subprocess.run([str(venv / "bin" / "edgepipe"), *args], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def test_the_venv_has_no_coordinator_libraries(venv):
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import onnx"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'onnx'" in probe.stderr
    numpy = subprocess.run([str(venv / "bin" / "python"), "-c", "import onnxruntime, numpy, websockets"], capture_output=True, text=True)
    assert numpy.returncode == 0, numpy.stderr  # the worker's own needs are there


def test_worker_help_works(venv):
    done = run(venv, "worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "--coordinator" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize("args", [("generate", "hi"), ("import", "model.gguf"), ("serve",)])
def test_coordinator_commands_say_which_extra_in_one_line(venv, args):
    done = run(venv, *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr and not done.stdout, done.stderr
    assert f"edgepipe {args[0]}" in lines[0] and "'server' extra" in lines[0] and "pip install 'edgepipe[server]'" in lines[0], lines[0]
