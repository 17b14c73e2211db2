"""A browser tab as a worker: it serves a stage exactly, caches its unit files, and needs the token.

One native worker (the file's own model) and one headless-chromium tab on ``/worker`` (onnxruntime-web,
WebAssembly, the fp32 variant: this chromium offers no WebGPU adapter; test_browser_webgpu.py has one) share the model; ``--placement memory`` and the declared memory
put ``BROWSER_UNITS`` units in the tab: the last ones (layers + head, the tab returns token ids)
or the first ones (embedding + layers, the tab's activations are relayed to the native worker).
The reference is the single-process pipeline with the same cut and the same variant per stage.
A reloaded tab re-joins from its cache; a tab without the join token is refused.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from edgepipe.model.importer import add_variant
from edgepipe.model.store import local_form
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from browser import browser_context
from harness import Server

pytestmark = pytest.mark.browser

BROWSER_UNITS = 8  # 7 decoder layers + the head run in the tab
PROMPT = "Write a haiku about rain."  # the `gguf` form alone and the mixed `gguf`/fp32 pipeline differ on it (at token 12)
JOIN_TOKEN = "tab-secret"





@pytest.fixture(scope="module")
def pkg(native_pkg):
    """The bundled package (the file's own model) with its fp32 variant (what a browser asks for) added on disk."""
    add_variant(native_pkg.root, "fp32")
    native_pkg.reload()
    return native_pkg


@dataclass
class Cluster:
    server: Server
    page: object
    blob_requests: list[str] = field(default_factory=list)  # every /v1/blobs/ request the browser made

    def browser_id(self) -> str | None:
        return next((w["id"] for w in self.server.status()["workers"] if w["kind"] == "browser"), None)

    def wait_plan_with(self, worker_id: str, timeout: float = 150) -> dict:
        return self.server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2
                                    and s["plan"]["stages"][-1]["worker"] == worker_id, timeout)


def open_worker_tab(context, url: str):
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("body[data-state='joined']", timeout=30000)
    return page


@pytest.fixture(scope="module")
def context():
    """One headless chromium for the module (Playwright's sync API allows one at a time)."""
    with browser_context() as context:
        yield context


@pytest.fixture(scope="module")
def cluster(pkg, home, context):
    with Server(home, workers=1, args=("--placement", "memory", "--min-workers", "2"), wait_up=False) as server:
        native = server.wait_for(lambda s: len(s["workers"]) == 1, 60)["workers"][0]
        n_units = len(pkg.manifest.units)
        memory = native["memory_bytes"] * BROWSER_UNITS // (n_units - BROWSER_UNITS)  # proportional split: last 8 units
        c = Cluster(server, None)
        context.on("request", lambda r: c.blob_requests.append(r.url) if r.url.startswith(f"{server.url}/v1/blobs/") else None)
        c.page = open_worker_tab(context, f"{server.url}/worker?memory={memory}&name=tab")
        c.wait_plan_with(c.browser_id())
        yield c


def reference_tokens(pkg, status: dict, prompt: str, max_tokens: int, precisions: list[str] | None = None) -> list[int]:
    """Single-process tokens with the plan's cuts and each stage's variant as the plan says (browser:
    fp32, native: the form of the file's own model this machine runs), or ``precisions``."""
    stages = status["plan"]["stages"]
    precisions = precisions or [s["precision"] for s in stages]
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    pipeline = pkg.pipeline(cuts=[s["start"] for s in stages[1:]], precisions=precisions)
    tokens = generate(pipeline, ids, GenerationParams(max_tokens=max_tokens), tok.decode, pkg.manifest.eos_ids).tokens
    return [t for t in tokens if t not in pkg.manifest.eos_ids]


