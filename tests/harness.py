"""Start real edgepipe servers and workers as subprocesses for tests (loopback only)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``edgepipe serve`` in a subprocess; ``url`` once its plan is up."""

    def __init__(self, home, workers: int = 2, args: tuple[str, ...] = (), wait_up: bool = True, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "EDGEPIPE_HOME": str(home)}
        if "--cluster" not in args:  # only the discovery test announces itself on the network
            args = (*args, "--no-advertise")
        self.proc = subprocess.Popen([sys.executable, "-m", "edgepipe", "serve", "--workers", str(workers), "--port", str(self.port), *args],
                                     env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self._status_headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.wait_for(lambda s: True, timeout)
        if wait_up:
            self.wait_for(lambda s: s["state"] == "up" and len(s["workers"]) >= workers, timeout)

    def status(self) -> dict:
        return self.client.get("/v1/cluster/status", headers=self._status_headers).json()

    def wait_for(self, predicate, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server did not reach the expected state; last status {last}")

    def worker(self, *args: str, home=None, env: dict | None = None) -> subprocess.Popen:
        env = {**os.environ, **(env or {})}
        env.pop("EDGEPIPE_JOIN_TOKEN", None)
        if home is not None:
            env["EDGEPIPE_HOME"] = str(home)
        return subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", self.url, *args], env=env,
                                stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def remember_device(home, manifest, identity: list, speed: float = 0.05, overhead_s: float = 0.05) -> None:
    """A calibration for a device (``identity`` as ``WorkerInfo.identity`` gives it), merged into
    the home's calibration file: a coordinator recalls it instead of timing the device again (a
    software GPU or a tab would take minutes). The first plan's stages are still timed."""
    import json

    path = home / "calibrations" / f"{manifest.name}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"model": manifest.name, "devices": []}
    data["devices"] = [row for row in data["devices"] if row["identity"] != identity]
    data["devices"].append({"identity": identity, "speed": speed, "overhead_s": overhead_s, "bandwidth_bytes_per_s": None, "trusted": True})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
