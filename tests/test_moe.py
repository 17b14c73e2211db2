"""Mixture-of-experts layers (``model/moe.py``): llama.cpp's routing, and the bundled SmolLM2
upcycled into 4 experts (top 2) giving the dense model's tokens, in one process and through 3;
Qwen2.5-Coder-0.5B upcycled as ``llama`` (``-m slow``) giving the dense text."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from edgepipe.model.config import ModelConfig
from edgepipe.model.gguf_header import GGUFHeader, TensorInfo, unsupported_reasons
from edgepipe.model.graphs import FLOAT, _ffn, _Graph
from edgepipe.model.moe import moe_ffn
from edgepipe.model.store import bundled_gguf, local_form, prepare_local_form, resolve
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

from edgepipe.bench.moe_files import as_llama, neox_to_interleaved, upcycle

PROMPTS = ["List three facts about the Moon.", "Write a short poem about a cat."]


# -- the header --------------------------------------------------------------------------------
def _header(arch: str = "llama", extra_meta: dict | None = None, extra_tensors: tuple[str, ...] = ()) -> GGUFHeader:
    meta = {"general.architecture": arch, "tokenizer.ggml.model": "gpt2", f"{arch}.expert_count": 8,
            f"{arch}.expert_used_count": 2, **(extra_meta or {})}
    names = ["token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.attn_output.weight",
             "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.ffn_gate_inp.weight", *extra_tensors]
    tensors = {n: TensorInfo(n, (64, 64), 0) for n in names}
    for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        tensors[f"blk.0.{n}.weight"] = TensorInfo(f"blk.0.{n}.weight", (64, 128, 8), 12)
    return GGUFHeader(meta, tensors)


@pytest.mark.pure
def test_header_accepts_llama_experts_and_names_what_it_cannot_build():
    assert unsupported_reasons(_header()) == []  # no dense ffn_gate/up/down needed: the router and experts instead
    assert unsupported_reasons(_header("qwen2")) == [
        "mixture-of-experts layers of 'qwen2' are not supported (supported: llama, qwen3moe, gpt-oss)"]
    assert unsupported_reasons(_header(extra_meta={"llama.expert_used_count": 9})) == [
        "llama.expert_used_count 9 is not between 1 and expert_count 8"]
    assert unsupported_reasons(_header(extra_meta={"llama.expert_gating_func": 2})) == [
        "expert gating function 2 is not supported (softmax only)"]
    assert unsupported_reasons(_header(extra_tensors=("blk.0.ffn_up_shexp.weight",))) == [
        "shared experts or expert selection biases (ffn_up_shexp) are not supported"]
    missing = _header()
    del missing.tensors["blk.0.ffn_down_exps.weight"]
    assert unsupported_reasons(missing) == ["missing tensor blk.0.ffn_down_exps.weight"]


# -- the routing, against llama.cpp's formula -------------------------------------------------
def _moe_session(cfg: ModelConfig, router: np.ndarray, experts: list[dict]) -> ort.InferenceSession:
    g = _Graph("l1.")
    width = cfg.expert_intermediate_size
    y = moe_ffn(g, cfg, "x", {"router": router, "experts": experts},
                lambda rows, ew, base: _ffn(g, cfg, rows, ew["gate_up"], ew["ffn_down"], width, base, rank=2), None)
    g.op("Identity", [y], out=["y"])
    model = g.model([helper.make_tensor_value_info("x", FLOAT, ["batch", "seq", cfg.hidden_size])],
                    [helper.make_tensor_value_info("y", FLOAT, ["batch", "seq", cfg.hidden_size])], "moe")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _reference(x: np.ndarray, router, experts, k: int, norm: bool, scale: float) -> np.ndarray:
    """llama.cpp's build_moe_ffn (softmax gating, SiLU) in float64 numpy, row by row."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        logits = router.astype(np.float64) @ row
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[:k]
        w = probs[top]
        if norm:
            w = w / max(w.sum(), 6.103515625e-5)
        if scale not in (0.0, 1.0):
            w = w * scale
        for e, we in zip(top, w):
            gu = experts[e]["gate_up"].astype(np.float64) @ row
            gate, up = np.split(gu, 2)
            out[r] += we * (experts[e]["ffn_down"].astype(np.float64) @ (gate / (1 + np.exp(-gate)) * up))
    return out.reshape(x.shape)


