"""Issue 12, encryption: ``serve --tls`` (a self-signed certificate made on first run) serves a
request through 3 workers over https/wss with exactly the single-process tokens; workers pin
the certificate's fingerprint and a worker with the wrong pin is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from edgepipe.net import tls
from harness import free_port
from test_distributed import reference_tokens

PROMPT = "Explain recursion in one sentence."


@pytest.fixture(scope="module")
def tls_server(home, native_pkg):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "EDGEPIPE_TLS_FINGERPRINT"}
    env["EDGEPIPE_HOME"] = str(home)
    proc = subprocess.Popen([sys.executable, "-m", "edgepipe", "serve", "--workers", "3", "--port", str(port), "--tls", "--placement", "memory",
                             "--model", "smollm2", "--no-advertise", "--join-token", "tls-join"], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    cert = home / "tls" / "cert.pem"
    try:
        deadline = time.monotonic() + 240
        client = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            if client is None and cert.is_file():
                client = httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=tls.trusting(cert.read_text()), timeout=120)
            try:
                status = client.get("/v1/cluster/status").json() if client else None
                if status and status["state"] == "up" and len(status["workers"]) == 3:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise TimeoutError("the TLS cluster did not come up")
        yield client, port, tls.fingerprint_pem(cert.read_text())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_tls_three_workers_serve_exactly_the_single_process_tokens(tls_server, native_pkg):
    client, port, _ = tls_server
    status = client.get("/v1/cluster/status").json()
    assert len(status["plan"]["stages"]) == 3
    assert all(w["data_url"].startswith("wss://") for w in status["workers"]), [w["data_url"] for w in status["workers"]]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0,
                                                  "return_token_ids": True})
    assert r.status_code == 200, r.text
    expected = [t for t in reference_tokens(native_pkg, PROMPT, 32) if t not in native_pkg.manifest.eos_ids]
    assert r.json()["choices"][0]["token_ids"] == expected
    with pytest.raises(httpx.HTTPError):  # nothing in the clear
        httpx.get(f"http://127.0.0.1:{port}/v1/cluster/status", timeout=5)


def test_tls_worker_with_the_wrong_pin_is_refused(tls_server, home):
    _, port, fingerprint = tls_server
    wrong = ("0" if fingerprint[0] != "0" else "1") + fingerprint[1:]
    env = {**os.environ, "EDGEPIPE_HOME": str(home), "EDGEPIPE_JOIN_TOKEN": "tls-join"}
    worker = subprocess.run([sys.executable, "-m", "edgepipe", "worker", "--coordinator", f"https://127.0.0.1:{port}", "--name", "mitm",
                             "--tls-fingerprint", wrong], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert worker.returncode != 0 and "fingerprint" in worker.stderr, worker.stderr[-500:]


def _make_and_fingerprint(directory, results):
    cert, key = tls.make_self_signed(directory)
    tls.server_context(cert, key)  # the key matches the certificate
    results.put(tls.fingerprint_pem(cert.read_text()))


def test_workers_sharing_a_home_make_one_certificate(tmp_path):
    """Local workers start together on one home: each must serve the certificate whose
    fingerprint it announces (a race once made two, and a neighbour's pin failed in CI)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_make_and_fingerprint, args=(tmp_path / "tls", results)) for _ in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    fingerprints = [results.get(timeout=5) for _ in processes]
    assert len(set(fingerprints)) == 1, fingerprints
