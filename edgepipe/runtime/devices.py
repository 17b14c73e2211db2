"""Execution devices: where a stage computes, the CPU or a GPU through ONNX Runtime's WebGPU EP.

``resolve("auto" | "cpu" | "gpu" | "gpu:N")`` answers with an :class:`ExecutionDevice`; a GPU
that cannot be had (the plugin package ``onnxruntime-ep-webgpu`` is missing, the Vulkan loader
or driver is absent, no adapter) resolves to the CPU with a one-line ``note`` saying why, so a
worker always starts. The WebGPU EP is a plugin library registered once per process; it speaks
Vulkan on Linux, Metal on macOS and D3D12 on Windows, so one code path serves every vendor.

A software adapter (SwiftShader, which Debian's chromium ships) is refused unless
``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1`` is set: CI runs GPU code on it, a user would not want
it. Needs only ``onnxruntime`` (workers import this module).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

import onnxruntime as ort

WEBGPU_EP = "WebGpuExecutionProvider"
SOFTWARE_ENV = "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"
INSTALL_HINT = "pip install 'edgepipe[gpu]'"


@dataclass(frozen=True)
class ExecutionDevice:
    """Where a stage's session runs. ``ep_device`` is ONNX Runtime's handle (None on the CPU)."""

    kind: str = "cpu"  # "cpu" or "gpu"
    index: int = 0
    adapter: str | None = None  # vendor / description of the GPU
    memory_bytes: int | None = None  # the GPU's own memory, when it could be read
    note: str | None = None  # why this is the CPU though a GPU was asked for or looked for
    ep_device: object | None = field(default=None, compare=False, repr=False)

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    def memory_info(self):
        """The OrtMemoryInfo of the device's own memory (KV buffers are allocated there)."""
        return self.ep_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT) if self.is_gpu else None

    def describe(self) -> str:
        if self.is_gpu:
            return f"gpu:{self.index} ({self.adapter})"
        return "cpu" + (f" ({self.note})" if self.note else "")


CPU = ExecutionDevice()
# ONNX Runtime's own log at errors, set before its environment exists (the first session): what was
# chosen is said in one line by ``describe``, not by the provider's warnings.
ort.set_default_logger_severity(3)


def _quiet_vulkan() -> None:
    """A private XDG_RUNTIME_DIR where none is set (a service, a container, ssh without a login
    session): the Vulkan loader's window-system layers otherwise print "XDG_RUNTIME_DIR is invalid
    or not set" twice as the provider starts, though a compute-only worker needs no display."""
    if not os.environ.get("XDG_RUNTIME_DIR"):
        os.environ["XDG_RUNTIME_DIR"] = _private_runtime_dir()


def _private_runtime_dir() -> str:
    """One directory per user, reused by every worker (a fresh one per process was never removed:
    hundreds piled up in /tmp). It must be ours and private; if something else holds the name, a
    fresh directory is made and removed when the process exits."""
    import atexit
    import shutil
    import stat
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"edgepipe-xdg-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700:
        return path
    fresh = tempfile.mkdtemp(prefix="edgepipe-xdg-")
    atexit.register(shutil.rmtree, fresh, ignore_errors=True)
    return fresh
_registered: tuple[list, str | None] | None = None  # (WebGPU EP devices, why none)


def webgpu_devices() -> tuple[list, str | None]:
    """The WebGPU EP's devices in this process (registering the plugin once), or why there are none."""
    global _registered
    if _registered is not None:
        return _registered
    try:
        import onnxruntime_ep_webgpu as plugin
    except ImportError:
        _registered = [], f"the WebGPU execution provider is not installed ({INSTALL_HINT})"
        return _registered
    try:
        _quiet_vulkan()
        ort.register_execution_provider_library("webgpu", plugin.get_library_path())
        found = [d for d in ort.get_ep_devices() if d.ep_name == plugin.get_ep_name()]
    except Exception as e:  # a missing Vulkan loader or driver surfaces here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _registered = [], f"the WebGPU execution provider could not start: {first[:200]}"
        return _registered
    why = None
    if not found:
        why = "no GPU adapter found (WebGPU needs a Vulkan, Metal or D3D12 driver; on Linux the libvulkan1 loader)"
    _registered = found, why
    return _registered


