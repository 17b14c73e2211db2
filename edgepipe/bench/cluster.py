"""Start real edgepipe clusters as subprocesses on this machine, for benchmarks and tests.

- ``Server``: ``edgepipe serve`` (with its own ``--workers`` or none), its status, events and
  extra workers; what the tests and most benchmarks use.
- ``Cluster``: a ``Server`` with no workers of its own plus EMULATED devices (``Device``: a
  worker with ``--slowdown``, ``--memory``, a user-space shaper, or a kernel-shaped link in a
  network namespace, ``KernelLink``), joined one at a time in order.

Everything listens on loopback unless a kernel link needs the namespaces to reach it.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from .client import stream_once

TEST_MODEL = "smollm2"  # = model.store.TEST_MODEL (not imported: this module stays free of the importer's onnx)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_home() -> Path:
    """The edgepipe home benchmarks share (packages, worker caches, calibrations): ``$EDGEPIPE_HOME``,
    else ``~/.cache/edgepipe-bench``."""
    return Path(os.environ.get("EDGEPIPE_HOME", Path.home() / ".cache" / "edgepipe-bench"))


def _stop_group(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM a process started with ``start_new_session`` and its children; SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Server:
    """``edgepipe serve`` in a subprocess; ``url`` and ``client`` once its status page answers.

    With ``wait_up``, the constructor also waits for the plan to be up with ``workers`` workers.
    It serves ``model`` (default ``smollm2``, the bundled 135M: fast; None: ``serve``'s own default,
    the 0.5B) unless ``args`` names one. ``--no-advertise`` is added unless ``args`` joins a cluster by discovery (``--cluster``);
    with ``--tls`` the client trusts the certificate the server writes into ``home``.
    ``env`` replaces the inherited environment (``EDGEPIPE_HOME`` is always ``home``); ``log``
    takes the server's output (else it is inherited). Processes added to ``watched`` as
    ``(label, process)`` must stay alive while ``wait_for`` waits: one that exits fails it.
    """

    def __init__(self, home, workers: int = 2, args: tuple[str, ...] = (), wait_up: bool = True, timeout: float = 180, *,
                 name: str = "server", env: dict | None = None, log: Path | None = None, client_timeout: float = 120,
                 model: str | None = TEST_MODEL):
        self.name, self.home = name, Path(home)
        self.port = free_port()
        args = tuple(args)
        self.tls = "--tls" in args
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.env = {**(os.environ if env is None else env), "EDGEPIPE_HOME": str(home)}
        if "--cluster" not in args and "--no-advertise" not in args:  # only the discovery test announces itself
            args = (*args, "--no-advertise")
        if model is not None and "--model" not in args and "-m" not in args:
            args = (*args, "--model", model)
        self.log = log
        self.watched: list[tuple[str, subprocess.Popen]] = []
        self._log_file = open(log, "w") if log else None
        output = {"stdout": self._log_file, "stderr": subprocess.STDOUT} if self._log_file else {}
        self.proc = subprocess.Popen([sys.executable, "-m", "edgepipe", "serve", "--workers", str(workers), "--port", str(self.port), *args],
                                     env=self.env, stdin=subprocess.DEVNULL, start_new_session=True, **output)
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self._status_headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client: httpx.Client | None = None
        try:
            self.client = httpx.Client(base_url=self.url, timeout=client_timeout, verify=self._verify(timeout))
            self.wait_for(lambda s: True, timeout)
            if wait_up:
                self.wait_for(lambda s: s["state"] == "up" and len(s["workers"]) >= workers, timeout)
        except BaseException:
            self.close()
            raise

    def _verify(self, timeout: float):
        """True for plain HTTP; for ``--tls`` an SSL context trusting the certificate the server writes."""
        if not self.tls:
            return True
        from ..net import tls

        cert = self.home / "tls" / "cert.pem"
        deadline = time.monotonic() + timeout
        while not cert.is_file():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} wrote no TLS certificate at {cert} in {timeout:.0f} s")
            time.sleep(0.2)
        return tls.trusting(cert.read_text())

    # -- views ------------------------------------------------------------------------------------
    def status(self) -> dict:
        return self.client.get("/v1/cluster/status", headers=self._status_headers).json()

    def events(self) -> list[dict]:
        return self.client.get("/v1/cluster/events", headers=self._status_headers).json()["events"]

    def _check_alive(self) -> None:
        where = f" (log {self.log})" if self.log else ""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}{where}")
        for label, proc in self.watched:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited with {proc.returncode}{where}")

    def wait_for(self, predicate, timeout: float = 120) -> dict:
        """Poll the status page until ``predicate(status)``; return that status."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not reach the expected state in {timeout:.0f} s; last status {last}")

    # -- more workers -----------------------------------------------------------------------------
    def worker(self, *args: str, home=None, env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
        """``edgepipe worker --coordinator <url> *args``. Its stderr is a pipe (text) unless ``log``
        takes its output; the environment's join token is dropped (pass ``--join-token``)."""
        env = {**os.environ, **(env or {})}
        env.pop("EDGEPIPE_JOIN_TOKEN", None)
        if home is not None:
            env["EDGEPIPE_HOME"] = str(home)
        argv = [sys.executable, "-m", "edgepipe", "worker", "--coordinator", self.url, *args]
        if log is None:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        with open(log, "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def close(self) -> None:
        """Stop the server and what it started (safe to call more than once)."""
        if self.client is not None:
            self.client.close()
        _stop_group(self.proc)
        if self._log_file is not None:
            self._log_file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- emulated devices ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """One emulated device: an ``edgepipe worker`` with emulation flags."""

    name: str
    slowdown: float = 1.0
    roofline: str | None = None  # "FLOPS,BANDWIDTH[,OVERHEAD_MS]" (emulate.roofline), instead of the slowdown
    memory: str | None = None  # e.g. "200MB": hard budget, declared to the coordinator
    link_rate: str | None = None  # user-space shaper on every frame the worker sends
    link_delay_ms: float = 0.0  # user-space one-way delay on every frame the worker sends
    kernel_rate: str | None = None  # kernel tbf on a veth pair, both directions (needs root)
    threads: int = 1
    extra: tuple[str, ...] = ()  # further worker flags (e.g. --power-busy-w)

    def label(self) -> str:
        if self.roofline:
            from ..emulate.roofline import RooflinePolicy

            parts = [RooflinePolicy.parse(self.roofline).label().removeprefix("emulated ")]
        else:
            parts = [f"slowdown x{self.slowdown:g}"]
        if self.memory:
            parts.append(f"memory {self.memory}")
        if self.kernel_rate:
            parts.append(f"link {self.kernel_rate} (tbf, MTU 576)")
        if self.link_rate:
            parts.append(f"link {self.link_rate} (user-space)")
        if self.link_delay_ms:
            parts.append(f"+{self.link_delay_ms:g} ms one-way (user-space)")
        parts += list(self.extra)
        return "emulated: " + ", ".join(parts)

    def flags(self) -> list[str]:
        argv = ["--name", self.name, "--threads", str(self.threads),
                *(["--roofline", self.roofline] if self.roofline else ["--slowdown", str(self.slowdown)])]
        if self.memory:
            argv += ["--memory", self.memory]
        if self.link_rate:
            argv += ["--link-rate", self.link_rate]
        if self.link_delay_ms:
            argv += ["--link-delay-ms", str(self.link_delay_ms)]
        return argv + list(self.extra)


class KernelLink:
    """A namespace + veth pair whose both ends are capped by tbf at ``rate`` (emulation; needs root)."""

    _count = itertools.count()

    def __init__(self, rate: str):
        from ..emulate.netns import NetnsHost

        k = (os.getpid() % 40) * 5 + next(self._count) % 5  # distinct /30s for concurrent runs
        a, b = divmod(k, 64)
        self.host = NetnsHost(f"pb{os.getpid() % 10000}x{k % 100}", f"10.213.{200 + a}.{b * 4 + 2}",
                              f"10.213.{200 + a}.{b * 4 + 1}", rate=rate)
        self.rate = rate

    def __enter__(self) -> KernelLink:
        from ..emulate.shaper import parse_rate

        self.host.__enter__()
        bits = round(parse_rate(self.rate) * 8)
        # A small MTU and a one-packet burst: a 2.3 KB activation is paced at the link rate
        # (~17 ms at 128 KB/s) instead of passing at once in the default 15 KB burst.
        for dev, prefix in ((self.host.host_veth, []), (self.host.device_veth, self.host.exec_prefix)):
            subprocess.run([*prefix, "ip", "link", "set", "dev", dev, "mtu", "576"], check=True)
            subprocess.run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                            "burst", "600", "latency", "2000ms"], check=True)
        return self

    def close(self) -> None:
        self.host.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def measure_uplink(self, nbytes: int = 1 << 18) -> float:
        """Bytes/s of a timed TCP upload from inside the namespace to the host end."""
        srv = socket.socket()
        srv.bind((self.host.peer_ip, 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        code = (f"import socket,time\ns=socket.create_connection(('{self.host.peer_ip}',{port}))\n"
                f"t=time.perf_counter()\ns.sendall(b'x'*{nbytes})\ns.recv(1)\nprint(time.perf_counter()-t)")
        proc = self.host.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        conn, _ = srv.accept()
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 16))
        conn.sendall(b"k")
        seconds = float(proc.stdout.read())
        proc.wait()
        conn.close()
        srv.close()
        return nbytes / seconds


