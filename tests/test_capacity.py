"""Too little memory left: a bounded wait, a 503 that says why, and service again once room joins (issue 11).

Two real worker processes with a declared budget of 200 MB each hold the bundled model between
them (132 MB of weights + 94 MB of KV room + 64 MiB runtime each); one alone cannot. One is
SIGKILLed: a request then gets a 503 naming what the workers hold and what the model needs,
within ``--capacity-wait`` plus a margin, and no admission slot stays taken. A request sent
while a third worker with room joins waits for it and completes with the single-process tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams
from edgepipe.model.store import local_form

from harness import Server

PROMPT = "Name three colours."
N_TOKENS = 12
CAPACITY_WAIT_S = 10.0  # the worker with room must only join (not be up) within it
MEMORY = "200MB"


def _body() -> dict:
    return {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def _worker(server: Server, name: str, home, log) -> subprocess.Popen:
    env = {**os.environ, "EDGEPIPE_HOME": str(home)}
    env.pop("EDGEPIPE_JOIN_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", server.url, "--name", name,
                             "--threads", "1", "--memory", MEMORY], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)


def test_a_lost_worker_that_leaves_too_little_memory_gives_a_503_then_room_brings_service_back(native_pkg, home, tmp_path):
    tok = native_pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    reference = generate(native_pkg.pipeline(precision=local_form(native_pkg)), ids, GenerationParams(max_tokens=N_TOKENS, ignore_eos=True), tok.decode,
                         native_pkg.manifest.eos_ids).tokens
    procs: list[subprocess.Popen] = []
    with open(tmp_path / "workers.log", "w") as log, \
            Server(home, workers=0, args=("--min-workers", "2", "--capacity-wait", str(CAPACITY_WAIT_S), "--placement", "memory"),
                   wait_up=False) as server:
        try:
            procs += [_worker(server, name, home, log) for name in ("a", "b")]
            server.wait_for(lambda s: s["state"] == "up" and len(s["workers"]) == 2, 180)
            r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference

            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=CAPACITY_WAIT_S + 120)
            waited = time.monotonic() - t0
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "lacks capacity" in message and "not enough memory" in message and "1 connected worker" in message, message
            assert "\n" not in message
            # the wait is bounded: the capacity wait, plus the loss detection and a margin for a loaded machine
            assert CAPACITY_WAIT_S <= waited < CAPACITY_WAIT_S + 45, waited
            status = server.status()
            assert status["requests_in_flight"] == 0 and status["admission"]["active"] == 0 and status["admission"]["queued"] == 0

            result: dict = {}

            def ask() -> None:
                reply = httpx.post(server.url + "/v1/chat/completions", json=_body(), timeout=300)
                result["status"], result["json"] = reply.status_code, reply.json()

            waiting = threading.Thread(target=ask)
            waiting.start()
            procs.append(_worker(server, "c", home, log))  # a worker with room joins while the request waits
            waiting.join(300)
            assert not waiting.is_alive()
            assert result["status"] == 200, result["json"]
            assert result["json"]["choices"][0]["token_ids"] == reference
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
