"""Shared fixtures: one edgepipe home per test session, with the bundled model imported once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from edgepipe.model.store import prepare_local_form, resolve


def _lowest_cpu_priority() -> None:
    """SCHED_IDLE: runs only on a core nothing else wants, and yields at once when a test wakes."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def pytest_collection_modifyitems(session, config, items):
    """Start ``test_sim_2000_schedules``'s schedules now, in a background process at the lowest
    CPU priority: they run on a virtual clock, so they can use whatever CPU the real-process tests
    leave idle (about a minute of two cores) and the test only collects the summary
    (``tests/test_sim.py``)."""
    if not any(item.nodeid.endswith("test_sim.py::test_sim_2000_schedules") for item in items):
        return
    from test_sim import SIM_FIRST, SIM_SCHEDULES

    out = Path(tempfile.mkdtemp(prefix="edgepipe-sim-")) / "summary.json"
    with open(out, "w") as stdout, open(out.with_suffix(".err"), "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "edgepipe.cluster.simulation.simrun", "--play", str(SIM_FIRST), str(SIM_SCHEDULES)],
                                stdout=stdout, stderr=stderr, preexec_fn=_lowest_cpu_priority, start_new_session=True)
    config.edgepipe_sim = (proc, out)


def pytest_unconfigure(config):
    background = getattr(config, "edgepipe_sim", None)
    if background is None:
        return
    proc, out = background
    if proc.poll() is None:  # the session ended first (interrupted, -x): stop the pool's processes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    shutil.rmtree(out.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("edgepipe-home")
    os.environ["EDGEPIPE_HOME"] = str(path)
    return path


@pytest.fixture(scope="session")
def native_pkg(home):
    """The bundled model as `edgepipe serve` and `edgepipe generate` run it by default: the file's
    own blocks, holding the form this machine's CPU workers are sent (`gguf` where the kernel
    library loads, else `native`: ``store.local_form`` names it for single-process references)."""
    pkg = resolve("smollm2", "native", home)
    prepare_local_form(pkg)
    return pkg


@pytest.fixture(scope="session")
def int4_pkg(home):
    """The bundled model re-quantized to int4 MatMulNBits, for tests about that kernel only."""
    return resolve("smollm2", "int4", home)


@pytest.fixture(scope="session")
def fp32_pkg(home):
    return resolve("smollm2", "fp32", home)


@pytest.fixture(scope="session")
def three_workers(home, native_pkg, tmp_path_factory):
    """One ``serve --workers 3 --placement memory`` shared by the API test modules (each start of
    a coordinator and three workers costs 20-40 s on two cores); its terminal in ``server.log``."""
    from harness import Server

    log = tmp_path_factory.mktemp("three-workers") / "serve.log"
    with Server(home, workers=3, args=("--placement", "memory"), log=log) as server:
        yield server


@pytest.fixture(scope="session")
def keyed_server(home, native_pkg):
    """One ``serve --workers 2 --placement memory --api-key sekrit --batch-invariant``: the Ollama
    API and the dashboard behind a key, and concurrent requests that must equal their solo tokens."""
    from harness import Server

    with Server(home, workers=2, args=("--placement", "memory", "--api-key", "sekrit", "--batch-invariant")) as server:
        yield server


@pytest.fixture(scope="session")
def three_workers_openai(three_workers):
    """The ``openai`` SDK pointed at ``three_workers``."""
    import openai

    return openai.OpenAI(base_url=three_workers.url + "/v1", api_key="unused", max_retries=0)
