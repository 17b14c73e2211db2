"""Shared fixtures: one edgepipe home per test session, with the bundled model imported once."""

from __future__ import annotations

import os

import pytest

from edgepipe.model.store import resolve


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("edgepipe-home")
    os.environ["EDGEPIPE_HOME"] = str(path)
    return path


@pytest.fixture(scope="session")
def int4_pkg(home):
    return resolve("smollm2", "int4", home)


@pytest.fixture(scope="session")
def fp32_pkg(home):
    return resolve("smollm2", "fp32", home)


@pytest.fixture(scope="session")
def three_workers(home, int4_pkg):
    """One ``serve --workers 3 --placement memory`` shared by the API test modules (each start of
    a coordinator and three workers costs 20-40 s on two cores)."""
    from harness import Server

    with Server(home, workers=3, args=("--placement", "memory")) as server:
        yield server


@pytest.fixture(scope="session")
def keyed_server(home, int4_pkg):
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
