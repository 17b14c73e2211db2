"""`edgepipe serve` as an operator sees it, with real processes: its terminal says what the
cluster does (the operator log), and Ctrl-C during a stream stops it in one line, ending the
stream with its API's error event and stopping the local workers without restarting them."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx

from harness import Server


def _stream(url: str, path: str, body: dict, lines: list[str], errors: list[BaseException]) -> None:
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a restarted worker names serve's URL)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_ctrl_c_during_streams_ends_them_with_an_error_event_and_stops_the_workers(home, native_pkg, tmp_path):
    log = tmp_path / "serve.log"
    server = Server(home, workers=2, log=log)
    try:
        pids = [w["pid"] for w in server.status()["workers"]]
        assert len(pids) == 2
        ask = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        openai, ollama, errors = [], [], []
        threads = [threading.Thread(target=_stream, args=(server.url, "/v1/chat/completions",
                                                          {"model": "smollm2", "stream": True, "messages": [{"role": "user", "content": "Tell a story."}], **ask},
                                                          openai, errors)),
                   threading.Thread(target=_stream, args=(server.url, "/api/generate",
                                                          {"model": "smollm2", "prompt": "Tell a story.", "stream": True,
                                                           "options": {"num_predict": 4000, "temperature": 0}}, ollama, errors))]
        for t in threads:
            t.start()
        _wait(lambda: len(openai) >= 4 and len(ollama) >= 3, 60, "both streams to be under way")
        os.killpg(server.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        for t in threads:
            t.join(30)
        assert not errors, errors  # neither stream was cut
        assert server.proc.wait(30) == 130  # 128 + SIGINT, as a shell reports an interrupted command
        assert openai[-1] == "data: [DONE]"
        error = json.loads(openai[-2].removeprefix("data: "))["error"]
        assert "stopping" in error["message"], error
        last = json.loads(ollama[-1])
        assert "stopping" in last["error"] and not last.get("done"), last
        text = log.read_text()
        assert "Traceback" not in text and "CancelledError" not in text, text
        assert len(re.findall(r"^edgepipe: SIGINT: stopping 2 local workers; 2 open requests ended with an error$", text, re.M)) == 1, text
        assert "restarting" not in text, text
        assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
        assert _processes_naming(server.url) == []  # and none started again
    finally:
        server.close()


def test_the_serve_terminal_says_joins_and_plans(three_workers):
    plan = three_workers.status()["plan"]["id"]
    text = _wait(lambda: next((t for t in [three_workers.log.read_text()] if f"plan {plan} serving" in t), None), 30, "the serving line")
    for name in ("local1", "local2", "local3"):
        assert re.search(rf"edgepipe\.coordinator INFO w\d+-{name} joined", text), text
    assert re.search(rf"edgepipe\.coordinator INFO preparing plan {plan}: w\d+-local\d \[0, ", text), text
    assert re.search(rf"edgepipe\.coordinator INFO plan {plan} serving", text), text
