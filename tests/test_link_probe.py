"""Workers measure their links to each other on the data-port path (real processes).

Two workers join a coordinator; one shapes what it sends (EMULATED: 25 ms one-way and 2 MB/s,
user-space). At join they probe each other's data port (authenticated with a probe secret the
coordinator issues) and report round trip and bandwidth; the coordinator keeps them in its
link matrix. A forged probe connection (no secret) is refused before any frame is read.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest

from harness import Server


def _events(server: Server) -> list[dict]:
    return server.client.get("/v1/cluster/events").json()["events"]


def test_workers_report_measured_neighbour_links(home, int4_pkg):
    token = secrets.token_hex(8)
    with Server(home, workers=0, wait_up=False, args=("--join-token", token, "--min-workers", "2")) as server:
        procs = [server.worker("--join-token", token, "--name", "plain", "--threads", "1"),
                 server.worker("--join-token", token, "--name", "shaped", "--threads", "1", "--link-delay-ms", "25",
                               "--link-rate", "2MB/s")]
        try:
            deadline = time.monotonic() + 120
            measured: dict[tuple[str, str], dict] = {}
            while time.monotonic() < deadline and len(measured) < 2:
                names = {w["id"]: w["name"] for w in server.status()["workers"]}
                measured = {(names.get(e["src"]), names.get(e["dst"])): e for e in _events(server) if e["kind"] == "link_measured"}
                time.sleep(0.3)
            assert set(measured) == {("plain", "shaped"), ("shaped", "plain")}, [e for e in _events(server) if "link" in e["kind"]]
            out, back = measured[("shaped", "plain")], measured[("plain", "shaped")]
            # the shaped worker's frames (and its echoes) wait 25 ms: either round trip holds one such wait
            assert 25 <= out["rtt_ms"] < 150 and 25 <= back["rtt_ms"] < 150
            # what it sends is paced at 2 MB/s; what the plain one sends is not
            assert 1.2 < out["mb_s"] < 3.0, out
            assert back["mb_s"] > 3.0, back
            # a connection to the data port without the probe secret is refused in the handshake
            url = next(w["data_url"] for w in server.status()["workers"] if w["name"] == "plain")
            assert asyncio.run(_forged(url)) == 401
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=15)
                except Exception:  # noqa: BLE001
                    p.kill()


async def _forged(url: str) -> int | None:
    import websockets

    try:
        async with websockets.connect(url, additional_headers={"X-Edgepipe-Plan": "0", "Authorization": "Bearer nope"},
                                      open_timeout=5):
            return 101
    except websockets.exceptions.InvalidStatus as exc:
        return exc.response.status_code


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
