"""What a worker is started with, and the facts it reports of its machine in its hello."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..emulate.roofline import RooflinePolicy
from ..native import native_library

log = logging.getLogger("edgepipe.worker")
RECONNECT_FIRST_S, RECONNECT_CAP_S = 0.2, 5.0  # backoff between attempts to reach the coordinator
RECONNECT_SHARE = 0.1  # ... at most this share of the time it has been gone (1 s at least)


@dataclass
class WorkerSettings:
    """Emulation (always labelled as such in what the worker reports): ``slowdown`` makes each
    compute call last ``f`` times its CPU time (single-threaded decode; else ``f`` times its wall
    time); ``roofline`` instead makes each call last as long as a device of that compute rate and
    memory bandwidth would take for its rows (``emulate.roofline``); ``memory_bytes`` is a hard budget for weights plus KV
    (a budget the user chose, on a real device as on an emulated one: not emulation); ``link`` shapes every frame the
    worker sends; ``drop_work`` makes it a faulty device that answers heartbeats but silently
    drops every activation frame, and ``misreport`` one that reports its compute times divided by
    a factor (the coordinator must find both by what they do)."""

    coordinator: str  # http(s)://host:port of the coordinator
    name: str = field(default_factory=socket.gethostname)
    memory_bytes: int | None = None
    threads: int | None = None
    spin: bool | None = None  # pool threads spin between ops (None: stage_runner.spin_by_default)
    slowdown: float = 1.0
    roofline: str | None = None  # "FLOPS,BANDWIDTH[,OVERHEAD_MS]": an emulated device's roofline (emulate.roofline)
    link_delay_ms: float = 0.0
    link_rate: str | None = None
    data_host: str = "127.0.0.1"
    data_port: int = 0
    advertise_host: str | None = None
    join_token: str | None = None
    tls_fingerprint: str | None = None  # sha256 of the coordinator's certificate: pin it, serve the data port over wss
    cache_dir: Path | None = None
    activation_dtype: str = "float32"  # "float16" halves the bytes on the wire
    silence_s: float = 10.0  # no frame from the coordinator for this long: reconnect
    power_busy_w: float | None = None  # declared power draw, for the energy objective
    power_idle_w: float | None = None
    drop_work: bool = False
    misreport: float = 1.0  # reported compute times are divided by this
    device: str = "cpu"  # where stages compute: auto | cpu | gpu | gpu:N (runtime.devices.resolve)
    role: str = "stage"  # "drafter": hold no stage, run a speculative coordinator's draft model (worker.drafter)

    def __post_init__(self) -> None:
        if self.roofline is not None:
            if self.slowdown != 1.0:
                raise ValueError("--roofline and --slowdown are two emulations of compute: give one")
            RooflinePolicy.parse(self.roofline)  # a bad spec fails here, with the form it expects

    def roofline_policy(self) -> RooflinePolicy | None:
        return RooflinePolicy.parse(self.roofline) if self.roofline is not None else None

    @property
    def emulated(self) -> bool:
        return self.roofline is not None or self.slowdown != 1.0 or bool(self.link_delay_ms) or bool(self.link_rate) or self.drop_work or self.misreport != 1.0

    def emulation(self) -> dict | None:
        """The hello's emulation entry (None: a real device, no budget). The budget travels here too
        (``memory_budget``), but alone it is no emulation (``Hello.emulated``)."""
        if not (self.emulated or self.memory_bytes):
            return None
        return {"slowdown": self.slowdown, "link_delay_ms": self.link_delay_ms, "link_rate": self.link_rate,
                **({"roofline": self.roofline_policy().as_dict()} if self.roofline is not None else {}),
                **({"drop_work": True} if self.drop_work else {}), **({"misreport": self.misreport} if self.misreport != 1.0 else {}),
                "memory_budget": self.memory_bytes}


def reconnect_delay(attempt: int, draw: float, gone_s: float = 0.0) -> float:
    """Seconds before reconnect ``attempt`` (0, 1, ...) when the coordinator has been out of
    reach for ``gone_s``: exponential from 0.2 s, capped at a tenth of ``gone_s`` (at least 1 s,
    at most 5 s) so a coordinator that restarts in seconds is found again within about a
    second, and jittered over the upper half (``draw`` in [0, 1)) so the workers of a
    restarted coordinator do not all come back in the same instant."""
    cap = min(RECONNECT_CAP_S, max(1.0, RECONNECT_SHARE * gone_s))
    ceiling = min(cap, RECONNECT_FIRST_S * 2 ** min(attempt, 30))
    return ceiling * (0.5 + 0.5 * draw)


def default_cache() -> Path:
    if os.environ.get("EDGEPIPE_HOME"):
        return Path(os.environ["EDGEPIPE_HOME"]) / "worker-cache"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgepipe")) / "blobs"


def gguf_kernel(on_gpu: bool) -> tuple[str | None, str | None]:
    """What the hello says of the GGUF kernel library: ("gguf", None) when it loaded here,
    (None, why) when not (the worker is then sent the MatMulNBits graphs), (None, None) on a GPU
    (its stages run on ONNX Runtime's WebGPU provider, which runs no custom ops)."""
    if on_gpu:
        return None, None
    library = native_library()  # built on first use where bootstrap did not build it
    if library.path is None:
        log.warning("no GGUF kernel library (%s): falling back to the MatMulNBits graphs", library.reason)
        return None, library.reason
    return "gguf", None


def system_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30
