"""A browser tab on WebGPU: headless chromium on SwiftShader serves the first stage next to a CPU worker.

The tab finds a WebGPU adapter (``--enable-unsafe-webgpu``; SwiftShader, Chromium's software
Vulkan: no GPU needed), says so in its hello (``device`` gpu, ``adapter``), asks for no
``precision`` and so runs the package's own variant (MatMulNBits) on onnxruntime-web's WebGPU
provider, keeping its KV cache in GPU buffers between steps. Its activations are relayed to the
native worker, which runs the rest on the CPU (in the GGUF kernel library's form where it loads).
Greedy tokens equal the single-process pipeline with the same cut and variants on the CPU: the GPU's float arithmetic differs from the CPU's in the last bits,
which holds for the few tokens asked here (SwiftShader is slow), not as a contract for long runs.
The 38-token prompt is past the 31 new positions a run may carry on SwiftShader: the tab runs its
prefill as chunks (worker.js, ``WEBGPU_PREFILL_CHUNK``), without which onnxruntime-web's
FlashAttention prefill shader gets layer 1 wrong (2.5 off of 39; the chunks give the same bits as
runs of 13: ``test_tab_runs_long_prefills_in_chunks...``). Greedy tokens do not show it; logprobs
would, but through this cut they are 0.5 from the single process with the tab's stage in fp32 even
in the prompt's first 31 positions (not explained yet), so they are not compared here.

SwiftShader takes ~350 ms per layer a step on two shared cores, so the join calibration (two
ranges of 34 steps, up to three rounds) would take minutes: the tab's calibration is given as
one a coordinator saved earlier (``calibration_file``, recalled by identity). The first plan's
stages are still timed on their own ranges before it serves.
"""

from __future__ import annotations

import json

import pytest

from edgepipe.model.store import local_form
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from browser import browser_context
from harness import Server, remember_device

pytestmark = pytest.mark.browser

TAB_UNITS = 2  # the embedding + 1 decoder layer run in the tab
TAB_MEMORY, NATIVE_MEMORY = 2**30, 15 * 2**30  # memory placement: 2 of 32 units in the tab
PROMPT = "What is the tallest mountain on Earth?"
TOKENS = 6
PREFILL_CHUNK = 31  # worker.js's WEBGPU_PREFILL_CHUNK: a SwiftShader tab runs longer prefills in chunks of this many


def remember_tab(home, manifest, name: str) -> None:
    """A calibration for the tab (identity as ``WorkerInfo.identity``)."""
    remember_device(home, manifest, [name, "browser", TAB_MEMORY, 1, "None", None, "gpu", "google swiftshader", None])


@pytest.fixture(scope="module")
def context():
    """One headless chromium with WebGPU for the module (Playwright's sync API allows one at a time)."""
    with browser_context(webgpu=True) as context:
        yield context


@pytest.fixture(scope="module")
def cluster(native_pkg, home, context):
    remember_tab(home, native_pkg.manifest, "gputab")
    with Server(home, workers=0, args=("--placement", "memory", "--min-workers", "2"), wait_up=False) as server:
        page = context.new_page()
        page.goto(f"{server.url}/worker?memory={TAB_MEMORY}&threads=1&name=gputab")
        page.wait_for_selector("body[data-state='joined']", timeout=30000)
        tab = page.locator("#worker-id").inner_text()
        native = server.worker("--name", "native", "--memory", str(NATIVE_MEMORY), "--threads", "1")
        try:
            server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2, 240)
            yield server, page, tab
        finally:
            native.terminate()
            native.wait(timeout=15)


