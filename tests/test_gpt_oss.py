"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE: attention sinks, a sliding window on every other
layer, YaRN, biases on q/k/v/o, the router and the experts, the clamped SwiGLU, softmax over the
selected top k, MXFP4 experts) on a tiny synthetic GGUF, against a numpy reference of llama.cpp's
graph; llama.cpp itself and 3 worker processes in the slow tests."""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.bench.moe_files import gpt_oss_reference, synthetic_gpt_oss
from edgepipe.model.gguf_header import read_header, unsupported_reasons
from edgepipe.model.store import bundled_gguf, local_form, prepare_local_form, resolve
from edgepipe.model.weights import decode_native
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

# gpt-oss-20b's layer shrunk (head width 16: a rotary multiple of 16); a window of 4 so that the
# prompt (11 tokens) runs past it; 8 experts, top 4.
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, used=4, expert_ffn=64, layers=2, window=4)
IDS = list(range(100, 111))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss-tiny.gguf", bundled_gguf(), reference=True, **TINY)


@pytest.mark.pure
def test_mxfp4_blocks_decode_as_ggml_lays_them_out():
    """block_mxfp4: the E8M0 exponent byte, then 16 bytes whose low nibbles are elements 0..15 and
    high nibbles 16..31, each an e2m1 value (kvalues_mxfp4 / 2) times 2^(e - 127)."""
    import gguf
    from gguf.quants import dequantize

    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    rng = np.random.default_rng(1)
    nibbles = rng.integers(0, 16, 32)
    for e in (0, 1, 120, 127, 130, 200):  # (from about 253 up, 6 * 2^(e - 127) overflows float32 in ggml too)
        block = np.array([e, *(nibbles[:16] | (nibbles[16:] << 4))], np.uint8)[None, :]
        expected = np.array([e2m1[n] for n in nibbles], np.float64) * 2.0 ** (e - 127)
        mine = decode_native(block, "MXFP4", 32)
        assert mine.bits == 8 and np.array_equal(mine.dequantize()[0].astype(np.float64), expected), e
    raw = rng.integers(0, 256, (6, 3 * 17), dtype=np.uint8)  # random exponents and nibbles, against gguf-py's decoder too
    raw[:, 0::17] %= 240  # (exponents that stay finite in float32)
    assert np.array_equal(decode_native(raw, "MXFP4", 96).dequantize(), dequantize(raw, gguf.GGMLQuantizationType.MXFP4))


@pytest.mark.pure
def test_fallback_expert_products_read_activations_as_llama_cpp_quantizes_them():
    """The fallback's MXFP4 product (8-bit MatMulNBits, accuracy level 4) quantizes each block of
    32 activations to int8 at amax / 127, as llama.cpp's Q8_0 (MXFP4's vec_dot_type) does; only
    the block scale's fp16 rounding differs. Its agreement with llama.cpp rests on this: a product
    in float activations differs from llama.cpp's by the whole int8 rounding, 20x more."""
    import onnxruntime as ort
    from onnx import helper

    from edgepipe.model.graphs import FLOAT, _Graph

    rng = np.random.default_rng(3)
    n, k = 64, 2880  # gpt-oss-20b's expert input width
    raw = rng.integers(0, 256, (n, k // 32 * 17), dtype=np.uint8)
    raw[:, 0::17] = rng.integers(118, 124, raw[:, 0::17].shape)  # exponents of weights about 2^-5
    w = decode_native(raw, "MXFP4", k)
    g = _Graph("t.")
    g.linear("x", w, "expert", out="y")
    model = g.model([helper.make_tensor_value_info("x", FLOAT, [1, "seq", k])], [helper.make_tensor_value_info("y", FLOAT, [1, "seq", n])], "t")
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0].astype(np.float64)
    blocks = x.reshape(3, k // 32, 32)
    d = np.abs(blocks).max(-1, keepdims=True) / 127
    q = np.round(blocks / d)
    weights = w.dequantize().astype(np.float64)

    def error(activations) -> float:
        want = activations.reshape(1, 3, k).astype(np.float64) @ weights.T
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    exact, int8, llama_q8_0 = error(x), error(q * d), error(q * d.astype(np.float16))
    assert int8 < 1e-5 and llama_q8_0 < 1e-3 < exact and llama_q8_0 * 10 < exact, (int8, llama_q8_0, exact)


def test_gpt_oss_file_equals_llama_cpp_reference(home, tiny):
    path, weights = tiny
    assert unsupported_reasons(read_header(path)) == []  # (refused before: 'gpt-oss' was no architecture, MXFP4 no type)
    ref_hidden, ref_logits = gpt_oss_reference(weights, IDS)
    # float weights (exact up to float rounding); then the file's blocks (MXFP4 -> 8-bit MatMulNBits
    # exactly, activations quantized to int8 as llama.cpp quantizes them to Q8_0; gguf: fp16 KV)
    for precision, tolerance in (("fp32", 1e-5), ("native", 0.06), (None, 0.06)):
        pkg = resolve(str(path), precision or "native", home)
        if precision is None:
            prepare_local_form(pkg)
            precision = local_form(pkg)
            if precision == "gguf":  # the MXFP4 experts as 3-D blocks on the kernel library (GGML type 39)
                graph = pkg.blob(pkg.manifest.units[1].variants["gguf"].graph).read_bytes()
                assert b"GgufMoEMatMul" in graph and b"MatMulNBits" not in graph
        cfg = pkg.manifest.config
        assert (cfg["n_experts"], cfg["n_experts_used"], cfg["expert_gating"], cfg["ffn_activation"]) == (8, 4, "softmax_weight", "swiglu_oai")
        assert cfg["attention_sinks"] and cfg["layer_windows"] == [4, 0] and cfg["rope_yarn_factor"] == 32.0
        hidden = pkg.runner(0, TINY["layers"] + 1, precision).run("s", np.array([IDS]))[0]
        error = np.linalg.norm(hidden - ref_hidden, axis=-1) / np.linalg.norm(ref_hidden, axis=-1)
        assert error.max() < tolerance, (precision, error)
        if precision == "fp32":  # greedy decode steps past the window, against the reference's argmax at each
            result = generate(pkg.pipeline([2], precision=precision), IDS, GenerationParams(max_tokens=4), pkg.tokenizer.decode, eos_ids=())
            expected = []
            for _ in range(4):
                expected.append(int(np.argmax(gpt_oss_reference(weights, IDS + expected)[1][-1])))
            assert result.tokens == expected


def test_kernel_form_with_experts_as_3d_blocks_equals_reference(home, tmp_path):
    """Experts of another type the kernel library runs (Q8_0 here; MXFP4 in the test above) stay
    3-D blocks under GgufMoEMatMul, with each slot's expert bias gathered beside them."""
    from edgepipe.native import gguf_kernel_library

    if gguf_kernel_library() is None:
        pytest.skip("no kernel library on this machine")
    path, weights = synthetic_gpt_oss(tmp_path / "gpt-oss-q8.gguf", bundled_gguf(), reference=True, expert_type="Q8_0", **TINY)
    pkg = resolve(str(path), "native", home)
    prepare_local_form(pkg)
    assert local_form(pkg) == "gguf"
    graph = pkg.blob(pkg.manifest.units[1].variants["gguf"].graph).read_bytes()
    assert b"GgufMoEMatMul" in graph and b"KvAttention" in graph
    hidden = pkg.runner(0, TINY["layers"] + 1, "gguf").run("s", np.array([IDS]))[0]
    ref_hidden, _ = gpt_oss_reference(weights, IDS)
    error = np.linalg.norm(hidden - ref_hidden, axis=-1) / np.linalg.norm(ref_hidden, axis=-1)
    assert error.max() < 0.1, error


_ORT_WEB = """
import { createRequire } from "module";
import fs from "fs";
const require = createRequire(import.meta.url);
const [vendor, dir] = process.argv.slice(2);
const ort = require(vendor + "/ort.webgpu.min.js");
ort.env.wasm.numThreads = 1;
ort.env.wasm.wasmPaths = vendor + "/";
const kinds = { float32: Float32Array, int32: Int32Array, int64: BigInt64Array };
for (const unit of JSON.parse(fs.readFileSync(dir + "/units.json"))) {
  const meta = JSON.parse(fs.readFileSync(`${dir}/${unit}.json`));
  const feeds = {};
  for (const [name, [dtype, shape]] of Object.entries(meta.inputs)) {
    const bytes = new Uint8Array(fs.readFileSync(`${dir}/${unit}.${name}.bin`));
    feeds[name] = new ort.Tensor(dtype, new kinds[dtype](bytes.buffer), shape);
  }
  const session = await ort.InferenceSession.create(fs.readFileSync(`${dir}/${unit}.onnx`), { executionProviders: ["wasm"], graphOptimizationLevel: "all" });
  const out = await session.run(feeds);
  for (const name of meta.outputs) fs.writeFileSync(`${dir}/${unit}.out.${name}.bin`, Buffer.from(out[name].data.buffer));
}
console.log("written");  // then the caller ends the process: the runtime's threads keep it from exiting
"""


def test_layers_run_in_onnxruntime_web(home, tiny, tmp_path):
    """A tab's runtime (the vendored onnxruntime-web on WebAssembly, under Node) runs the fp32 form
    a tab is sent of both layers (sinks as GroupQueryAttention's ``head_sink``, the windowed
    layer's ``local_window_size``, YaRN, the experts' plain ops), a prompt past the window: hidden
    states and KV equal ONNX Runtime's on the CPU, which moves far without the sinks. (Chromium
    tabs, WebAssembly and WebGPU, through a cluster: ``test_gpt_oss_browser``, ``-m slow``.)"""
    import json
    import shutil

    import onnx
    import onnxruntime as ort
    from onnx.external_data_helper import load_external_data_for_model

    from edgepipe.model.importer import add_variant

    node = shutil.which("node")
    assert node is not None, "node is missing (apt-get install nodejs)"
    pkg = resolve(str(tiny[0]), "native", home)
    add_variant(pkg.root, "fp32", units=(1, 2))
    pkg.reload()
    rng = np.random.default_rng(2)
    S, capacity, H, kv, D = len(IDS), 16, TINY["hidden"], TINY["kv_heads"], TINY["head_dim"]
    expected, without_sinks, units = {}, {}, []
    for u in (1, 2):
        path = pkg.blob(pkg.manifest.units[u].variants["fp32"].graph)
        model = onnx.load(str(path), load_external_data=False)
        load_external_data_for_model(model, str(path.parent))
        names = [i.name for i in model.graph.input]
        feeds = {f"hidden.{u}": rng.standard_normal((1, S, H)).astype(np.float32),
                 f"past_key.{u}": np.zeros((1, kv, capacity, D), np.float32), f"past_value.{u}": np.zeros((1, kv, capacity, D), np.float32)}
        for prefix in ("", "window_"):  # as worker.js feeds them: every position kept, buffer index = position
            if f"{prefix}seqlens_k" in names:
                feeds[f"{prefix}seqlens_k"], feeds[f"{prefix}total_sequence_length"] = np.array([S - 1], np.int32), np.array(S, np.int32)
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(S, dtype=np.int64)[None]
        outputs = [o.name for o in model.graph.output]
        expected[u] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(outputs, feeds)
        gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
        assert gqa.input[11] == f"l{u}.attn_sinks" and any(a.name == "local_window_size" and a.i == (4 if u == 1 else -1) for a in gqa.attribute)
        (tmp_path / f"u{u}.onnx").write_bytes(model.SerializeToString())
        gqa.input[11] = ""
        without_sinks[u] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(outputs[:1], feeds)[0]
        for name, value in feeds.items():
            value.tofile(tmp_path / f"u{u}.{name}.bin")
        (tmp_path / f"u{u}.json").write_text(json.dumps({"inputs": {k: [str(v.dtype), list(v.shape)] for k, v in feeds.items()}, "outputs": outputs}))
        units.append(f"u{u}")
    (tmp_path / "units.json").write_text(json.dumps(units))
    from browser import run_under_ort_web

    run_under_ort_web(node, _ORT_WEB, tmp_path, "layers")
    for u in (1, 2):
        outputs = json.loads((tmp_path / f"u{u}.json").read_text())["outputs"]
        for name, want in zip(outputs, expected[u]):
            got = np.fromfile(tmp_path / f"u{u}.out.{name}.bin", np.float32).reshape(want.shape)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"layer {u}: {name}")
        assert np.abs(without_sinks[u] - expected[u][0]).max() > 0.1, u  # (about 2.4)


@pytest.mark.slow  # llama.cpp loads the same file (~10 s)
def test_llama_cpp_runs_the_file_as_the_reference_does(tiny):
    """The reference is llama.cpp's graph: its logits are llama.cpp's up to llama.cpp's own rounding
    (Q8_0 activations), and each feature left out moves them an order of magnitude further."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, weights = tiny
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(IDS)
    theirs = np.array(llm.scores[: len(IDS)])

    def distance(w) -> float:
        ref = gpt_oss_reference(w, IDS)[1]
        return float((np.linalg.norm(theirs - ref, axis=-1) / np.linalg.norm(ref, axis=-1)).mean())

    base = distance(weights)
    no_sinks = dict(weights, **{f"blk.{i}.attn_sinks.weight": np.full(TINY["heads"], -1e30, np.float32) for i in range(TINY["layers"])})
    no_window = dict(weights, shapes=dict(weights["shapes"], window=10_000))
    assert base < 0.05, base
    assert distance(no_sinks) > 5 * base and distance(no_window) > 5 * base


@pytest.mark.slow  # worker processes (~30 s)
def test_three_workers_with_cuts_between_moe_layers_equal_one_process(home, tmp_path_factory):
    from harness import Server

    path, _ = synthetic_gpt_oss(tmp_path_factory.mktemp("gpt-oss-4") / "gpt-oss-tiny4.gguf", bundled_gguf(), **{**TINY, "layers": 4})
    pkg = resolve(str(path), "native", home)
    prepare_local_form(pkg)
    prompts = ["The experts of a mixture are chosen per token.", "Sliding windows alternate with full attention."]
    with Server(home, workers=3, args=("--placement", "memory", "--model", pkg.root.name)) as server:
        stages = server.status()["plan"]["stages"]
        assert len(stages) == 3 and all(1 < s["start"] < 5 for s in stages[1:])  # both cuts between MoE layers
        for prompt in prompts:
            r = server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            tok, eos = pkg.tokenizer, pkg.manifest.eos_ids
            ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
            alone = generate(pkg.pipeline([], precision=local_form(pkg)), ids, GenerationParams(max_tokens=24), tok.decode, eos).tokens
            assert r.json()["choices"][0]["token_ids"] == [t for t in alone if t not in eos], prompt


def stream_ids(server, prompt: str, n: int, at: int, act) -> list[int]:
    """A greedy chat stream's token ids (``return_token_ids``: each chunk those since the last),
    ``act()`` called once when ``at`` ids have arrived."""
    import json

    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    ids: list[int] = []
    done = False
    with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += [t for choice in chunk["choices"] for t in choice.get("token_ids", [])]
                if len(ids) >= at and not done:
                    act()
                    done = True
    assert done, ids
    return ids


@pytest.mark.slow  # three worker processes (~45 s)
def test_three_workers_keep_one_process_tokens_through_a_move_and_a_kill(home, tmp_path_factory):
    """gpt-oss stages (cuts between MoE layers, sliding-window and full layers on both sides): a
    forced rebalance mid-stream moves their KV, a SIGKILLed worker mid-stream is replayed on the
    survivors; every token is the single process's, greedy."""
    import os
    import signal

    from harness import Server
    from test_living_cluster import events
    from test_moe_cluster import rebalance, solo

    path, _ = synthetic_gpt_oss(tmp_path_factory.mktemp("gpt-oss-6") / "gpt-oss-tiny6.gguf", bundled_gguf(), **{**TINY, "layers": 6})
    pkg = resolve(str(path), "native", home)
    prepare_local_form(pkg)
    # 96 tokens: a tiny model streams them fast; the move and the kill must land while it still runs
    n_tokens, prompt = 96, "Tell me a long story about a lighthouse keeper."
    expected = solo(pkg, [{"role": "user", "content": prompt}], n_tokens, ignore_eos=True)
    assert len(expected) == n_tokens and len(set(expected)) > 5  # a non-trivial sequence
    # --direct-steps 0: a direct run of several stages on a sliding-window model is replayed, not
    # moved, on a plan change (its stages hold unequal lengths, and a window layer's KV would not
    # line up: tests/test_direct.py), and this test is about the move; the tokens stay equal either way
    args = ("--placement", "memory", "--batch-invariant", "--direct-steps", "0", "--model", pkg.root.name)
    with Server(home, workers=3, args=args, timeout=300) as server:
        n = server.status()["n_units"]
        assert n == 8  # embedding, 6 MoE layers, head
        a, b, c = sorted(w["id"] for w in server.status()["workers"])
        rebalance(server, [(a, 0, 3), (b, 3, 5), (c, 5, n)])
        moved: dict = {}
        got = stream_ids(server, prompt, n_tokens, 10, lambda: moved.update(rebalance(server, [(b, 0, 2), (c, 2, 6), (a, 6, n)])))
        assert moved and got == expected
        up = [e for e in events(server, "up") if e.get("plan") == moved["plan"]]
        assert up and up[0]["kv_moved"] == 1 and up[0]["kv_recomputed"] == 0 and up[0]["kv_moved_bytes"] > 0, up

        rebalance(server, [(a, 0, 2), (b, 2, 6), (c, 6, n)])
        victim = next(w for w in server.status()["workers"] if w["id"] == b)
        got = stream_ids(server, prompt, n_tokens, 10, lambda: os.kill(victim["pid"], signal.SIGKILL))
        assert got == expected
        assert events(server, "leave") and events(server, "recovered")
