"""A worker stops with one line on mistakes retrying cannot fix, and keeps retrying where the
coordinator may come back (issue 42, item 8).

The worker is the real ``Worker`` in process (and, for the one line and the exit status, a real
``edgepipe worker`` process); the servers it meets are real too, in the test's loop: uvicorn
with a Starlette app built the coordinator's way (a worker socket at ``/v1/worker``, a 401 and a
503 before the upgrade, a WebSocket that answers the hello in another protocol), Python's own
``http.server`` (a web server that is no edgepipe), and a port nobody listens on.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import socket
import struct
import subprocess
import sys
import threading

import msgpack
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import WebSocketRoute

from edgepipe.net.protocol import Message, MessageType, encode
from edgepipe.serve import bind_socket
from edgepipe.worker import Worker, WorkerSettings
from edgepipe.worker.connect import CannotJoin, Retry, Stop, coordinator_base, control_url, verdict


async def _refuse(ws, code: int) -> None:
    await ws.send_denial_response(PlainTextResponse("no", status_code=code))


async def _other_protocol(ws) -> None:
    await ws.accept()
    await ws.receive()
    await ws.send_bytes(b"\x00\x00\x00\x00not msgpack, not edgepipe")
    await ws.close()


async def _newer_edgepipe(ws) -> None:
    await ws.accept()
    await ws.receive()
    welcome = bytearray(encode(Message(MessageType.WELCOME, {"worker_id": "w1"})))  # sent with another protocol version
    (n,) = struct.unpack_from("<I", welcome)
    header = msgpack.unpackb(bytes(welcome[4:4 + n]))
    header["v"] = 99
    packed = msgpack.packb(header)
    await ws.send_bytes(struct.pack("<I", len(packed)) + packed + bytes(welcome[4 + n:]))
    await ws.close()


APP = Starlette(routes=[
    WebSocketRoute("/other/v1/worker", _other_protocol),
    WebSocketRoute("/newer/v1/worker", _newer_edgepipe),
    WebSocketRoute("/p401/v1/worker", lambda ws: _refuse(ws, 401)),
    WebSocketRoute("/p503/v1/worker", lambda ws: _refuse(ws, 503)),
])  # any other path: Starlette refuses the upgrade with 403, as the coordinator's app does


class Servers:
    """Servers in the test's loop: ``uvicorn`` (the app above) and a plain ``http.server``."""

    async def __aenter__(self):
        import uvicorn

        sock = bind_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(APP, log_level="critical", ws_ping_interval=None))
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        self.web.RequestHandlerClass.log_message = lambda *a: None
        threading.Thread(target=self.web.serve_forever, daemon=True).start()
        self.web_port = self.web.server_address[1]
        return self

    async def __aexit__(self, *exc):
        self.web.shutdown()
        self.server.should_exit = True
        await self.task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def attempt(tmp_path, coordinator: str, seconds: float = 10.0, **extra):
    """Run a worker against ``coordinator``: the CannotJoin it stopped with, or None while it still retries."""
    worker = Worker(WorkerSettings(coordinator=coordinator, name="joiner", threads=1, device="cpu", cache_dir=tmp_path / "cache", **extra))
    try:
        await asyncio.wait_for(worker.run(), seconds)
    except CannotJoin as exc:
        return exc
    except asyncio.TimeoutError:
        return None
    raise AssertionError("the worker returned without joining")


STOPS = [  # (URL at the servers, a phrase its one line must hold)
    ("http://127.0.0.1:{port}/wrong", "HTTP 403"),  # a path that is not a coordinator's (Starlette: 403)
    ("http://127.0.0.1:{port}/p401", "HTTP 401"),
    ("http://127.0.0.1:{port}/other", "is not an edgepipe coordinator"),
    ("http://127.0.0.1:{port}/newer", "another edgepipe protocol"),
    ("http://127.0.0.1:{web_port}", "not an edgepipe coordinator"),  # python -m http.server (HTTP/1.0 404)
    ("https://127.0.0.1:{port}", "serves plain HTTP, not TLS"),
]


@pytest.mark.parametrize("url,phrase", STOPS)
def test_a_mistake_retrying_cannot_fix_stops_the_worker_with_one_line(tmp_path, url, phrase):
    async def main():
        async with Servers() as s:
            return await attempt(tmp_path, url.format(port=s.port, web_port=s.web_port))

    stopped = asyncio.run(main())
    assert stopped is not None, f"{url}: the worker still retries"
    assert phrase in str(stopped) and "\n" not in str(stopped), str(stopped)


