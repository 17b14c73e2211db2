"""Issue 12, attack 4: the dashboard shows hostile worker names and event fields as text.

A worker joins named ``<img src=x onerror=...>`` and an unauthenticated peer sends a frame
whose bad tensor description is echoed into a ``refused`` event; in a real browser the
dashboard must show both as text, create no element from them and run no script."""

from __future__ import annotations

import struct
import time

import msgpack
import pytest
from websockets.sync.client import connect

from browser import browser_context
from edgepipe import PROTOCOL_VERSION
from harness import Server

HOSTILE_NAME = "<img src=x onerror=__xss=1>"
HOSTILE_TENSOR = "<img src=x onerror=__xss2=1>"


@pytest.mark.browser
def test_attack4_dashboard_renders_hostile_names_and_events_as_text(home, native_pkg):
    with Server(home, workers=1, args=("--placement", "memory")) as server:
        hostile = server.worker("--name", HOSTILE_NAME, "--threads", "1")
        try:
            server.wait_for(lambda s: any(w["name"] == HOSTILE_NAME for w in s["workers"]), 120)
            header = msgpack.packb({"type": "hello", "v": PROTOCOL_VERSION, "tensors": [[HOSTILE_TENSOR, "evil", [1]]]})
            with connect(server.url.replace("http://", "ws://") + "/v1/worker") as ws:  # no token, no valid hello
                ws.send(struct.pack("<I", len(header)) + header)
                ws.recv(timeout=10)
            with browser_context() as context:
                page = context.new_page()
                errors = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(server.url + "/")
                page.wait_for_selector("tr.device >> nth=1", timeout=30000)
                page.wait_for_function(f"document.getElementById('events').textContent.includes({HOSTILE_TENSOR!r})", timeout=30000)
                time.sleep(2.5)  # a few refreshes: a failed <img> fires onerror within milliseconds
                assert page.evaluate("[typeof window.__xss, typeof window.__xss2]") == ["undefined", "undefined"], "script ran"
                assert page.locator("#devices img, #events img, #timeline img").count() == 0
                assert HOSTILE_NAME in page.locator("#devices").inner_text()
                assert HOSTILE_TENSOR in page.locator("#events").inner_text()
                assert page.locator("#state").inner_text() == "up" and not errors, errors
        finally:
            hostile.terminate()
            hostile.wait(timeout=15)