def chat(server: Server, prompt: str, max_tokens: int) -> list[int]:
    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_tab_serves_a_stage_with_the_reference_tokens(cluster, pkg):
    status = cluster.server.status()
    tab = cluster.browser_id()
    assert [(s["start"], s["end"]) for s in status["plan"]["stages"]] == [(0, 32 - BROWSER_UNITS), (32 - BROWSER_UNITS, 32)]
    assert {w["kind"] for w in status["workers"]} == {"native", "browser"}
    browser = next(w for w in status["workers"] if w["kind"] == "browser")
    # This chromium has no WebGPU (no --enable-unsafe-webgpu): the tab computes on WebAssembly and says why.
    assert (browser["device"], browser["adapter"], browser["device_note"]) == ("cpu", None, "no WebGPU adapter")
    page = cluster.page
    assert page.locator("#device").inner_text() == "CPU (WebAssembly): no WebGPU adapter"
    assert page.locator("#worker-id").inner_text() == tab
    assert page.evaluate("crossOriginIsolated") is True  # COOP + COEP: WebAssembly threads are available

    got = chat(cluster.server, PROMPT, 24)
    assert [s["precision"] for s in status["plan"]["stages"]] == [local_form(pkg), "fp32"]
    expected = reference_tokens(pkg, status, PROMPT, 24)
    assert got == expected
    # The pipeline without fp32 says something else here, so the tab really ran its fp32 stage.
    assert got != reference_tokens(pkg, status, PROMPT, 24, precisions=[local_form(pkg)] * 2)
    page.wait_for_function(f"document.getElementById('tokens').textContent === '{len(got)}'", timeout=10000)
    assert page.locator("#units").inner_text().startswith(f"[{32 - BROWSER_UNITS}, 32)")
    # The page's SHA-256 fallback (pages outside a secure context have no crypto.subtle) is right.
    data = "edgepipe " * 20
    assert page.evaluate("s => edgepipeWorker.sha256Fallback(new TextEncoder().encode(s))", data) == hashlib.sha256(data.encode()).hexdigest()


def test_tab_as_last_stage_applies_logit_controls_and_returns_logprobs(cluster, pkg):
    """Echo logprobs, top-N, logit_bias and a penalty computed in the tab's head graph (issue 15):
    the same tokens and logprobs (to 1e-3) as the single-process pipeline with the same cut and variants."""
    status = cluster.server.status()
    kinds = {w["id"]: w["kind"] for w in status["workers"]}
    stages = status["plan"]["stages"]
    assert kinds[stages[-1]["worker"]] == "browser"
    pipeline = pkg.pipeline(cuts=[s["start"] for s in stages[1:]], precisions=[s["precision"] for s in stages])
    tok = pkg.tokenizer
    ids = tok.encode("The capital of France is")
    first = generate(pipeline, ids, GenerationParams(max_tokens=1), tok.decode, pkg.manifest.eos_ids).tokens[0]
    params = dict(max_tokens=6, frequency_penalty=1.0, logit_bias=((first, -100.0),))
    want = generate(pipeline, ids, GenerationParams(**params, logprobs=True, top_logprobs=2, prompt_logprobs=True), tok.decode,
                    pkg.manifest.eos_ids)
    r = cluster.server.client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 2, "frequency_penalty": 1.0,
        "logit_bias": {str(first): -100}, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.tokens[: len(choice["token_ids"])] and first not in choice["token_ids"]
    got = choice["logprobs"]["token_logprobs"]
    expected = [None] + [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert got[0] is None and len(got) == len(expected)
    assert all(abs(a - b) < 1e-3 for a, b in zip(got[1:], expected[1:])), (got, expected)


@pytest.mark.slow
def test_tab_reloaded_mid_request_rejoins_from_its_cache(cluster, pkg):
    """Reloading the tab while it serves a request: the request pauses and carries on (on
    whichever plan the coordinator finds: tokens before the pause are the reference's), and
    the re-joined tab downloads no unit file."""
    server, page = cluster.server, cluster.page
    before = cluster.browser_id()
    assert cluster.blob_requests, "the first load fetched the tab's unit files"
    assert int(page.locator("#fetched").inner_text()) > 100_000_000
    events = lambda: server.client.get("/v1/cluster/events").json()["events"]  # noqa: E731
    ups = len([e for e in events() if e["kind"] == "up"])
    expected = reference_tokens(pkg, server.status(), PROMPT, 40)
    cluster.blob_requests.clear()

    sampled = int(page.locator("#tokens").inner_text())
    reply: dict = {}

    def request() -> None:
        with httpx.Client(base_url=server.url, timeout=180) as client:
            reply["r"] = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0, "return_token_ids": True})

    thread = threading.Thread(target=request)
    thread.start()
    page.wait_for_function(f"Number(document.getElementById('tokens').textContent) >= {sampled + 3}", timeout=60000, polling=5)
    page.reload()
    page.wait_for_selector("body[data-state='joined']", timeout=30000)
    after = page.locator("#worker-id").inner_text()
    assert after != before
    plan = cluster.wait_plan_with(after)["plan"]["id"]
    thread.join(180)
    assert reply["r"].status_code == 200, reply["r"].text
    tokens = reply["r"].json()["choices"][0]["token_ids"]
    pause = next(e for e in events() if e["kind"] == "pause")
    assert 3 <= pause["step"] and tokens[: pause["step"]] == expected[: pause["step"]]
    assert len(tokens) == 40 or reply["r"].json()["choices"][0]["finish_reason"] == "stop"
    assert [e for e in events() if e["kind"] == "recovered"], "the request resumed after the reload"

    page.wait_for_function("document.getElementById('units').textContent !== '–'", timeout=10000)
    assert cluster.blob_requests == []  # no unit file crossed the network again
    assert page.locator("#fetched").inner_text() == "0"
    assert int(page.locator("#hits").inner_text()) > 0
    up = [e for e in events() if e["kind"] == "up"][ups:]
    assert [e["fetched_bytes"] for e in up if e["plan"] == plan] == [0]  # the plan with the re-joined tab
    assert chat(server, PROMPT, 8) == expected[:8]


