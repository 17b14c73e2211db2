"""What ``serve`` announces, and where (issue 42, item 6 and its polish lines): bound to loopback it
is not announced by mDNS and says so in one line; beyond loopback it is announced, warns when no
``--join-token`` guards the join, and prints the commands another machine runs (the pip line of
its own wheel, the worker line). In process (``run_server``, no local workers) with a recording
stand-in for the mDNS advertiser and for the wheel build; the real ones are tested elsewhere
(``test_join.py``, ``test_dist.py``).
"""

from __future__ import annotations

import asyncio

import pytest

from edgepipe import dist
from edgepipe.net import discovery
from edgepipe.serve import ServeSettings, run_server


class RecordingAdvertiser:
    started: list[tuple] = []

    def __init__(self, host, port, *rest):
        self.where = (host, port)

    async def start(self):
        RecordingAdvertiser.started.append(self.where)

    async def stop(self):
        pass


def serve_once(native_pkg, host: str, join_token: str | None, wait_for: str, capsys) -> str:
    """Run the server until ``wait_for`` is on stderr (or 60 s), then stop it: its stderr."""
    async def main():
        ready = asyncio.Event()
        task = asyncio.create_task(run_server(native_pkg, ServeSettings(host=host, port=0, workers=0, join_token=join_token),
                                              on_ready=lambda port, coordinator: ready.set()))
        await asyncio.wait_for(ready.wait(), 60)
        seen = ""
        for _ in range(600):
            seen += capsys.readouterr().err
            if wait_for in seen:
                break
            await asyncio.sleep(0.1)
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return seen + capsys.readouterr().err

    return asyncio.run(main())


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch, tmp_path):
    RecordingAdvertiser.started = []
    monkeypatch.setattr(discovery, "Advertiser", RecordingAdvertiser)
    fake = tmp_path / "edgepipe-0.1.0-py3-none-any.whl"
    fake.write_bytes(b"PK-not-built-here")
    monkeypatch.setattr(dist, "build_wheel", lambda cache, source=None: fake)


def test_on_loopback_it_is_not_announced_and_says_so(native_pkg, capsys):
    err = serve_once(native_pkg, "127.0.0.1", None, "not announced", capsys)
    assert RecordingAdvertiser.started == []
    said = [line for line in err.splitlines() if "mDNS" in line]
    assert len(said) == 1 and "not announced by mDNS" in said[0], err
    assert "pip install" not in err and "without --join-token" not in err


def test_beyond_loopback_it_is_announced_warns_without_a_token_and_prints_the_commands(native_pkg, capsys):
    err = serve_once(native_pkg, "0.0.0.0", None, "edgepipe worker --coordinator", capsys)
    assert len(RecordingAdvertiser.started) == 1 and "not announced" not in err
    assert "without --join-token" in err
    pip = [line.strip() for line in err.splitlines() if line.strip().startswith("pip install")]
    worker = [line.strip() for line in err.splitlines() if line.strip().startswith("edgepipe worker")]
    assert len(pip) == 1 and "/dist/edgepipe-0.1.0-py3-none-any.whl#sha256=" in pip[0], err
    assert len(worker) == 1 and worker[0].startswith("edgepipe worker --coordinator http://") and "127.0.0.1" not in worker[0], err


def test_with_a_token_the_worker_line_carries_it_and_no_warning(native_pkg, capsys):
    err = serve_once(native_pkg, "0.0.0.0", "s3cret", "edgepipe worker --coordinator", capsys)
    assert "without --join-token" not in err
    assert any(line.strip().endswith("--join-token s3cret") for line in err.splitlines()), err


def test_a_cancelled_server_closes_its_listening_socket(native_pkg):
    """Cancelled (as a test or an embedding program stops it), the server closes its port: it was
    left listening (connections accepted into the backlog, never answered) until the loop closed."""
    import socket

    async def main():
        ready = asyncio.Event()
        ports = []
        task = asyncio.create_task(run_server(native_pkg, ServeSettings(host="127.0.0.1", port=0, workers=0),
                                              on_ready=lambda port, coordinator: (ports.append(port), ready.set())))
        await asyncio.wait_for(ready.wait(), 60)
        await asyncio.sleep(0.5)  # uvicorn serving on it
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()  # listening
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        with pytest.raises(ConnectionRefusedError):  # the loop still runs: only a closed socket refuses
            socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()

    asyncio.run(main())
