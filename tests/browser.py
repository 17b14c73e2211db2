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
