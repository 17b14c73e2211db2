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
