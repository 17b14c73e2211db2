"""Headless Debian chromium driven by Playwright (no browser download: executable_path)."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
# WebGPU on SwiftShader, Chromium's software Vulkan (no GPU needed); without these flags a tab finds no adapter.
WEBGPU_ARGS = ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"]


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("Debian's chromium is not installed (scripts/bootstrap.sh test installs it)")
    return path


@contextmanager
def browser_context(webgpu: bool = False, **kwargs):
    """``webgpu``: tabs find a WebGPU adapter (SwiftShader); else they compute on WebAssembly."""
    from playwright.sync_api import sync_playwright

    args = CHROMIUM_ARGS + (WEBGPU_ARGS if webgpu else [])
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(profile, executable_path=chromium_path(), args=args, headless=True, **kwargs)
        try:
            yield context
        finally:
            context.close()
