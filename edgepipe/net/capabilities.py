"""What a worker can run, derived once from its hello: one record per device kind.

A device kind (a CPU worker, a GPU worker, a browser tab on WebAssembly or on WebGPU) is one
:class:`DeviceKind` row of :data:`DEVICE_KINDS`; everything that used to test strings
(``hello.device == "gpu"``, ``hello.kind == "browser"``) reads the row instead, so a new kind of
device is one more row. :func:`capabilities` adds what the worker itself reported on top of
its kind (whether its GGUF kernel library loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..native import KERNEL_FORM
from .messages import Hello


@dataclass(frozen=True)
class DeviceKind:
    """What every worker of one kind can do, whatever it reports."""

    name: str  # shown in the status and dashboard
    gpu_graphs: bool  # its stages are sent the GPU form of their graphs (``graphs.gpu_form``)
    kernel_form: bool  # may run the GGUF kernel library's form (when its library loaded): ONNX Runtime's CPU provider
    relay: bool  # accepts no connections: its activations travel through the coordinator
    peer_kv: bool  # has a data port of its own, so KV moves and checkpoints can reach it peer to peer
    prefix_cache: bool  # runs the prefix cache's block reuse (checked on the CPU graphs only)


DEVICE_KINDS: dict[tuple[str, str], DeviceKind] = {
    # (hello.kind, hello.device or "cpu") -> its row
    ("native", "cpu"): DeviceKind("cpu", gpu_graphs=False, kernel_form=True, relay=False, peer_kv=True, prefix_cache=True),
    ("native", "gpu"): DeviceKind("gpu", gpu_graphs=True, kernel_form=False, relay=False, peer_kv=True, prefix_cache=False),
    ("browser", "cpu"): DeviceKind("browser", gpu_graphs=False, kernel_form=False, relay=True, peer_kv=False, prefix_cache=False),
    ("browser", "gpu"): DeviceKind("browser-gpu", gpu_graphs=True, kernel_form=False, relay=True, peer_kv=False, prefix_cache=False),
}


@dataclass(frozen=True)
class Capabilities:
    """One worker's: its kind's row, and what it reported of itself."""

    kind: DeviceKind
    gguf_kernel: bool  # it runs the `gguf` form: its kind may and its kernel library loaded

    @property
    def gpu(self) -> bool:
        return self.kind.gpu_graphs

    @property
    def relay(self) -> bool:
        return self.kind.relay


def device_kind(hello: Hello) -> DeviceKind:
    """The row of a worker's kind (``Hello``'s own checks admit only the pairs of the table)."""
    return DEVICE_KINDS[(hello.kind, hello.device or "cpu")]


def capabilities(hello: Hello) -> Capabilities:
    kind = device_kind(hello)
    return Capabilities(kind=kind, gguf_kernel=kind.kernel_form and hello.native_kernel == KERNEL_FORM)