def test_tab_on_webgpu_serves_the_reference_tokens(cluster, native_pkg):
    server, page, tab = cluster
    status = server.status()
    workers = {w["id"]: w for w in status["workers"]}
    assert workers[tab]["kind"] == "browser" and workers[tab]["device"] == "gpu", workers[tab]
    assert "swiftshader" in workers[tab]["adapter"] and workers[tab]["device_note"] is None
    native = next(w for w in workers.values() if w["kind"] == "native")
    assert native["device"] == "cpu"
    assert page.locator("#device").inner_text().startswith("GPU (WebGPU): google swiftshader")
    stages = status["plan"]["stages"]
    n_units = len(native_pkg.manifest.units)
    assert [(s["worker"], s["start"], s["end"]) for s in stages] == [(tab, 0, TAB_UNITS), (stages[1]["worker"], TAB_UNITS, n_units)]
    assert [e for e in server.client.get("/v1/cluster/events").json()["events"] if e["kind"] == "calibrated" and e["worker"] == tab][0]["reused"]
    assert page.evaluate("edgepipeWorker.prefillSetting(edgepipeWorker.worker.device).chunk") == PREFILL_CHUNK
    assert f"prefills run in chunks of at most {PREFILL_CHUNK} positions on this adapter (SwiftShader)" in page.locator("#log").inner_text()

    r = server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    tok = native_pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    # Each stage in the variant it was sent: the tab the package's own (it asked for none), the CPU
    # worker the form of the file's own model this machine runs (`gguf` where the kernel library loads).
    assert [s["precision"] for s in stages] == [native_pkg.manifest.precision, local_form(native_pkg)]
    pipeline = native_pkg.pipeline(cuts=[stages[1]["start"]], precisions=[s["precision"] for s in stages])
    want = generate(pipeline, ids, GenerationParams(max_tokens=TOKENS), tok.decode, native_pkg.manifest.eos_ids).tokens
    assert got == [t for t in want if t not in native_pkg.manifest.eos_ids]
    assert int(page.locator("#computed").inner_text()) >= TOKENS  # the prompt and every step went through the tab
    # It holds its stage's files in the package's own variant (a WebAssembly tab would have asked for fp32).
    held = set(page.evaluate("edgepipeWorker.worker.store.held()"))
    assert set(native_pkg.manifest.stage_files(0, TAB_UNITS)) <= held
    assert native_pkg.manifest.precision != "fp32"


def test_tab_runs_long_prefills_in_chunks_the_prefill_shader_would_get_wrong(cluster, native_pkg):
    """The 38-token prompt through the tab's stage three ways: in runs of 13 positions (the reference:
    under 32 onnxruntime-web takes the shader decode steps take, right on SwiftShader), as the tab
    runs it (chunks of at most 31) and whole (its FlashAttention prefill shader, wrong on SwiftShader)."""
    _, page, _ = cluster
    tok = native_pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    off = page.evaluate("""async (ids) => {
        const w = edgepipeWorker, r = [...w.worker.slots.values()].find((s) => s.plan > 0).runner;
        const x = (from, to) => ({ dtype: "int64", shape: [1, to - from], data: BigInt64Array.from(ids.slice(from, to), BigInt) });
        const chunk = r.prefillChunk;
        return await w.serial(async () => {
            try {
                const chunked = (await r.run("chunked", x(0, ids.length), null)).data;
                r.prefillChunk = 13;
                const steps = (await r.run("by-13", x(0, ids.length), null)).data;
                r.prefillChunk = 0;
                const whole = (await r.run("whole", x(0, ids.length), null)).data;
                const away = (d) => { let m = 0; for (let i = 0; i < d.length; i++) m = Math.max(m, Math.abs(d[i] - steps[i])); return m; };
                return { chunk, scale: away(new Float32Array(steps.length)), n: chunked.length === steps.length && whole.length === steps.length,
                         chunked: away(chunked), whole: away(whole) };
            } finally { r.prefillChunk = chunk; for (const s of ["by-13", "chunked", "whole"]) r.drop(s); }
        });
    }""", ids)
    assert off["chunk"] == PREFILL_CHUNK and len(ids) > PREFILL_CHUNK + 1 and off["n"], off
    assert off["chunked"] <= 1e-5 * off["scale"] and off["whole"] > 0.01 * off["scale"], off


