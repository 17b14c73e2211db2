"""gpt-oss in a browser tab: the tiny synthetic file's MoE layers (attention sinks through
GroupQueryAttention's ``head_sink``, a sliding window on layer 0, YaRN, the clamped SwiGLU, MXFP4
experts) run in headless chromium's onnxruntime-web, on WebAssembly (the fp32 variant) and on
WebGPU (SwiftShader; the package's own variant: 8-bit MatMulNBits), beside a native worker.

Greedy tokens equal the single-process pipeline with the same cut, and so do the logprobs of the
prompt and of each token (to 1e-3). On WebGPU the reference runs the tab's stage in fp32:
onnxruntime-web's MatMulNBits multiplies float activations by the dequantized blocks (its output
equals the fp32 variant's to 3e-6 on these layers), where the CPU provider at accuracy level 4
quantizes activations to int8 first (1% away on these layers), so the CPU's run of the package's
own variant is not what the tab computes. The WebGPU test's 37-token prompt is one the tab runs
as two chunks (see ``SHORT``)."""

from __future__ import annotations

import httpx
import pytest

from edgepipe.bench.moe_files import synthetic_gpt_oss
from edgepipe.model.importer import add_variant
from edgepipe.model.store import bundled_gguf, local_form, prepare_local_form, resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from browser import browser_context
from harness import Server
from test_browser_worker import open_worker_tab
from test_gpt_oss import TINY

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PROMPT = "Tell me about a lighthouse keeper."  # with the chat template (37 tokens), past layer 0's window of 4
# 11 tokens without it: on SwiftShader a run of 32 or more new positions takes onnxruntime-web
# 1.30's FlashAttention prefill shader, which computes full attention wrong there (every family;
# the adapter's subgroups are 4 wide); under 32 it takes the decode shader, which is right. The
# tab runs the 37 as chunks of at most 31 (worker.js, WEBGPU_PREFILL_CHUNK), and both prompts pass.
SHORT = "The keeper of the lighthouse climbed the stairs at dusk to"
N_UNITS = TINY["layers"] + 2  # embedding, a windowed and a full MoE layer, head


@pytest.fixture(scope="module")
def gpt_oss(home, tmp_path_factory):
    path, _ = synthetic_gpt_oss(tmp_path_factory.mktemp("gpt-oss-tab") / "gpt-oss-tab.gguf", bundled_gguf(), **TINY)
    pkg = resolve(str(path), "native", home)
    prepare_local_form(pkg)
    add_variant(pkg.root, "fp32")
    pkg.reload()
    return pkg


def prompt_ids(pkg, short: bool = False) -> list[int]:
    tok = pkg.tokenizer
    return tok.encode(SHORT) if short else tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))


def reference(pkg, stages: list[dict], precisions: list[str], n: int, short: bool = False) -> tuple[list[int], list[float]]:
    """Single-process greedy tokens with the plan's cuts and ``precisions``, and the logprob of
    each prompt token after the first and of each token it samples."""
    pipe = pkg.pipeline([s["start"] for s in stages[1:]], precisions=precisions)
    params = GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    out = generate(pipe, prompt_ids(pkg, short), params, pkg.tokenizer.decode, eos_ids=())
    return out.tokens, [e.logprob for e in out.prompt_logprobs[1:]] + [e.logprob for e in out.logprobs]


