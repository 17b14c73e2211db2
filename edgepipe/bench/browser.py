"""Headless Debian chromium driven by Playwright (no browser download: ``executable_path``), for
the benchmarks and tests that run browser workers."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
# WebGPU on SwiftShader, Chromium's software Vulkan (no GPU needed); without these flags a tab finds no adapter.
WEBGPU_ARGS = ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"]


class ChromiumMissing(RuntimeError):
    pass


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        raise ChromiumMissing("Debian's chromium is not installed (scripts/bootstrap.sh test installs it)")
    return path


@contextmanager
def browser_context(webgpu: bool = False, **kwargs):
    """A persistent Playwright context in a throw-away profile. ``webgpu``: tabs find a WebGPU
    adapter (SwiftShader); else they compute on WebAssembly."""
    from playwright.sync_api import sync_playwright

    args = CHROMIUM_ARGS + (WEBGPU_ARGS if webgpu else [])
    executable = chromium_path()
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(profile, executable_path=executable, args=args, headless=True, **kwargs)
        try:
            yield context
        finally:
            context.close()