class Cluster:
    """A ``Server`` with ``--workers 0`` plus emulated ``devices``, joined one at a time in order.

    Worker ids are ``w<join index>-<name>``, so the join order fixes the order in which
    ``--placement memory`` lays out its ranges. Each device's calibration is awaited before the
    next joins (on real hardware a joining device's start-up does not slow the others; here it
    would). A join token keeps out workers of other runs on this host. Logs go to ``logdir``.
    """

    def __init__(self, tag: str, devices: list[Device], args: tuple[str, ...] = (), logdir: Path | None = None,
                 timeout: float = 240, attempts: int = 3, home: Path | None = None):
        self.tag, self.devices, self.args, self.timeout = tag, list(devices), tuple(args), timeout
        self.home = Path(home) if home is not None else bench_home()
        self.logdir = Path(logdir or tempfile.mkdtemp(prefix="edgepipe-bench-"))
        self.kernel = any(d.kernel_rate for d in devices)
        self.server: Server | None = None
        self.links: list[KernelLink] = []
        self.workers: list[subprocess.Popen] = []
        for attempt in range(1, attempts + 1):
            try:
                self._launch(attempt)
                return
            except RuntimeError as exc:
                # On a shared machine other jobs' clean-ups have sent SIGTERM to our processes;
                # start again rather than lose the whole run.
                self.close()
                if "exited with" not in str(exc) or attempt == attempts:
                    raise
                print(f"[{tag}] {exc}; starting again", file=sys.stderr)
            except BaseException:
                self.close()
                raise

    def _launch(self, attempt: int) -> None:
        self.token = secrets.token_hex(8)
        args = ("--min-workers", str(len(self.devices)), "--join-token", self.token, *self.args)
        if self.kernel:
            args += ("--host", "0.0.0.0")
        self.server = Server(self.home, workers=0, args=args, wait_up=False, timeout=120, name=f"{self.tag}: server",
                             log=self.logdir / f"{self.tag}-server-{attempt}.log", client_timeout=600)
        self.port, self.url, self.client = self.server.port, self.server.url, self.server.client
        self._start_workers()

    def _link_for(self, device: Device) -> KernelLink | None:
        """The namespace link ``device`` runs behind (entered), None for a loopback device."""
        return KernelLink(device.kernel_rate).__enter__() if device.kernel_rate else None

    def _start_workers(self) -> None:
        links = {}
        for d in self.devices:
            if (link := self._link_for(d)) is not None:
                self.links.append(link)
                links[d.name] = link
        advertise = self.links[0].host.peer_ip if self.links else None
        for i, d in enumerate(self.devices):
            with open(self.logdir / f"{self.tag}-{d.name}.log", "a") as log:
                link = links.get(d.name)
                if link is not None:
                    argv = [sys.executable, "-m", "edgepipe", "worker", "--coordinator", f"http://{link.host.peer_ip}:{self.port}",
                            "--host", link.host.ip, "--join-token", self.token, *d.flags()]
                    proc = link.host.popen(argv, env=self.server.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
                else:
                    argv = [sys.executable, "-m", "edgepipe", "worker", "--coordinator", self.url, "--join-token", self.token, *d.flags()]
                    if advertise:  # reachable from inside the namespaces too
                        argv += ["--host", "0.0.0.0", "--advertise", advertise]
                    proc = subprocess.Popen(argv, env=self.server.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            self.workers.append(proc)
            self.server.watched.append((f"{self.tag}: worker {d.name}", proc))
            self.wait_for(lambda s, n=i + 1: len(s["workers"]) >= n, 120)
            self.wait_for(lambda s, n=i + 1: self._calibrated() >= n, 180)

    def _calibrated(self) -> int:
        kinds = [e["kind"] for e in self.events()]
        return kinds.count("calibrated") + kinds.count("calibration_failed")

    # -- views --------------------------------------------------------------------------------
    def status(self) -> dict:
        return self.server.status()

    def events(self) -> list[dict]:
        return self.server.events()

    def wait_for(self, predicate, timeout: float) -> dict:
        try:
            return self.server.wait_for(predicate, timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; events {[e['kind'] for e in self.events()][-12:]}") from None

    def wait_up(self) -> dict:
        """Wait for every calibration and the first plan to be up; return the status."""
        n = len(self.devices)
        self.wait_for(lambda s: s["state"] == "up" and bool(s["plan"]) and self._calibrated() >= n, self.timeout)
        time.sleep(0.5)  # let a re-plan that the last calibration triggered land first
        return self.wait_for(lambda s: s["state"] == "up" and s["plan"], 60)

    def names(self) -> dict[str, str]:
        """worker id -> device name."""
        return {w["id"]: w["name"] for w in self.status()["workers"]}

    def stages(self, status: dict | None = None) -> list[tuple[str, int, int]]:
        s = status or self.status()
        names = {w["id"]: w["name"] for w in s["workers"]}
        return [(names.get(st["worker"], st["worker"]), st["start"], st["end"]) for st in s["plan"]["stages"]]

    def metrics(self) -> dict[str, float]:
        """Sums and counts of the TPOT histogram and of per-worker stage compute."""
        out: dict[str, float] = {}
        for line in self.client.get("/metrics").text.splitlines():
            m = re.match(r'(edgepipe_(?:time_per_output_token_seconds|stage_compute_seconds)_(?:sum|count))'
                         r'(?:\{worker="([^"]+)"\})? (\S+)$', line)
            if m:
                out[f"{m.group(1)}|{m.group(2) or ''}"] = float(m.group(3))
        return out

    def request(self, tokens: int, prompt: str = "Hi") -> dict:
        """One streamed completion of exactly ``tokens`` tokens; client and coordinator timings.
        The default prompt is one or two tokens: its prefill costs about one decode step."""
        before = self.metrics()
        ttft, decode_s, n = stream_once(self.client, tokens, prompt)
        after = self.metrics()
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        steps = d.get("edgepipe_time_per_output_token_seconds_count|", 0.0)
        compute = {k.split("|")[1]: d[k] / d[k.replace("_sum", "_count")]
                   for k in d if k.startswith("edgepipe_stage_compute_seconds_sum|") and d.get(k.replace("_sum", "_count"))}
        return {"chunks": n, "ttft_s": ttft, "decode_tok_s": (n - 1) / decode_s if n > 1 else 0.0,
                "tpot_s": d["edgepipe_time_per_output_token_seconds_sum|"] / steps if steps else float("nan"),
                "stage_compute_s": compute}

    def close(self) -> None:
        """Stop the server, the workers and the namespaces (safe to call more than once)."""
        if self.server is not None:
            self.server.close()
        for w in self.workers:
            if w.poll() is None:
                w.terminate()
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        for link in self.links:
            link.close()
        self.server, self.workers, self.links = None, [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
