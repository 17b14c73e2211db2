"""Emulation: link-shaping arithmetic, the delaying relay on loopback, kernel rate caps in netns,
and the compute slowdown / memory budget helpers."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from edgepipe.emulate import netns
from edgepipe.emulate.netns import EmulationUnavailable, NetnsHost
from edgepipe.emulate.shaper import DelayRelay, LinkShape, ShapedLink, TokenBucket, parse_rate, shaped_send
from edgepipe.emulate.slowdown import MemoryBudget, MemoryBudgetExceeded, SlowdownPolicy, parse_bytes

pytestmark = pytest.mark.timeout(60)


# --- arithmetic ---------------------------------------------------------------------------------


def test_token_bucket_starts_full_then_paces_at_the_rate():
    bucket = TokenBucket(rate_bytes_per_s=1000, burst_bytes=500, clock=lambda: pytest.fail("clock used"))
    assert bucket.delay_for(500, now=0.0) == 0.0  # the burst goes at once
    assert bucket.delay_for(250, now=0.0) == pytest.approx(0.25)
    assert bucket.delay_for(250, now=0.0) == pytest.approx(0.5)  # queues behind the reservation
    assert bucket.delay_for(0, now=0.5) == pytest.approx(0.0)  # debt repaid by t = 0.5


def test_token_bucket_refills_only_up_to_the_burst():
    bucket = TokenBucket(rate_bytes_per_s=1000, burst_bytes=500)
    assert bucket.delay_for(500, now=0.0) == 0.0
    assert bucket.delay_for(1500, now=100.0) == pytest.approx(1.0)  # 500 banked, not 100 000


def test_token_bucket_uses_the_injected_clock_and_ignores_time_going_back():
    now = [10.0]
    bucket = TokenBucket(rate_bytes_per_s=100, burst_bytes=100, clock=lambda: now[0])
    assert bucket.delay_for(200) == pytest.approx(1.0)
    now[0] = 9.0
    assert bucket.delay_for(0) == pytest.approx(2.0)  # measured from 9.0, still owed until 11.0
    now[0] = 11.0
    assert bucket.delay_for(100) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("rate", "burst", "nbytes", "message"),
    [(0, 10, 1, "rate must be positive"), (10, 0, 1, "burst must be positive"), (10, 10, -1, "negative")],
)
def test_token_bucket_rejects_nonsense(rate, burst, nbytes, message):
    with pytest.raises(ValueError, match=message):
        TokenBucket(rate, burst).delay_for(nbytes, now=0.0)


def test_shaped_link_adds_delay_and_deterministic_loss_penalty():
    shape = LinkShape(delay_ms=40, rate_bytes_per_s=1000, burst_bytes=1000, loss=0.5)
    draws = [ShapedLink(shape, seed=7).send_delay(100, now=0.0) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # same seed, same first draw
    delays = [ShapedLink(shape, seed=seed).transit_delay() for seed in range(200)]
    assert {round(delay, 6) for delay in delays} == {0.04, 0.24}  # an RTO (200 ms floor) when lost
    assert 70 <= sum(delay > 0.1 for delay in delays) <= 130
    link = ShapedLink(LinkShape(delay_ms=40, rate_bytes_per_s=1000, burst_bytes=1000))
    assert link.send_delay(1000, now=0.0) == pytest.approx(0.04)
    assert link.send_delay(500, now=0.0) == pytest.approx(0.54)


def test_shaped_send_sleeps_delay_plus_pacing():
    link = ShapedLink(LinkShape(delay_ms=30, rate_bytes_per_s=10_000, burst_bytes=1000))

    async def two_sends() -> tuple[float, float]:
        started = time.monotonic()
        first = await shaped_send(link, 1000)
        second = await shaped_send(link, 1000)  # waits 0.1 s for the rate, then 0.03 s transit
        assert time.monotonic() - started >= first + second - 0.005
        return first, second

    first, second = asyncio.run(two_sends())
    assert first == pytest.approx(0.03)
    assert 0.03 + 0.05 < second <= 0.03 + 0.1 + 1e-9  # less the tokens refilled during the first sleep


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("128KB/s", 128_000),
        ("128 KB/s", 128_000),
        ("512KiB/s", 512 * 1024),
        ("1.5MB/s", 1_500_000),
        ("10Mbit", 1_250_000),
        ("10Mbit/s", 1_250_000),
        ("1mbit", 125_000),
        ("800kbit", 100_000),
        ("1Gbit", 125_000_000),
        ("100B/s", 100),
        ("2e3B/s", 2000),
        (4096, 4096),
        (0.5, 0.5),
    ],
)
def test_parse_rate(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10Mb", "ambiguous"),
        ("10mbps", "ambiguous"),
        ("fast", "expected a positive number"),
        ("", "expected a positive number"),
        ("-1KB/s", "expected a positive number"),
        ("10XB/s", "unknown prefix 'X'"),
        ("0", "positive"),
        (0, "positive"),
        (True, "cannot parse rate"),
        (None, "cannot parse rate"),
    ],
)
def test_parse_rate_errors_name_the_accepted_forms(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rate(text)


def test_link_shape_validates_and_labels_itself_as_emulated():
    shape = LinkShape.of(delay_ms=25, rate="1mbit", loss=0.01)
    assert shape == LinkShape(delay_ms=25, rate_bytes_per_s=125_000, loss=0.01)
    assert shape.emulated and "emulated" in shape.label() and "125 KB/s" in shape.label()
    for bad in (dict(delay_ms=-1), dict(rate_bytes_per_s=0), dict(loss=1.0), dict(loss=-0.1)):
        with pytest.raises(ValueError):
            LinkShape(**bad)


@pytest.mark.parametrize(
    ("size", "nbytes"),
    [
        ("1.5GB", 1_500_000_000),
        ("800MB", 800_000_000),
        ("512MiB", 512 * 2**20),
        ("2 GiB", 2 * 2**30),
        ("64kb", 64_000),
        ("100B", 100),
        ("1024", 1024),
        (1024, 1024),
        (0, 0),
    ],
)
def test_parse_bytes(size, nbytes):
    assert parse_bytes(size) == nbytes


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("1.5 GX", "unknown unit 'GX'"),
        ("lots", "expected"),
        ("-5MB", "expected"),
        ("", "expected"),
        (-5, ">= 0"),
        (1.5, "cannot parse"),
        (True, "cannot parse"),
    ],
)
def test_parse_bytes_errors(size, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(size)


def test_slowdown_policy_waits_factor_minus_one_times_compute():
    policy = SlowdownPolicy(3.0)
    assert policy.extra_wait(0.25) == pytest.approx(0.5)
    assert SlowdownPolicy(1).extra_wait(10.0) == 0.0
    assert policy.emulated and "emulated" in policy.label() and "x3" in policy.label()
    for bad in (0.5, 0, -2, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor"):
            SlowdownPolicy(bad)
    with pytest.raises(ValueError):
        policy.extra_wait(-1.0)


def test_slowdown_from_cpu_time_does_not_multiply_waiting_for_a_core():
    policy = SlowdownPolicy(8.0)
    # 10 ms of CPU that took 30 ms of wall (the core was shared): the call lasts 80 ms in all.
    assert policy.extra_wait(0.030, cpu_seconds=0.010) == pytest.approx(0.050)
    assert policy.extra_wait(0.010, cpu_seconds=0.010) == pytest.approx(policy.extra_wait(0.010))
    assert policy.extra_wait(0.5, cpu_seconds=0.01) == 0.0  # never negative
    assert SlowdownPolicy(1).extra_wait(0.03, cpu_seconds=0.01) == 0.0


def test_memory_budget_names_what_did_not_fit_and_the_numbers():
    budget = MemoryBudget.of("1GB")
    assert not budget.emulated and budget.label() == "memory budget 1 GB"  # a budget the user chose is a budget
    budget.check(600_000_000, "layers 0-11")
    budget.check(400_000_000, "KV cache", in_use_bytes=600_000_000)  # exactly full is fine
    with pytest.raises(MemoryBudgetExceeded) as refused:
        budget.check(500_000_000, "layers 12-23", in_use_bytes=600_000_000)
    message = str(refused.value)
    assert "layers 12-23" in message and "500000000" in message and "400000000" in message and "1 GB" in message
    assert (refused.value.requested_bytes, refused.value.in_use_bytes, refused.value.budget_bytes) == (
        500_000_000, 600_000_000, 1_000_000_000)
    with pytest.raises(ValueError):
        MemoryBudget(-1)


# --- DelayRelay on loopback ---------------------------------------------------------------------


async def _start_echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _read_exactly(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(nbytes), timeout=10)


def test_relay_delays_each_direction_by_the_one_way_delay():
    async def scenario() -> list[float]:
        server = await _start_echo_server()
        relay = await DelayRelay.start("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1],
                                       LinkShape(delay_ms=50))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            round_trips = []
            for i in range(3):
                message = f"ping {i}\n".encode()
                started = time.monotonic()
                writer.write(message)
                assert await _read_exactly(reader, len(message)) == message
                round_trips.append(time.monotonic() - started)
            writer.close()
            await writer.wait_closed()
            assert relay.bytes_forwarded.to_target == relay.bytes_forwarded.to_client == 3 * len(b"ping 0\n")
            return round_trips
        finally:
            await relay.close()
            server.close()

    for round_trip in asyncio.run(scenario()):
        assert 0.100 <= round_trip < 0.300


def test_relay_pipelines_delay_instead_of_serialising_it():
    async def scenario() -> float:
        server = await _start_echo_server()
        relay = await DelayRelay.start("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1],
                                       LinkShape(delay_ms=50))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            started = time.monotonic()
            for i in range(20):  # one message every 10 ms: 20 round trips in flight over 0.2 s
                writer.write(b"%03d" % i)
                await asyncio.sleep(0.01)
            echoed = await _read_exactly(reader, 60)
            elapsed = time.monotonic() - started
            assert echoed == b"".join(b"%03d" % i for i in range(20))  # order preserved
            writer.close()
            return elapsed
        finally:
            await relay.close()
            server.close()

    elapsed = asyncio.run(scenario())
    assert 0.29 <= elapsed < 0.6  # serialised it would be 20 x 0.1 s


def test_relay_paces_to_the_rate_and_keeps_bytes_intact_both_ways():
    payload = hashlib.sha256(b"seed").digest() * (512 * 1024 // 32)  # 512 KiB

    async def scenario() -> float:
        server = await _start_echo_server()
        relay = await DelayRelay.start("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1],
                                       LinkShape.of(rate="256KB/s"))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            started = time.monotonic()
            receive = asyncio.create_task(_read_exactly(reader, len(payload)))
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            echoed = await receive
            elapsed = time.monotonic() - started
            assert echoed == payload
            assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # half-close passed through
            assert relay.bytes_forwarded.to_target == relay.bytes_forwarded.to_client == len(payload)
            writer.close()
            return elapsed
        finally:
            await relay.close()
            server.close()

    elapsed = asyncio.run(scenario())
    # Each direction is paced separately and the echo overlaps them: ~(512 KiB - burst) / 256 KB/s.
    assert 1.5 <= elapsed < 4.0


def test_relay_carries_websocket_traffic():
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve

    async def echo(websocket) -> None:
        async for message in websocket:
            await websocket.send(message)

    async def scenario() -> float:
        async with serve(echo, "127.0.0.1", 0) as server:
            target_port = next(iter(server.sockets)).getsockname()[1]
            relay = await DelayRelay.start("127.0.0.1", 0, "127.0.0.1", target_port, LinkShape(delay_ms=20))
            try:
                async with connect(f"ws://127.0.0.1:{relay.port}") as websocket:
                    blob = os.urandom(100_000)
                    started = time.monotonic()
                    await websocket.send(blob)
                    assert await asyncio.wait_for(websocket.recv(), timeout=10) == blob
                    return time.monotonic() - started
            finally:
                await relay.close()

    assert 0.040 <= asyncio.run(scenario()) < 0.5


def test_relay_close_cuts_open_connections():
    async def scenario() -> None:
        server = await _start_echo_server()
        relay = await DelayRelay.start("127.0.0.1", 0, "127.0.0.1", server.sockets[0].getsockname()[1],
                                       LinkShape(delay_ms=10))
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(b"x")
        assert await _read_exactly(reader, 1) == b"x"
        await asyncio.wait_for(relay.close(), timeout=5)
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()
        server.close()

    asyncio.run(scenario())


# --- kernel rate caps in a network namespace ----------------------------------------------------

_NETNS_UNAVAILABLE = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(_NETNS_UNAVAILABLE is not None, reason=f"netns emulation: {_NETNS_UNAVAILABLE}")

_TRANSFER_BYTES = 256 * 1024
_SERVER_PORT = 5201
# Runs inside the namespace: send the payload, then hash what comes back and report it.
_TRANSFER_SERVER = textwrap.dedent(
    """
    import hashlib, socket, sys
    host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1)
    print("ready", flush=True)
    connection, _ = listener.accept()
    connection.sendall(bytes(range(256)) * (size // 256))
    digest, received = hashlib.sha256(), 0
    while received < size:
        chunk = connection.recv(65536)
        if not chunk:
            break
        digest.update(chunk)
        received += len(chunk)
    connection.sendall(f"{digest.hexdigest()} {received}\\n".encode())
    connection.close()
    """
)
_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((sys.argv[1], int(sys.argv[2])))
    listener.listen(1)
    print("ready", flush=True)
    connection, _ = listener.accept()
    while chunk := connection.recv(65536):
        connection.sendall(chunk)
    """
)


def _start_in(host: NetnsHost, script: str, *args: object):
    server = host.popen([sys.executable, "-c", script, host.ip, *map(str, args)],
                        stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def _receive_exactly(connection: socket.socket, nbytes: int) -> bytes:
    parts, received = [], 0
    while received < nbytes:
        chunk = connection.recv(min(65536, nbytes - received))
        assert chunk, f"connection closed after {received} of {nbytes} bytes"
        parts.append(chunk)
        received += len(chunk)
    return b"".join(parts)


@pytest.mark.netns
@needs_netns
def test_netns_host_caps_the_rate_both_ways_and_leaves_nothing_behind():
    namespaces_before = set(netns.list_namespaces())
    host = NetnsHost("emutest", ip="10.213.201.2", peer_ip="10.213.201.1", rate="1mbit")
    assert host.emulated and "emulated" in host.label()
    with host:
        assert host.namespace in netns.list_namespaces()
        server = _start_in(host, _TRANSFER_SERVER, _SERVER_PORT, _TRANSFER_BYTES)
        with socket.create_connection((host.ip, _SERVER_PORT), timeout=20) as connection:
            started = time.monotonic()
            downloaded = _receive_exactly(connection, _TRANSFER_BYTES)
            download_bits_per_s = _TRANSFER_BYTES * 8 / (time.monotonic() - started)
            assert downloaded == bytes(range(256)) * (_TRANSFER_BYTES // 256)

            upload = hashlib.sha256(b"up").digest() * (_TRANSFER_BYTES // 32)
            started = time.monotonic()
            connection.sendall(upload)
            report = connection.makefile().readline().split()
            upload_bits_per_s = _TRANSFER_BYTES * 8 / (time.monotonic() - started)
            assert report == [hashlib.sha256(upload).hexdigest(), str(_TRANSFER_BYTES)]
        assert server.wait(10) == 0
    print(f"netns 1mbit: down {download_bits_per_s / 1e6:.3f} Mbit/s, up {upload_bits_per_s / 1e6:.3f} Mbit/s")
    assert download_bits_per_s < 1.5e6
    assert upload_bits_per_s < 1.5e6
    assert host.namespace not in netns.list_namespaces()
    assert set(netns.list_namespaces()) <= namespaces_before
    assert not netns.link_exists(host.host_veth)


@pytest.mark.netns
@needs_netns
def test_netns_host_behind_a_delay_relay_and_crash_leftovers_are_removed():
    crashed = NetnsHost("emutest2", ip="10.213.202.2", peer_ip="10.213.202.1")
    crashed.__enter__()  # never exited, as if the previous run died
    with NetnsHost("emutest2", ip="10.213.202.2", peer_ip="10.213.202.1", rate="10Mbit") as host:
        _start_in(host, _ECHO_SERVER, _SERVER_PORT)

        async def round_trip() -> float:
            relay = await DelayRelay.start("127.0.0.1", 0, host.ip, _SERVER_PORT, LinkShape(delay_ms=30))
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
                started = time.monotonic()
                writer.write(b"hello")
                assert await _read_exactly(reader, 5) == b"hello"
                elapsed = time.monotonic() - started
                writer.close()
                return elapsed
            finally:
                await relay.close()

        assert 0.060 <= asyncio.run(round_trip()) < 0.3
    assert host.namespace not in netns.list_namespaces()


def test_netns_host_refuses_without_root_and_outside_the_emulation_block(monkeypatch):
    with pytest.raises(ValueError, match="10.213.0.0/16"):
        NetnsHost("x", ip="192.168.1.2", peer_ip="192.168.1.1")
    with pytest.raises(ValueError, match="not in one /30 subnet"):
        NetnsHost("x", ip="10.213.1.2", peer_ip="10.213.2.1")
    with pytest.raises(ValueError, match="broadcast"):
        NetnsHost("x", ip="10.213.1.3", peer_ip="10.213.1.1")
    with pytest.raises(ValueError, match="characters"):
        NetnsHost("much-too-long-name", ip="10.213.1.2", peer_ip="10.213.1.1")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationUnavailable, match="root"):
        with NetnsHost("x", ip="10.213.1.2", peer_ip="10.213.1.1", rate="1mbit"):
            pass
