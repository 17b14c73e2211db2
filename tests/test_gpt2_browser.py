"""GPT-2 in a browser tab (onnxruntime-web, WebAssembly, the fp32 variant): the tab holds the
embedding (learned positions: ``position_ids`` fed by worker.js) with or without a layer, a
native worker the rest; greedy chat turns equal the single-process pipeline with the same cut
and variants. (Before, a tab with no layer fed no ``position_ids``: "input 'position_ids' is
missing". Plans with a browser stage use no prefix cache, so frames start where the tab's
sequence ends.)"""

from __future__ import annotations

import httpx
import pytest

from edgepipe.model.importer import add_variant
from edgepipe.model.package import Package
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from browser import browser_context
from harness import Server
from test_browser_worker import open_worker_tab
from test_gpt2_cluster import gpt2_home  # noqa: F401 - the fixture
from test_prefix_cluster import play_turns

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def reference(pkg: Package, messages: list[dict], n: int, stages: list[dict]) -> list[int]:
    pkg.reload()  # the server adds the variant its native worker runs (`gguf` with the kernel library)
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat(messages))
    pipe = pkg.pipeline([s["start"] for s in stages[1:]], precisions=[s["precision"] for s in stages])
    out = generate(pipe, ids, GenerationParams(max_tokens=n), tok.decode, pkg.manifest.eos_ids).tokens
    return [t for t in out if t not in pkg.manifest.eos_ids]


def test_tab_runs_the_gpt2_embedding(gpt2_home):  # noqa: F811
    pkg = Package(gpt2_home / "models" / "gpt2")
    add_variant(pkg.root, "fp32")
    pkg.reload()
    with browser_context() as context, Server(gpt2_home, workers=1, timeout=300, wait_up=False,
                                              args=("--model", "gpt2", "--placement", "memory", "--min-workers", "2")) as server:
        native = server.wait_for(lambda s: len(s["workers"]) == 1, 120)["workers"][0]["id"]
        open_worker_tab(context, f"{server.url}/worker?memory={1 << 30}&name=tab")
        status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["workers"]) == 2, 240)
        tab = next(w["id"] for w in status["workers"] if w["kind"] == "browser")
        for end in (2, 1):  # the embedding and a layer in the tab; then the embedding alone
            reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=180, json={"stages": [
                {"worker": tab, "start": 0, "end": end}, {"worker": native, "start": end, "end": 5}], "pin_s": 600})
            assert reply.status_code == 200, reply.text
            stages = server.status()["plan"]["stages"]
            assert stages[0]["worker"] == tab and stages[0]["precision"] == "fp32"
            for messages, got in play_turns(server, 10):
                assert got == reference(pkg, messages, 10, stages), (end, messages[-1])


def test_tab_on_webgpu_runs_the_gpt2_embedding_and_a_layer(gpt2_home):  # noqa: F811
    """The same on onnxruntime-web's WebGPU provider (SwiftShader): the package's own variant
    (MatMulNBits, GroupQueryAttention without rotary, LayerNormalization) in GPU buffers; a few
    tokens (SwiftShader is slow; the GPU's last bits may differ on long runs)."""
    from test_browser_webgpu import remember_tab

    pkg = Package(gpt2_home / "models" / "gpt2")
    remember_tab(gpt2_home, pkg.manifest, "gputab")
    with browser_context(webgpu=True) as context, Server(gpt2_home, workers=0, timeout=300, wait_up=False,
                                                         args=("--model", "gpt2", "--placement", "memory", "--min-workers", "2")) as server:
        page = context.new_page()
        page.goto(f"{server.url}/worker?memory={2**30}&threads=1&name=gputab")
        page.wait_for_selector("body[data-state='joined']", timeout=30000)
        tab = page.locator("#worker-id").inner_text()
        native = server.worker("--name", "native", "--memory", str(15 * 2**30), "--threads", "1")
        try:
            server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2, 300)
            other = next(w["id"] for w in server.status()["workers"] if w["id"] != tab)
            reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=300, json={"stages": [
                {"worker": tab, "start": 0, "end": 2}, {"worker": other, "start": 2, "end": 5}], "pin_s": 600})
            assert reply.status_code == 200, reply.text
            status = server.status()
            assert next(w for w in status["workers"] if w["id"] == tab)["device"] == "gpu"
            stages = status["plan"]["stages"]
            assert stages[0]["worker"] == tab and stages[0]["precision"] == pkg.manifest.precision
            messages = [{"role": "user", "content": "What is the tallest mountain on Earth?"}]
            r = server.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0,
                                                                  "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == reference(pkg, messages, 6, stages)
        finally:
            native.terminate()
            native.wait(timeout=15)
