"""The capability record: one row per device kind, derived once from a worker's hello, read by
every decision that used to test strings (the kernel form, the GPU form, relays, peer KV, the
prefix cache)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgepipe.cluster.rules import deploy
from edgepipe.cluster.state import prefix_book
from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.placement import Deployment, StageAssignment
from edgepipe.net.capabilities import DEVICE_KINDS, capabilities
from edgepipe.net.messages import Hello

pytestmark = pytest.mark.pure


def hello(**fields) -> Hello:
    return Hello.from_fields({"memory_bytes": 1 << 30, **fields})


@pytest.mark.parametrize("kind, device, kernel, row, gguf, gpu, relay", [
    ("native", None, "gguf", "cpu", True, False, False),
    ("native", "cpu", None, "cpu", False, False, False),
    ("native", "gpu", "gguf", "gpu", False, True, False),  # the WebGPU provider runs no custom ops
    ("browser", None, None, "browser", False, False, True),
    ("browser", "gpu", "gguf", "browser-gpu", False, True, True),  # a tab never has the library
])
def test_each_kind_is_one_row(kind, device, kernel, row, gguf, gpu, relay):
    caps = capabilities(hello(kind=kind, device=device, native_kernel=kernel))
    assert (caps.kind.name, caps.gguf_kernel, caps.gpu, caps.relay) == (row, gguf, gpu, relay)
    assert deploy.has_gguf_kernel(hello(kind=kind, device=device, native_kernel=kernel)) is gguf


def test_every_declarable_pair_has_a_row():
    assert set(DEVICE_KINDS) == {(k, d) for k in Hello.KINDS for d in Hello.DEVICES}


def test_the_prefix_cache_is_off_on_a_stage_of_a_kind_that_does_not_run_it():
    st = S.ClusterState()
    for wid, h in (("c", hello()), ("g", hello(device="gpu")), ("b", hello(kind="browser"))):
        st = S.apply(st, S.WorkerJoined(wid, wid, h, 0.0))
    dep = lambda wid: Deployment(1, (StageAssignment(wid, 0, 4),), "active")  # noqa: E731
    assert prefix_book.why_off(st.workers, [], dep("c"), 64) is None
    assert prefix_book.why_off(st.workers, [], dep("g"), 64) == "stage on g (gpu)"
    assert prefix_book.why_off(st.workers, [], dep("b"), 64) == "stage on b (browser)"


def test_no_decision_tests_device_strings():
    """The control plane reads the record, not ``hello.device``/``hello.kind`` strings."""
    root = Path(__file__).resolve().parents[1] / "edgepipe" / "cluster"
    found = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ("gpu", "browser")
                                                      for c in node.comparators + [node.left]):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