def test_https_to_a_plain_http_coordinator_says_so_with_a_pin_too(tmp_path):
    async def main():
        async with Servers() as s:
            return await attempt(tmp_path, f"https://127.0.0.1:{s.port}", tls_fingerprint="ab" * 32)

    stopped = asyncio.run(main())
    assert stopped is not None and "serves plain HTTP, not TLS" in str(stopped), stopped
    assert "serves TLS:" not in str(stopped)


def test_http_to_a_tls_coordinator_says_it_serves_tls(tmp_path):
    import uvicorn

    from edgepipe.net import tls

    cert, key = tls.make_self_signed(tmp_path / "tls")

    async def main():
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(APP, log_level="critical", ssl_certfile=str(cert), ssl_keyfile=str(key)))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            return await attempt(tmp_path, f"http://127.0.0.1:{sock.getsockname()[1]}")
        finally:
            server.should_exit = True
            await task

    stopped = asyncio.run(main())
    assert stopped is not None and "serves TLS: join with --coordinator https://" in str(stopped), stopped


@pytest.mark.parametrize("where", ["refused", "503"])
def test_where_the_coordinator_may_come_back_the_worker_keeps_retrying(tmp_path, caplog, where):
    async def main():
        async with Servers() as s:
            url = f"http://127.0.0.1:{free_port()}" if where == "refused" else f"http://127.0.0.1:{s.port}/p503"
            return await attempt(tmp_path, url, seconds=2.5)

    with caplog.at_level(logging.WARNING, logger="edgepipe.worker"):
        stopped = asyncio.run(main())
    assert stopped is None, f"the worker stopped: {stopped}"
    retries = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(retries) >= 2, retries
    assert ("HTTP 503" if where == "503" else "cannot reach") in retries[0], retries[0]


@pytest.mark.pure
@pytest.mark.parametrize("given,base", [
    ("http://10.0.0.2:8420", "http://10.0.0.2:8420"),
    ("http://10.0.0.2:8420/", "http://10.0.0.2:8420"),
    ("ws://10.0.0.2:8420/v1/worker", "http://10.0.0.2:8420"),
    ("wss://host:8420", "https://host:8420"),
    ("https://proxy.example/edgepipe/", "https://proxy.example/edgepipe"),
])
def test_the_coordinator_url_in_any_of_its_forms(given, base):
    assert coordinator_base(given) == base
    assert control_url(given) == base.replace("http", "ws", 1) + "/v1/worker"


@pytest.mark.pure
@pytest.mark.parametrize("given,phrase", [
    ("10.0.0.2:8420", "has no scheme: give http://10.0.0.2:8420"),
    ("ftp://10.0.0.2:8420", "the scheme must be"),
    ("http://10.0.0.2:port", "port is not a number"),
    ("http://", "names no host"),
])
def test_a_url_no_coordinator_can_have_is_one_line(given, phrase):
    with pytest.raises(CannotJoin, match=phrase):
        coordinator_base(given)


@pytest.mark.pure
def test_verdicts_on_what_the_handshake_met():
    from websockets.datastructures import Headers
    from websockets.exceptions import InvalidMessage, InvalidStatus
    from websockets.http11 import Response

    url = "ws://h:1/v1/worker"

    def status(code):
        return verdict(InvalidStatus(Response(code, "x", Headers())), url)

    assert all(isinstance(status(c), Retry) for c in (500, 502, 503, 504, 429))
    assert all(isinstance(status(c), Stop) for c in (400, 401, 403, 404, 200, 301))
    assert isinstance(verdict(ConnectionRefusedError(111, "refused"), url), Retry)
    assert isinstance(verdict(asyncio.TimeoutError(), url), Retry)
    dropped = InvalidMessage("did not receive a valid HTTP response")
    dropped.__cause__ = EOFError("connection closed")
    assert isinstance(verdict(dropped, url), Retry)
    garbage = InvalidMessage("did not receive a valid HTTP response")
    garbage.__cause__ = ValueError("invalid status line: SSH-2.0-OpenSSH")
    assert isinstance(verdict(garbage, url), Stop)


@pytest.mark.parametrize("url,phrase", [("127.0.0.1:{port}", "has no scheme"), ("http://127.0.0.1:{port}/wrong", "HTTP 403")])
def test_the_worker_command_exits_non_zero_with_one_line(url, phrase):
    async def main():
        async with Servers() as s:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edgepipe", "worker", "--device", "cpu", "--threads", "1", "--coordinator", url.format(port=s.port),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), 60)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                raise AssertionError("the worker is still retrying after 60 s") from None
            return proc.returncode, err.decode()

    code, err = asyncio.run(main())
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and phrase in errors[0], (code, err)
    assert "Traceback" not in err and "reconnecting" not in err, err