def resolve(spec: str = "auto") -> ExecutionDevice:
    """The device a worker computes on for ``--device spec``: ``cpu``; ``gpu`` / ``gpu:N`` (the
    CPU with a note when that GPU cannot be had); ``auto`` (the first GPU, else the CPU)."""
    spec = (spec or "auto").strip().lower()
    if spec == "cpu":
        return CPU
    if spec == "auto":
        index = 0
    elif spec == "gpu" or spec.startswith("gpu:"):
        try:
            index = int(spec.partition(":")[2] or 0)
        except ValueError:
            raise ValueError(f"--device must be auto, cpu, gpu or gpu:N, got {spec!r}") from None
    else:
        raise ValueError(f"--device must be auto, cpu, gpu or gpu:N, got {spec!r}")
    found, why = webgpu_devices()
    if not found:
        return ExecutionDevice(note=why)
    if index >= len(found):
        return ExecutionDevice(note=f"gpu:{index} asked for, but WebGPU found {len(found)} adapter(s)")
    d = found[index]
    software = d.device.type != ort.OrtHardwareDeviceType.GPU
    adapter = _adapter_name(d, software)
    memory = None if software else gpu_memory_bytes(index)
    return ExecutionDevice("gpu", index, adapter, memory, None, d)


PCI_VENDORS = {0x10DE: "NVIDIA", 0x1002: "AMD", 0x8086: "Intel", 0x13B5: "ARM", 0x5143: "Qualcomm", 0x106B: "Apple"}


def _adapter_name(ep_device, software: bool) -> str:
    meta = dict(ep_device.device.metadata)
    name = meta.get("Description") or meta.get("description") or meta.get("DeviceName") or ""
    vendor = ep_device.device.vendor or PCI_VENDORS.get(ep_device.device.vendor_id) or f"vendor {ep_device.device.vendor_id:#06x}"
    if software:
        return f"software adapter on the {vendor} CPU ({SOFTWARE_ENV}=1)"
    if not name and ep_device.device.vendor_id == 0x10DE:
        name = _nvidia_smi("name", ep_device.device.device_id) or ""
    return f"{vendor} {name}".strip() + " (WebGPU)"


def _nvidia_smi(field: str, index: int = 0) -> str | None:
    """One field of ``nvidia-smi --query-gpu`` for GPU ``index`` (None without the tool)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        rows = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return rows[index].strip() if index < len(rows) else None


def gpu_memory_bytes(index: int) -> int | None:
    """The GPU's own memory, read from the vendor's tools (WebGPU does not report it): NVIDIA's
    ``nvidia-smi``, AMD's sysfs ``mem_info_vram_total``; None when neither answers."""
    mib = _nvidia_smi("memory.total", index)
    if mib:
        try:
            return int(float(mib) * (1 << 20))
        except ValueError:
            pass
    totals = []
    try:
        for card in sorted(os.listdir("/sys/class/drm")):
            path = f"/sys/class/drm/{card}/device/mem_info_vram_total"
            if card.startswith("card") and "-" not in card and os.path.exists(path):
                with open(path) as f:
                    totals.append(int(f.read().strip()))
    except (OSError, ValueError):
        return None
    return totals[index] if index < len(totals) else None


def add_to_session(options: ort.SessionOptions, device: ExecutionDevice, provider_options: dict | None = None) -> list[str] | None:
    """Put ``device``'s execution provider into ``options``; returns the ``providers`` argument
    an InferenceSession then takes (None: the devices chosen in the options)."""
    if not device.is_gpu:
        return ["CPUExecutionProvider"]
    options.add_provider_for_devices([device.ep_device], {k: str(v) for k, v in (provider_options or {}).items()})
    return None