def _tiny(E: int, k: int, norm: bool = True, scale: float = 0.0) -> ModelConfig:
    return ModelConfig(architecture="llama", name="moe", n_layers=1, hidden_size=32, intermediate_size=48, n_heads=2, n_kv_heads=2,
                       head_dim=16, vocab_size=10, context_length=64, rope_theta=1e4, rms_eps=1e-6, tie_embeddings=True,
                       rope_interleaved=True, n_experts=E, n_experts_used=k, expert_intermediate_size=24,
                       expert_weights_norm=norm, expert_weights_scale=scale)


@pytest.mark.pure
@pytest.mark.parametrize("E,k,norm,scale", [(4, 2, True, 0.0), (8, 3, False, 2.5), (6, 1, True, 0.0)])
def test_moe_block_equals_llama_cpp_formula_and_is_batch_invariant(E, k, norm, scale):
    cfg = _tiny(E, k, norm, scale)
    rng = np.random.default_rng(E * 10 + k)
    H, N = cfg.hidden_size, cfg.expert_intermediate_size
    router = rng.standard_normal((E, H)).astype(np.float32)
    experts = [{"gate_up": (rng.standard_normal((2 * N, H)) / np.sqrt(H)).astype(np.float32),
                "ffn_down": (rng.standard_normal((H, N)) / np.sqrt(N)).astype(np.float32)} for _ in range(E)]
    session = _moe_session(cfg, router, experts)
    x = rng.standard_normal((2, 9, H)).astype(np.float32)
    y = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(y, _reference(x, router, experts, k, norm, scale), rtol=1e-4, atol=1e-5)
    chosen = {int(e) for row in x.reshape(-1, H) for e in np.argsort(-(router @ row))[:k]}
    assert len(chosen) == E  # the rows spread over every expert: the grouping is exercised
    for b in range(2):  # a row alone, or a sequence alone, gives the bits it gets in the batch
        assert np.array_equal(session.run(None, {"x": x[b : b + 1]})[0], y[b : b + 1])
        assert np.array_equal(session.run(None, {"x": x[b : b + 1, 3:4]})[0], y[b : b + 1, 3:4])