@pytest.mark.slow
def test_tab_with_a_wrong_or_missing_token_is_refused(pkg, home, context):
    with Server(home, workers=1, args=("--placement", "memory", "--join-token", JOIN_TOKEN)) as server:
        wrong = context.new_page()
        wrong.goto(f"{server.url}/worker?token=not-the-token")
        missing = context.new_page()
        missing.goto(f"{server.url}/worker")
        for page, reason in ((wrong, "wrong or missing join token"), (missing, "missing join token")):
            page.wait_for_selector("body[data-state='refused']", timeout=30000)
            assert reason in page.locator("#message").inner_text()
            assert page.locator("#worker-id").inner_text() == "–"
        time.sleep(1.0)  # a refused tab must not retry on its own
        assert [w["kind"] for w in server.status()["workers"]] == ["native"]
        refused = [e for e in server.client.get("/v1/cluster/events").json()["events"] if e["kind"] == "refused"]
        assert len(refused) == 2

        # The same page joins once the right token is typed in, and may then fetch unit files.
        missing.fill("#token", JOIN_TOKEN)
        missing.click("#joinbtn")
        missing.wait_for_selector("body[data-state='joined']", timeout=30000)
        tab = missing.locator("#worker-id").inner_text()
        assert tab in [w["id"] for w in server.status()["workers"]]

        def calibration(s) -> bool:
            events = server.client.get("/v1/cluster/events").json()["events"]
            return any(e.get("worker") == tab and e["kind"] in ("calibrated", "calibration_failed") for e in events)

        server.wait_for(calibration, 90)
        events = server.client.get("/v1/cluster/events").json()["events"]
        assert [e["kind"] for e in events if e.get("worker") == tab and e["kind"].startswith("calibrat")] == ["calibrated"]


@pytest.mark.slow  # 17 s: -m slow (a tab serving a middle stage stays in the default run)
def test_tab_as_first_stage_relays_its_activations(pkg, home, context):
    """The tab takes token ids and its activations go to the native worker through the coordinator."""
    with Server(home, workers=0, args=("--placement", "memory", "--min-workers", "2"), wait_up=False) as server:
        page = open_worker_tab(context, f"{server.url}/worker?memory=1GB&name=tab")  # 1 : 3 of the memory -> 8 of 32 units
        tab = page.locator("#worker-id").inner_text()
        native = server.worker("--name", "native", "--memory", "3GB", "--threads", "1")
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2, 150)
            assert [(s["worker"], s["start"], s["end"]) for s in status["plan"]["stages"]][0] == (tab, 0, BROWSER_UNITS)
            assert chat(server, PROMPT, 16) == reference_tokens(pkg, status, PROMPT, 16)
            assert page.locator("#tokens").inner_text() == "0"  # the head is on the native worker
            assert int(page.locator("#computed").inner_text()) >= 16
        finally:
            native.terminate()
            native.wait(timeout=15)