def served(server: Server, pkg, n: int, short: bool = False) -> tuple[list[int], list[float]]:
    """The cluster's greedy tokens for the same prompt, with the same logprobs (echo)."""
    r = server.client.post("/v1/completions", json={"prompt": prompt_ids(pkg, short), "max_tokens": n, "temperature": 0, "echo": True,
                                                     "logprobs": 1, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"][1:]


def distance(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def rebalance(server: Server, stages: list[tuple[str, int, int]]) -> list[dict]:
    reply = httpx.post(server.url + "/v1/cluster/rebalance", timeout=300, json={
        "stages": [{"worker": w, "start": a, "end": b} for w, a, b in stages], "pin_s": 600})
    assert reply.status_code == 200, reply.text
    return server.status()["plan"]["stages"]


def test_tab_on_webassembly_runs_gpt_oss_layers(home, gpt_oss):
    pkg = gpt_oss
    with browser_context() as context, Server(home, workers=1, timeout=300, wait_up=False,
                                              args=("--model", pkg.root.name, "--placement", "memory", "--min-workers", "2")) as server:
        native = server.wait_for(lambda s: len(s["workers"]) == 1, 120)["workers"][0]["id"]
        open_worker_tab(context, f"{server.url}/worker?memory={1 << 30}&name=tab")
        status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["workers"]) == 2, 240)
        tab = next(w["id"] for w in status["workers"] if w["kind"] == "browser")
        # the embedding and both MoE layers in the tab; then both layers and the head (its logprobs)
        for placement in ([(tab, 0, 3), (native, 3, N_UNITS)], [(native, 0, 1), (tab, 1, N_UNITS)]):
            stages = rebalance(server, placement)
            precisions = [s["precision"] for s in stages]
            assert precisions == ["fp32" if w == tab else local_form(pkg) for w, _, _ in placement], stages
            tokens, logprobs = served(server, pkg, 16)
            want, want_logprobs = reference(pkg, stages, precisions, 16)
            other = reference(pkg, stages, [local_form(pkg)] * 2, 16)[1]
            assert tokens == want and len(set(tokens)) > 3, placement
            # 2e-5 here; the CPU's form of the file (int8 activations) is 0.2 away: the tab ran fp32
            assert distance(logprobs, want_logprobs) < 1e-3 < 0.05 < distance(logprobs, other), placement


@pytest.mark.parametrize("short", [True, False], ids=["11-token prompt", "37-token prompt"])
def test_tab_on_webgpu_runs_gpt_oss_layers(home, gpt_oss, short):
    from test_browser_webgpu import remember_tab

    pkg = gpt_oss
    remember_tab(home, pkg.manifest, "gputab")
    with browser_context(webgpu=True) as context, Server(home, workers=0, timeout=300, wait_up=False,
                                                         args=("--model", pkg.root.name, "--placement", "memory", "--min-workers", "2")) as server:
        page = open_worker_tab(context, f"{server.url}/worker?memory={1 << 30}&threads=1&name=gputab")
        tab = page.locator("#worker-id").inner_text()
        native = server.worker("--name", "native", "--memory", str(4 << 30), "--threads", "1")
        try:
            server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["workers"]) == 2, 300)
            other_worker = next(w["id"] for w in server.status()["workers"] if w["id"] != tab)
            assert next(w for w in server.status()["workers"] if w["id"] == tab)["device"] == "gpu"
            stages = rebalance(server, [(tab, 0, 3), (other_worker, 3, N_UNITS)])
            assert [s["precision"] for s in stages] == [pkg.manifest.precision, local_form(pkg)]
            assert (4 < len(prompt_ids(pkg, short)) < 32) == short
            tokens, logprobs = served(server, pkg, 8, short)
            want, want_logprobs = reference(pkg, stages, ["fp32", local_form(pkg)], 8, short)
            other = reference(pkg, stages, [pkg.manifest.precision, local_form(pkg)], 8, short)[1]
            assert tokens == want and len(set(tokens)) > 2
            assert distance(logprobs, want_logprobs) < 1e-3 < 0.05 < distance(logprobs, other)  # 1e-5; 0.25
            if not short:  # both layers and the head in the tab: its chunks' prompt logprobs joined, the last one's token
                stages = rebalance(server, [(other_worker, 0, 1), (tab, 1, N_UNITS)])
                tokens, logprobs = served(server, pkg, 8)
                want, want_logprobs = reference(pkg, stages, [local_form(pkg), "fp32"], 8)
                other = reference(pkg, stages, [local_form(pkg), pkg.manifest.precision], 8)[1]
                assert tokens == want and len(set(tokens)) > 2
                assert distance(logprobs, want_logprobs) < 1e-3 < 0.05 < distance(logprobs, other)
        finally:
            native.terminate()
            native.wait(timeout=15)