# -- the bundled model, upcycled ----------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """Two upcycled SmolLM2 files: a random router (``random``) and one whose rows come in equal
    pairs (``tied``: each weight exactly 1/2, so each layer is the dense one to the bit)."""
    root = tmp_path_factory.mktemp("moe")
    return {"random": upcycle(bundled_gguf(), root / "smollm2-moe-random.gguf", seed=1),
            "tied": upcycle(bundled_gguf(), root / "smollm2-moe.gguf", seed=2, tied=True)}


@pytest.fixture(scope="module")
def moe_pkg(home, moe_files):
    pkg = resolve(str(moe_files["tied"]), "native", home)
    prepare_local_form(pkg)
    return pkg


def _tokens(pkg, prompt: str, precision: str, cuts=(), max_tokens: int = 32, eos_ids=()) -> list[int]:
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": prompt}]))
    return generate(pkg.pipeline(list(cuts), precision=precision), ids, GenerationParams(max_tokens=max_tokens), tok.decode, eos_ids).tokens


def test_upcycled_package_holds_experts_and_greedy_equals_dense(native_pkg, moe_pkg):
    cfg = moe_pkg.manifest.config
    assert (cfg["n_experts"], cfg["n_experts_used"]) == (4, 2)
    for precision in moe_pkg.manifest.units[1].variants:  # memory: every expert (the copies share a blob, each is loaded)
        moe, dense = moe_pkg.manifest.units[1], native_pkg.manifest.units[1]
        assert (moe.experts, moe.experts_used) == (4, 2)
        one = moe.variants[precision].expert_bytes
        router = 4 * cfg["hidden_size"] * 4  # float32 [E, H]
        assert one > 0 and moe.variants[precision].weight_bytes == dense.variants[precision].weight_bytes + 3 * one + router
    here = local_form(moe_pkg)  # the kernel library's form where it loads; and MatMulNBits ("native")
    for precision, prompt, cuts in ((here, PROMPTS[0], ()), (here, PROMPTS[1], (4, 13, 27)), ("native", PROMPTS[0], (9,))):
        assert _tokens(moe_pkg, prompt, precision, cuts) == _tokens(native_pkg, prompt, precision), (precision, prompt, cuts)


def test_random_router_layers_equal_dense_layers(home, native_pkg, moe_files):
    """Under a random router (no ties) each MoE layer is its dense layer up to float rounding
    (sum of two weights = 1), on the real hidden states of a prompt."""
    pkg = resolve(str(moe_files["random"]), "native", home)
    precision = "native"
    tok = native_pkg.tokenizer
    h = native_pkg.runner(0, 1, precision).run("s", np.array([tok.encode(tok.format_chat([{"role": "user", "content": PROMPTS[0]}]))]))
    for unit in range(1, 7):
        dense, moe = native_pkg.runner(unit, unit + 1, precision).run("s", h), pkg.runner(unit, unit + 1, precision).run("s", h)
        scale = np.abs(dense).max(axis=-1, keepdims=True)
        assert np.abs(moe - dense).max(axis=-1, keepdims=True).max() / scale.min() < 1e-5, unit
        h = dense


@pytest.mark.slow  # ~25 s of worker processes; the single-process and cut tests above run by default
def test_three_workers_with_cuts_inside_the_experts_equal_dense(home, native_pkg, moe_pkg):
    from harness import Server

    with Server(home, workers=3, args=("--placement", "memory", "--model", moe_pkg.root.name)) as server:
        stages = server.status()["plan"]["stages"]
        assert len(stages) == 3 and all(1 < s["start"] < 31 for s in stages[1:])  # both cuts between MoE layers
        for prompt in PROMPTS:
            r = server.client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 32, "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            eos = native_pkg.manifest.eos_ids
            expected = [t for t in _tokens(native_pkg, prompt, local_form(native_pkg), eos_ids=eos) if t not in eos]
            assert r.json()["choices"][0]["token_ids"] == expected, prompt


# -- Qwen2.5-Coder-0.5B, upcycled as llama ------------------------------------------------------
@pytest.mark.pure
def test_neox_rows_permuted_rotate_as_adjacent_pairs():
    """``llama`` rotates adjacent pairs, ``qwen2`` the halves of each head: the permuted q/k rows
    rotated in pairs are the rows as stored rotated in halves, permuted, to the bit; per head
    ``q . k`` is unchanged but for summation order; raw blocks permute as whole rows."""
    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(3)
    heads, D, S = 3, 8, 5
    half = D // 2
    angles = np.arange(S)[:, None, None] * (10000.0 ** (-np.arange(half) * 2 / D))[None, None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def neox(t):  # [S, heads, D]
        a, b = t[..., :half], t[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def pairs(t):
        a, b = t[..., 0::2], t[..., 1::2]
        return np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(t.shape)

    permute = lambda rows: neox_to_interleaved(rows.T, heads).T  # noqa: E731 - on the last axis of [S, heads * D]
    q, k = (rng.standard_normal((S, heads * D)).astype(np.float32) for _ in range(2))
    rotated = neox(q.reshape(S, heads, D)).reshape(S, -1)
    assert np.array_equal(pairs(permute(q).reshape(S, heads, D)).reshape(S, -1), permute(rotated))
    assert not np.array_equal(pairs(q.reshape(S, heads, D)), neox(q.reshape(S, heads, D)))  # the layouts do differ
    dots = lambda a, b: np.einsum("shd,thd->hst", a.reshape(S, heads, D), b.reshape(S, heads, D))  # noqa: E731
    np.testing.assert_allclose(dots(pairs(permute(q).reshape(S, heads, D)), pairs(permute(k).reshape(S, heads, D))),
                               dots(rotated, neox(k.reshape(S, heads, D))), rtol=1e-5, atol=1e-5)
    w = rng.standard_normal((heads * D, 64)).astype(np.float32)
    blocks = quantize(w, gguf.GGMLQuantizationType.Q8_0)  # [rows, bytes]
    assert np.array_equal(dequantize(neox_to_interleaved(blocks, heads), gguf.GGMLQuantizationType.Q8_0),
                          neox_to_interleaved(dequantize(blocks, gguf.GGMLQuantizationType.Q8_0), heads))


def test_tiny_qwen2_upcycled_as_llama_is_the_qwen2_model(tmp_path):
    """A random ``qwen2`` file (q/k/v biases, tied head, test_families' writer) rewritten as
    ``llama``, with and without experts: in float every layer is the qwen2 layer up to summation
    order, so the greedy tokens are the qwen2 file's, in one stage and in two."""
    from test_families import PROMPT, write_tiny_gguf

    from edgepipe.model.importer import import_model
    from edgepipe.model.package import Package

    source = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2")
    files = {"dense": source, "as-llama": as_llama(source, tmp_path / "tiny-as-llama.gguf"),
             "tied": upcycle(source, tmp_path / "tiny-moe-tied.gguf", seed=2, tied=True),
             "random": upcycle(source, tmp_path / "tiny-moe-random.gguf", seed=1)}
    pkgs = {name: Package(import_model(path, tmp_path / "models", "fp32", max_context=256, measure_cost=False))
            for name, path in files.items()}
    assert [pkgs[n].manifest.config["architecture"] for n in files] == ["qwen2", "llama", "llama", "llama"]
    assert pkgs["random"].manifest.config["n_experts"] == 4 and pkgs["random"].manifest.config["attention_bias"]
    ids = pkgs["dense"].tokenizer.encode(PROMPT)
    h = pkgs["dense"].runner(0, 1, "fp32").run("s", np.array([ids]))
    for unit in range(1, len(pkgs["dense"].manifest.units) - 1):
        dense = pkgs["dense"].runner(unit, unit + 1, "fp32").run("s", h)
        for name in ("as-llama", "tied", "random"):
            np.testing.assert_allclose(pkgs[name].runner(unit, unit + 1, "fp32").run("s", h), dense, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name}, layer unit {unit}")
        h = dense

    def tokens(pkg, cuts):
        return generate(pkg.pipeline(cuts), ids, GenerationParams(max_tokens=24), pkg.tokenizer.decode, eos_ids=()).tokens

    expected = tokens(pkgs["dense"], [])
    assert len(set(expected)) > 3  # a text, not one token repeated
    for name in ("as-llama", "tied", "random"):
        for cuts in ([], [2]):
            assert tokens(pkgs[name], cuts) == expected, (name, cuts)


@pytest.fixture(scope="module")
def qwen_moe(home, tmp_path_factory):
    """Qwen2.5-Coder-0.5B (``qwen2``) and, written as ``llama``: the dense rewrite (``as-llama``),
    upcycled with a random router (``random``) and with rows in equal pairs (``tied``); each
    imported in the form this machine runs (the kernel library's where it loads)."""
    from edgepipe.model.store import missing_reference, reference_gguf
    from edgepipe.native import FALLBACK_FORM, KERNEL_FORM, gguf_kernel_library

    if missing := missing_reference("qwen05"):
        pytest.fail(missing)
    root, source = tmp_path_factory.mktemp("qwen-moe"), reference_gguf("qwen05")
    form = KERNEL_FORM if gguf_kernel_library() is not None else FALLBACK_FORM
    files = {"dense": source, "as-llama": as_llama(source, root / "qwen05-as-llama.gguf"),
             "tied": upcycle(source, root / "qwen05-moe-tied.gguf", seed=2, tied=True),
             "random": upcycle(source, root / "qwen05-moe-random.gguf", seed=1)}
    return form, {name: resolve(str(path), form, home) for name, path in files.items()}


@pytest.mark.slow  # four imports of a 0.5B (two of 1.1 GB) and 32-token runs: minutes
def test_qwen05_upcycled_as_llama_gives_the_dense_text(qwen_moe):
    form, pkgs = qwen_moe
    cfg = pkgs["random"].manifest.config
    assert (cfg["architecture"], cfg["n_experts"], cfg["n_experts_used"], cfg["rope_interleaved"]) == ("llama", 4, 2, True)
    same = lambda c: {k: v for k, v in c.items() if k not in ("architecture", "rope_interleaved") and "expert" not in k}  # noqa: E731
    assert same(cfg) == same(pkgs["dense"].manifest.config) and cfg["attention_bias"]  # rope base, RMS epsilon, heads, biases, ...
    # the rewrite: each layer the qwen2 one, the positions that rotate nothing (0) to the bit, the others up to rounding
    tok = pkgs["dense"].tokenizer
    ids = np.array([tok.encode(tok.format_chat([{"role": "user", "content": PROMPTS[1]}]))])
    h = pkgs["dense"].runner(0, 1, form).run("s", ids)
    for unit in (1, 2, 12, 24):
        dense, rewritten, tied = (pkgs[n].runner(unit, unit + 1, form).run("s", h) for n in ("dense", "as-llama", "tied"))
        assert np.array_equal(rewritten[:, 0], dense[:, 0]) and np.array_equal(tied, rewritten), unit  # tied: 1/2 + 1/2
        rel = np.abs(rewritten - dense).max(-1) / np.abs(dense - h).max(-1)
        assert np.median(rel) < 1e-4 and rel.max() < 2e-2, (unit, float(np.median(rel)), float(rel.max()))
        h = dense
    # greedy text: the tied file is the rewrite token for token, cut anywhere; both routers give the dense text
    for prompt in PROMPTS:
        rewritten = _tokens(pkgs["as-llama"], prompt, form)
        assert _tokens(pkgs["tied"], prompt, form, cuts=(7, 19)) == rewritten, prompt
    # (the cat poem parts from the qwen2 text at token 15, a near tie the rewrite without experts tips too:
    # attention's summation order through int8 activation quantisation, benchmarks/results/moe_upcycled-qwen05.md)
    for prompt in (PROMPTS[0], "What is the tallest mountain on Earth?"):
        dense = _tokens(pkgs["dense"], prompt, form)
        assert _tokens(pkgs["random"], prompt, form) == dense == _tokens(pkgs["tied"], prompt, form), prompt


# -- the kernel library's grouped product ------------------------------------------------------
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "MXFP4"])
def test_kernel_moe_matmul_is_each_rows_expert_product_in_any_batch(kind):
    """``GgufMoEMatMul`` gives each (row, slot) exactly ``GgufMatMul`` of that row with its expert's
    blocks, whichever other rows chose the expert, and each row's bits alone as in the batch."""
    from onnx import TensorProto

    from edgepipe.native import DOMAIN, GGML_TYPE_IDS, MATMUL_OP, MOE_OP, gguf_kernel_library, native_library
    from test_gguf_kernel import random_blocks

    library = gguf_kernel_library()
    assert library is not None, native_library().reason
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    rng = np.random.default_rng(7)
    E, N, K, R, k = 6, 40, 256, 30, 2  # ~10 rows an expert: groups of more than one tile of rows
    raw = random_blocks(kind, E * N, K, rng).reshape(E, N, -1)
    x = rng.standard_normal((R, K)).astype(np.float32)
    chosen = np.stack([rng.choice(E, k, replace=False) for _ in range(R)]).astype(np.int64)

    def session(op, inputs, outputs):
        graph = helper.make_graph([helper.make_node(op, [i.name for i in inputs], [o.name for o in outputs], domain=DOMAIN,
                                                    qtype=GGML_TYPE_IDS[kind])], "g", inputs, outputs)
        model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    t = helper.make_tensor_value_info
    moe = session(MOE_OP, [t("x", FLOAT, None), t("chosen", TensorProto.INT64, None), t("w", TensorProto.UINT8, None)], [t("y", FLOAT, None)])
    dense = session(MATMUL_OP, [t("x", FLOAT, None), t("w", TensorProto.UINT8, None)], [t("y", FLOAT, None)])
    y = moe.run(None, {"x": x, "chosen": chosen, "w": raw})[0]
    assert y.shape == (R, k, N)
    for r in range(R):
        for j in range(k):
            assert np.array_equal(y[r, j], dense.run(None, {"x": x[r : r + 1], "w": raw[chosen[r, j]]})[0][0]), (r, j)
        assert np.array_equal(moe.run(None, {"x": x[r : r + 1], "chosen": chosen[r : r + 1], "w": raw})[0], y[r : r + 1])
    per_slot = np.repeat(x[:, None, :], k, axis=1)  # [R, k, K]: one input per slot, as the down projection takes
    assert np.array_equal(moe.run(None, {"x": per_slot, "chosen": chosen, "w": raw})[0], y)


