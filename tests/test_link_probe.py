"""Workers measure their links to each other on the data-port path (real processes).

Two workers join a coordinator; one shapes what it sends (EMULATED: 25 ms one-way and 2 MB/s,
user-space). At join they probe each other's data port (authenticated with a probe secret the
coordinator issues) and report round trip and bandwidth; the coordinator keeps them in its
link matrix. A forged probe connection (no secret) is refused before any frame is read.

With root: a worker in a network namespace whose coordinator link and worker links are capped
by the kernel at different rates (``netns.shape_by_port``) measures each at its own rate.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time

import pytest

from harness import Server

from edgepipe.emulate import netns


def _events(server: Server) -> list[dict]:
    return server.client.get("/v1/cluster/events").json()["events"]


def test_workers_report_measured_neighbour_links(home, native_pkg):
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


_NETNS_UNAVAILABLE = netns.unavailable_reason()


# -m slow: its rate bounds need a quiet machine (it failed three times at load 5+, never below);
# the default suite keeps the kernel shaping (test_emulate) and the probes (the test above).
@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(_NETNS_UNAVAILABLE is not None, reason=f"netns emulation: {_NETNS_UNAVAILABLE}")
def test_kernel_shaped_worker_links_measure_their_own_rate(home, native_pkg):
    """Coordinator link 4 MB/s, worker links 256 KB/s (wire rates; a TCP payload gets 524/590 of
    them through MTU 576): the workers' probes and the coordinator's uplink probe each see theirs."""
    token = secrets.token_hex(8)
    name = f"lp{os.getpid() % 100000}"
    host = netns.NetnsHost(name, ip="10.213.202.2", peer_ip="10.213.202.1")
    with Server(home, workers=0, wait_up=False, args=("--join-token", token, "--min-workers", "2", "--host", "0.0.0.0")) as server, host:
        netns.shape_by_port(host, server.port, "4MB/s", "256KB/s")
        env = {**os.environ, "EDGEPIPE_HOME": str(home)}
        env.pop("EDGEPIPE_JOIN_TOKEN", None)
        inside = host.popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", f"http://{host.peer_ip}:{server.port}",
                             "--host", host.ip, "--join-token", token, "--name", "inside", "--threads", "1"],
                            env=env, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outside = server.worker("--join-token", token, "--name", "outside", "--threads", "1", "--host", "0.0.0.0",
                                "--advertise", host.peer_ip)
        try:
            deadline = time.monotonic() + 150
            measured: dict[tuple[str, str], dict] = {}
            uplinks: dict[str, float] = {}
            while time.monotonic() < deadline and not (len(measured) == 2 and "inside" in uplinks):
                names = {w["id"]: w["name"] for w in server.status()["workers"]}
                events = _events(server)
                measured = {(names.get(e["src"]), names.get(e["dst"])): e for e in events if e["kind"] == "link_measured"}
                uplinks = {names.get(e["worker"]): e["uplink_mb_s"] for e in events if e["kind"] == "calibrated"}
                time.sleep(0.5)
            assert set(measured) == {("inside", "outside"), ("outside", "inside")}, [e for e in _events(server) if "link" in e["kind"]]
            payload_share = (576 - 52) / (576 + 14)
            print("kernel-shaped links, MB/s:", {f"{a}->{b}": e["mb_s"] for (a, b), e in measured.items()}, "uplink", uplinks)
            for pair, e in measured.items():  # both directions of the worker link, at 256 KB/s of frames
                assert 0.8 < e["mb_s"] / (0.256 * payload_share) < 1.15, (pair, e)
            # the coordinator link of the same namespace is 16x faster: its own class. The uplink probe
            # (two timed transfers over the control channel) read 3.4-3.5 MB/s in most runs and once
            # 8.3 on this 4 MB/s class (a clean-clone CI run): within 2.5x, and far from the worker link.
            assert 0.5 < uplinks["inside"] / (4.0 * payload_share) < 2.5, uplinks
            assert uplinks["inside"] > 4 * max(e["mb_s"] for e in measured.values()), (uplinks, measured)
            counted = netns.port_shaped_bytes(host)
            assert all(counted[way]["port"] > 0 and counted[way]["other"] > 0 for way in ("into", "out of")), counted
        finally:
            outside.terminate()
            try:
                outside.wait(timeout=15)
            except subprocess.TimeoutExpired:
                outside.kill()
    assert netns.namespace_name(name) not in netns.list_namespaces()  # its namespace is gone (others may run beside it)


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