@pytest.mark.slow  # ~16 s on SwiftShader (suite time): the tab on WebGPU serving exact tokens runs by default; KV on the device and its bytes per step are checked on the native EP (test_gpu)
def test_tab_keeps_its_kv_in_gpu_buffers_and_grows_it_exactly(cluster):
    """Steps of a sequence in the tab's stage: every past/present tensor it holds is a GPU buffer,
    also after the cache grew past its first block of 256 positions (read back through the host);
    the steps after the growth give what they give on a cache that had room from the start."""
    _, page, _ = cluster
    held = page.evaluate("""async () => {
        const w = edgepipeWorker, r = [...w.worker.slots.values()].find((s) => s.plan > 0).runner;
        const ids = (from, n) => ({ dtype: "int64", shape: [1, n], data: BigInt64Array.from({ length: n }, (_, i) => BigInt((from + i) * 7 % 1000)) });
        const where = (seq) => [...new Set(Object.values(r.caches.get(seq).kv).map((t) => t.location))];
        const steps = async (seq) => {
            await r.run(seq, ids(0, 250), null);
            const out = [];
            for (let p = 250; p < 260; p++) out.push(...(await r.run(seq, ids(p, 1), null)).data);
            return out;
        };
        return await w.serial(async () => {
            try {
                const roomy = { length: 0, capacity: 0, kv: {} };
                r.caches.set("kv-roomy", roomy);
                await r.reserve(roomy, 512);
                const want = await steps("kv-roomy");
                const got = await steps("kv-grown");
                const grown = r.caches.get("kv-grown");
                let diff = 0, scale = 0;
                for (let i = 0; i < want.length; i++) { diff = Math.max(diff, Math.abs(got[i] - want[i])); scale = Math.max(scale, Math.abs(want[i])); }
                return { onGpu: r.onGpu, layers: r.layers.length, capacity: grown.capacity, length: grown.length,
                         where: where("kv-grown"), roomyWhere: where("kv-roomy"), diff, scale };
            } finally { r.drop("kv-roomy"); r.drop("kv-grown"); }
        });
    }""")
    assert held["onGpu"] is True and held["layers"] == TAB_UNITS - 1, held
    assert (held["capacity"], held["length"], held["where"], held["roomyWhere"]) == (512, 260, ["gpu-buffer"], ["gpu-buffer"]), held
    assert held["scale"] > 0.1 and held["diff"] <= 1e-5 * held["scale"], held


# A WebGPU session that cannot be built (injected: onnxruntime-web's create refuses the webgpu provider).
REFUSE_WEBGPU = """
;(() => { const create = ort.InferenceSession.create.bind(ort.InferenceSession);
  ort.InferenceSession.create = (model, options) => options.executionProviders.includes("webgpu")
    ? Promise.reject(new Error("no kernel for this test")) : create(model, options); })();
"""


@pytest.mark.slow  # ~25 s: a second cluster, and the fp32 variant built if no test made it yet
def test_tab_whose_webgpu_session_fails_joins_again_on_webassembly(native_pkg, home, context):
    """The tab says why it left the GPU, joins again asking for fp32 as any WebAssembly tab, and its
    stage gives the reference tokens (that tab's stage in fp32, the native worker's in the package's variant)."""
    remember_tab(home, native_pkg.manifest, "failtab")
    with Server(home, workers=0, args=("--placement", "memory", "--min-workers", "2"), wait_up=False) as server:
        page = context.new_page()

        def refuse_webgpu(route):
            response = route.fetch()
            route.fulfill(response=response, body=response.text() + REFUSE_WEBGPU)

        page.route("**/static/vendor/ort.webgpu.min.js", refuse_webgpu)
        page.goto(f"{server.url}/worker?memory={TAB_MEMORY}&threads=1&name=failtab")
        native = server.worker("--name", "native", "--memory", str(NATIVE_MEMORY), "--threads", "1")
        try:
            status = server.wait_for(lambda s: s["state"] == "up" and s["plan"] is not None and len(s["plan"]["stages"]) == 2, 240)
            tab = next(w for w in status["workers"] if w["kind"] == "browser")
            assert (tab["device"], tab["adapter"]) == ("cpu", None)
            assert tab["device_note"] == "WebGPU session failed: no kernel for this test"
            stages = status["plan"]["stages"]
            assert tab["id"] in [s["worker"] for s in stages]
            assert page.locator("#device").inner_text() == "CPU (WebAssembly): WebGPU session failed: no kernel for this test"
            r = server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            tok = native_pkg.tokenizer
            ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
            native_pkg.reload()  # the coordinator added the fp32 variant for this tab
            pipeline = native_pkg.pipeline(cuts=[stages[1]["start"]], precisions=[s["precision"] for s in stages])
            want = generate(pipeline, ids, GenerationParams(max_tokens=TOKENS), tok.decode, native_pkg.manifest.eos_ids).tokens
            assert r.json()["choices"][0]["token_ids"] == [t for t in want if t not in native_pkg.manifest.eos_ids]
        finally:
            native.terminate()
            native.wait(timeout=15)