def test_kernel_products_on_huge_pages_keep_their_weights_and_results(monkeypatch):
    """The kernels move a constant weight's 2 MiB-aligned interior onto huge pages at session
    creation (the copy replaces the old pages at the same addresses): the results equal the same
    products with the weights fed as an input, and with the move turned off."""
    from onnx import TensorProto, numpy_helper

    from edgepipe.native import DOMAIN, GGML_TYPE_IDS, MATMUL_OP, MOE_OP, gguf_kernel_library, native_library
    from test_gguf_kernel import random_blocks

    library = gguf_kernel_library()
    assert library is not None, native_library().reason
    rng = np.random.default_rng(3)
    E, N, K, R, k = 8, 1024, 2048, 3, 2  # 8 x 1.1 MB of Q4_K blocks: several 2 MiB pages inside
    raw = random_blocks("Q4_K", E * N, K, rng).reshape(E, N, -1)
    x = rng.standard_normal((R, K)).astype(np.float32)
    chosen = np.array([[0, 5], [7, 2], [5, 3]], np.int64)
    t = helper.make_tensor_value_info

    def session(op, inputs, constant):
        names = [i.name for i in inputs] + ["w"]
        graph = helper.make_graph([helper.make_node(op, names, ["y"], domain=DOMAIN, qtype=GGML_TYPE_IDS["Q4_K"])], "g",
                                  inputs + ([] if constant else [t("w", TensorProto.UINT8, None)]), [t("y", FLOAT, None)],
                                  initializer=[numpy_helper.from_array(constant_w, "w")] if constant else [])
        model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    for op, inputs, feeds, constant_w in (
        (MOE_OP, [t("x", FLOAT, None), t("chosen", TensorProto.INT64, None)], {"x": x, "chosen": chosen}, raw),
        (MATMUL_OP, [t("x", FLOAT, None)], {"x": x}, raw.reshape(E * N, -1)),
    ):
        fed = session(op, inputs, constant=False).run(None, {**feeds, "w": constant_w})[0]
        moved = session(op, inputs, constant=True).run(None, feeds)[0]
        monkeypatch.setenv("EDGEPIPE_GGUF_HUGE_PAGES", "0")
        kept = session(op, inputs, constant=True).run(None, feeds)[0]
        monkeypatch.delenv("EDGEPIPE_GGUF_HUGE_PAGES")
        assert np.array_equal(moved, fed) and np.array_equal(kept, fed), op
        assert np.abs(fed).max() > 0, op


