"""Headless Debian chromium for tests: ``edgepipe.bench.browser``, with a missing chromium
reported as a test failure (never a skip)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from edgepipe.bench import browser as _browser


def chromium_path() -> str:
    try:
        return _browser.chromium_path()
    except _browser.ChromiumMissing as exc:
        pytest.fail(str(exc))


@contextmanager
def browser_context(webgpu: bool = False, **kwargs):
    """``webgpu``: tabs find a WebGPU adapter (SwiftShader); else they compute on WebAssembly."""
    chromium_path()
    with _browser.browser_context(webgpu, **kwargs) as context:
        yield context


def run_under_ort_web(node: str, script: str, folder, what: str, timeout_s: float = 120) -> None:
    """Run ``script`` (an ES module) with Node in ``folder``, given the vendored onnxruntime-web and
    that folder; it prints ``written`` when its outputs are in the folder (killed after ``timeout_s``)."""
    import subprocess
    import threading
    from pathlib import Path

    (Path(folder) / "run.mjs").write_text(script)
    vendor = Path(__file__).resolve().parents[1] / "edgepipe" / "api" / "static" / "vendor"
    proc = subprocess.Popen([node, str(Path(folder) / "run.mjs"), str(vendor), str(folder)], stdout=subprocess.PIPE, text=True)
    deadline = threading.Timer(timeout_s, proc.kill)
    deadline.start()
    try:
        assert any(line.strip() == "written" for line in proc.stdout), f"onnxruntime-web did not run the {what}"
    finally:
        deadline.cancel()
        proc.kill()
        proc.wait()
