"""Workers find a coordinator by mDNS and must present the join token when one is set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness import Server


@pytest.mark.slow
def test_native_worker_finds_coordinator_by_mdns(home, native_pkg):
    cluster = f"test-{os.getpid()}"  # other coordinators may be announcing on this host
    with Server(home, workers=0, args=("--min-workers", "1", "--cluster", cluster), wait_up=False) as server:
        finder = subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--name", "finder", "--discover-timeout", "20",
                                   "--cluster", cluster],
                                  env={**os.environ, "EDGEPIPE_HOME": str(home)}, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and any(w["name"] == "finder" for w in s["workers"]), timeout=60)
            assert status["plan"]["stages"][0]["worker"].endswith("finder")
            r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 200
        finally:
            finder.terminate()
            finder.wait(timeout=10)


@pytest.fixture(scope="module")
def guarded(home, native_pkg):
    with Server(home, workers=1, args=("--join-token", "letmein")) as server:
        yield server


@pytest.mark.parametrize("token", [None, "wrong"])
def test_native_worker_without_the_right_token_is_refused(guarded, token):
    server = guarded
    refused_before = sum(e["kind"] == "refused" for e in server.client.get("/v1/cluster/events").json()["events"])
    args = ("--name", "intruder") + (("--join-token", token) if token else ())
    intruder = server.worker(*args)
    _, stderr = intruder.communicate(timeout=60)
    assert intruder.returncode != 0
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    expected = "wrong or missing join token" if token else "missing join token"
    assert lines[-1].startswith("error:") and expected in lines[-1]
    assert all(w["name"] != "intruder" for w in server.status()["workers"])
    events = server.client.get("/v1/cluster/events").json()["events"]
    assert sum(e["kind"] == "refused" for e in events) > refused_before
    # the server keeps serving with its rightful worker
    assert server.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}).status_code == 200