# -- the browser's runtime ----------------------------------------------------------------------
_ORT_WEB = """
import { createRequire } from "module";
import fs from "fs";
const require = createRequire(import.meta.url);
const [vendor, dir] = process.argv.slice(2);
const ort = require(vendor + "/ort.webgpu.min.js");
ort.env.wasm.numThreads = 1;
ort.env.wasm.wasmPaths = vendor + "/";
const floats = (name) => { const b = fs.readFileSync(dir + "/" + name); return new Float32Array(b.buffer, b.byteOffset, b.length / 4); };
const session = await ort.InferenceSession.create(fs.readFileSync(dir + "/moe.onnx"), { executionProviders: ["wasm"] });
const out = await session.run({ x: new ort.Tensor("float32", floats("x.bin"), [1, 5, 32]) });
fs.writeFileSync(dir + "/y.bin", Buffer.from(out.y.data.buffer));
console.log("written");  // then the caller ends the process: the runtime's threads keep it from exiting
"""


def test_moe_block_runs_in_onnxruntime_web(tmp_path):
    """The browser worker's runtime (the vendored onnxruntime-web, on WebAssembly, under Node) runs
    the plain-ops MoE block (NonZero, GatherND, ScatterND add) of the fp32 form a tab is sent."""
    import shutil

    node = shutil.which("node")
    assert node is not None, "node is missing (apt-get install nodejs)"
    cfg = _tiny(4, 2)
    rng = np.random.default_rng(1)
    H, N, E = cfg.hidden_size, cfg.expert_intermediate_size, 4
    router = rng.standard_normal((E, H)).astype(np.float32)
    experts = [{"gate_up": (rng.standard_normal((2 * N, H)) / 6).astype(np.float32),
                "ffn_down": (rng.standard_normal((H, N)) / 5).astype(np.float32)} for _ in range(E)]
    g = _Graph("l1.")
    y = moe_ffn(g, cfg, "x", {"router": router, "experts": experts},
                lambda rows, ew, base: _ffn(g, cfg, rows, ew["gate_up"], ew["ffn_down"], N, base, rank=2), None)
    g.op("Identity", [y], out=["y"])
    model = g.model([helper.make_tensor_value_info("x", FLOAT, ["batch", "seq", H])], [helper.make_tensor_value_info("y", FLOAT, None)], "moe")
    (tmp_path / "moe.onnx").write_bytes(model.SerializeToString())
    x = rng.standard_normal((1, 5, H)).astype(np.float32)
    x.tofile(tmp_path / "x.bin")
    from browser import run_under_ort_web

    run_under_ort_web(node, _ORT_WEB, tmp_path, "graph")
    got = np.fromfile(tmp_path / "y.bin", np.float32).reshape(x.shape)
    np.testing.assert_allclose(got, _reference(x, router, experts, 2, True, 0.0), rtol=1e-4, atol=1e-5)


def test_a_verify_pass_on_moe_stages_equals_its_decode_steps(moe_pkg):
    """Speculative decoding's verify form on MoE stages (cut inside the experts): 8 drafted tokens
    verified in one pass give each position's decode-step token and logprobs, bit for bit."""
    from test_speculative_exact import _prompt, _run

    pipe = moe_pkg.pipeline([7, 20], verify_form=True, threads=1, precision=local_form(moe_pkg))
    prompt = _prompt(moe_pkg)
    tokens, entries = _run(pipe, "ref", prompt)
    for _ in range(9):
        t, e = _run(pipe, "ref", tokens[-1:])
        tokens, entries = tokens + t, entries + e
    pipe.drop("ref")
    assert _run(pipe, "v", prompt)[0] == tokens[:1]
    verified, verified_entries = _run(pipe, "v", tokens[:9], verify=True)
    assert verified == tokens[1:10] and verified_entries == entries[1:10]
