"""MoE GGUF files for tests and benchmarks: a dense model "upcycled" into a mixture of identical experts.

Each layer's FFN (gate, up, down, its blocks as stored) is copied into ``experts`` experts,
stacked as llama.cpp stores them (3-D ``ffn_{gate,up,down}_exps``), under a random float32
router. With the selected weights renormalised (llama.cpp's ``norm_w`` for these families),
every layer computes ``sum_i w_i * ffn(x)`` with ``sum_i w_i = 1``: the dense layer up to float
rounding, so the dense model's greedy text is the reference, with no MoE download.

``tied``: the router's rows come in groups of ``used`` equal rows (a random row per group), so
each row picks one whole group (which group varies from row to row) and each weight is exactly
``1 / used``; with ``used = 2``, ``y / 2 + y / 2 == y`` in float: the MoE layer equals the dense
layer to the bit wherever its products give a row the same bits in any batch.

A ``qwen2`` source (Qwen2.5) is written as llama.cpp's ``llama`` with experts (Mixtral's layer),
since llama.cpp's ``qwen2`` has no MoE form and its ``qwen2moe`` adds a sigmoid-gated shared
expert and leaves the routed weights unnormalised (no exact construction). ``llama`` reads the
same hyper-parameters (the ``qwen2.*`` keys renamed ``llama.*``: rope base, RMS epsilon, heads),
loads Qwen2's optional q/k/v biases and its untied head; what differs is RoPE: ``llama`` rotates
adjacent pairs, ``qwen2`` the two halves of each head (NEOX), so the q and k rows (weights as
stored and biases) are permuted as llama.cpp's converter permutes a Llama checkpoint's
(``neox_to_interleaved``). The rotation is then the same; only the order in which attention sums
``q . k`` over a head changes: rounding, which the int8 quantisation of activations (the kernel
library's and MatMulNBits') now and then turns into one quantisation step of an element (on
Qwen2.5-Coder-0.5B a layer's rows differ by a median 1e-6 of the layer's output, the worst by
0.4%; position 0, which rotates nothing, to the bit). ``as_llama`` writes that rewrite without
experts: the reference the ``tied`` file equals to the bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_DENSE = ("ffn_gate", "ffn_up", "ffn_down")
# Families written as ``llama`` (see the module's docstring), by the metadata key of their q and k heads.
_AS_LLAMA = {"qwen2": {"attn_q": "attention.head_count", "attn_k": "attention.head_count_kv"}}


def neox_to_interleaved(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection's rows ``[heads * D, ...]`` (a weight's rows as stored, blocks and all,
    or a bias) reordered so that rotating adjacent pairs ``(2j, 2j + 1)`` rotates what rotating
    ``(j, j + D / 2)`` did: llama.cpp's ``convert_hf_to_gguf.py`` ``LlamaModel.permute``."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def upcycle(source: Path, target: Path, experts: int = 4, used: int = 2, seed: int = 0, tied: bool = False) -> Path:
    """Write ``target``: ``source`` (a dense ``llama`` or ``qwen2`` GGUF) with every FFN turned
    into ``experts`` copies, ``used`` of them routed per row, under a seeded random router; a
    ``qwen2`` file becomes a ``llama`` one."""
    return _rewrite(source, target, (experts, used, seed, tied))


def as_llama(source: Path, target: Path) -> Path:
    """Write ``target``: the dense ``qwen2`` ``source`` as a dense ``llama`` file (the rewrite
    ``upcycle`` makes, without experts): the model whose layers the upcycled file's ``tied``
    layers equal to the bit, its q . k summed in the same order."""
    return _rewrite(source, target, None)


def _rewrite(source: Path, target: Path, moe: tuple[int, int, int, bool] | None) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(source))
    source_arch = str(reader.fields["general.architecture"].contents())
    if source_arch != "llama" and source_arch not in _AS_LLAMA:
        raise ValueError(f"{source}: architecture {source_arch!r} cannot be upcycled (llama, {', '.join(_AS_LLAMA)})")
    arch = "llama"
    heads = {kind: int(reader.fields[f"{source_arch}.{key}"].contents()) for kind, key in _AS_LLAMA.get(source_arch, {}).items()}
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name.startswith(source_arch + "."):
            name = arch + name[len(source_arch):]
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    if moe is not None:
        experts, used, seed, tied = moe
        writer.add_uint32(f"{arch}.expert_count", experts)
        writer.add_uint32(f"{arch}.expert_used_count", used)
        rng = np.random.default_rng(seed)
        hidden = int(reader.fields[f"{source_arch}.embedding_length"].contents())
    for t in reader.tensors:
        parts = t.name.split(".")
        if moe is not None and len(parts) == 4 and parts[2] in _DENSE:
            layer = parts[1]
            stacked = np.ascontiguousarray(np.broadcast_to(t.data, (experts, *t.data.shape)))
            writer.add_tensor(f"blk.{layer}.{parts[2]}_exps.weight", stacked, raw_shape=stacked.shape, raw_dtype=t.tensor_type)
            if parts[2] == "ffn_gate":
                router = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1
                if tied:
                    router = np.repeat(router[::used], used, axis=0)[:experts]
                writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
            continue
        data = np.asarray(t.data)
        if len(parts) == 4 and parts[2] in heads:
            data = neox_to_interleaved(data, heads[parts[2]])
        writer.add_tensor(t.name, data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)  # bytes per row for blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def main() -> None:
    """``python -m edgepipe.bench.moe_files SOURCE TARGET [--experts 4 --used 2 --seed 1 --tied]``:
    write an upcycled file (for ``benchmarks/serve.py --model TARGET``, llama.cpp, ...)."""
    import argparse

    ap = argparse.ArgumentParser(description="write a dense llama/qwen2 GGUF upcycled into identical experts under a random router")
    ap.add_argument("source", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--used", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tied", action="store_true", help="router rows in groups of --used equal rows (each layer the dense one to the bit)")
    args = ap.parse_args()
    print(upcycle(args.source, args.target, args.experts, args.used, args.seed, args.tied))


# Qwen3-30B-A3B's per-layer shapes (128 experts, top 8, head_dim 128, 8 query heads per kv head),
# hidden and expert widths scaled down for test speed.
QWEN3MOE_SHAPES = dict(hidden=512, heads=8, kv_heads=1, head_dim=128, experts=128, used=8, expert_ffn=96, layers=2)


def synthetic_qwen3moe(target: Path, tokenizer_source: Path, seed: int = 0, expert_type: str = "Q8_0", **shapes) -> tuple[Path, dict]:
    """A ``qwen3moe`` GGUF of random weights (Q8_0 linears, experts of ``expert_type`` (a GGUF type
    gguf-py quantizes: Q8_0, MXFP4 as gpt-oss stores them, ...), F32 norms and router) with the
    tokenizer of ``tokenizer_source``; returns the file and its float weights (dequantized, numpy
    order) for ``qwen3moe_reference``."""
    import gguf
    from gguf.quants import dequantize, quantize

    s = {**QWEN3MOE_SHAPES, **shapes}
    H, nh, nkv, D, E, k, F, L = (s[n] for n in ("hidden", "heads", "kv_heads", "head_dim", "experts", "used", "expert_ffn", "layers"))
    reader = gguf.GGUFReader(str(tokenizer_source))
    writer = gguf.GGUFWriter(str(target), "qwen3moe")
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    a = "qwen3moe"
    for key, value in (("block_count", L), ("context_length", 4096), ("embedding_length", H), ("feed_forward_length", 4 * F),
                       ("expert_feed_forward_length", F), ("expert_count", E), ("expert_used_count", k), ("attention.head_count", nh),
                       ("attention.head_count_kv", nkv), ("attention.key_length", D), ("attention.value_length", D)):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}

    def q8(name: str, shape: tuple[int, ...], scale: float, kind: str = "Q8_0") -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        data = quantize((rng.standard_normal(shape) * scale).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        weights[name] = dequantize(data, qtype).reshape(shape)

    def f32(name: str, value: np.ndarray) -> None:
        writer.add_tensor(name, value.astype(np.float32))
        weights[name] = value.astype(np.float32)

    q8("token_embd.weight", (vocab, H), 1.0)
    f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(H))
    for i in range(L):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(H))
        q8(p + "attn_q.weight", (nh * D, H), H ** -0.5)
        q8(p + "attn_k.weight", (nkv * D, H), H ** -0.5)
        q8(p + "attn_v.weight", (nkv * D, H), H ** -0.5)
        q8(p + "attn_output.weight", (H, nh * D), (nh * D) ** -0.5)
        f32(p + "attn_q_norm.weight", 1 + 0.1 * rng.standard_normal(D))
        f32(p + "attn_k_norm.weight", 1 + 0.1 * rng.standard_normal(D))
        f32(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(H))
        f32(p + "ffn_gate_inp.weight", rng.standard_normal((E, H)) * H ** -0.5 * 3)
        q8(p + "ffn_gate_exps.weight", (E, F, H), H ** -0.5, expert_type)
        q8(p + "ffn_up_exps.weight", (E, F, H), H ** -0.5, expert_type)
        q8(p + "ffn_down_exps.weight", (E, H, F), F ** -0.5, expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target, {"shapes": s, **weights}


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def qwen3moe_reference(weights: dict, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's qwen3moe graph in float64 numpy (``llm_build_qwen3moe`` + ``build_moe_ffn``):
    ``(hidden after the last layer [S, H], logits [S, V])`` for one sequence."""
    s = weights["shapes"]
    nh, nkv, D, k = s["heads"], s["kv_heads"], s["head_dim"], s["used"]
    w = {n: v.astype(np.float64) for n, v in weights.items() if n != "shapes"}
    x = w["token_embd.weight"][ids]
    S = len(ids)
    half = D // 2
    freqs = 1_000_000.0 ** (-np.arange(half) * 2 / D)
    angles = np.arange(S)[:, None] * freqs[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rope(t):  # NEOX: rotate the two halves of each head
        a, b = t[..., :half], t[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    for i in range(s["layers"]):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"])
        q = rope(_rms((h @ w[p + "attn_q.weight"].T).reshape(S, nh, D), w[p + "attn_q_norm.weight"]))
        kk = rope(_rms((h @ w[p + "attn_k.weight"].T).reshape(S, nkv, D), w[p + "attn_k_norm.weight"]))
        v = (h @ w[p + "attn_v.weight"].T).reshape(S, nkv, D)
        kk, v = np.repeat(kk, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(D) + np.triu(np.full((S, S), -np.inf), 1)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", att, v).reshape(S, nh * D) @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"])
        logits = h @ w[p + "ffn_gate_inp.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for r in range(S):
            top = np.argsort(-probs[r], kind="stable")[:k]
            weight = probs[r, top] / max(probs[r, top].sum(), 6.103515625e-5)
            for e, we in zip(top, weight):
                gate, up = w[p + "ffn_gate_exps.weight"][e] @ h[r], w[p + "ffn_up_exps.weight"][e] @ h[r]
                out[r] += we * (w[p + "ffn_down_exps.weight"][e] @ (gate / (1 + np.exp(-gate)) * up))
        x = x + out
    return x, _rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


# gpt-oss-20b's per-layer shapes (llama.cpp's LLM_ARCH_OPENAI_MOE): hidden 2880, 64 query heads and 8
# kv heads of 64, 32 experts of width 2880, top 4, a 128-token window on every other layer, YaRN
# (factor 32 over 4096 positions, base 150000). Tests shrink the widths; the layer count is the file's.
GPT_OSS_SHAPES = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4, expert_ffn=2880, layers=2,
                      window=128, context=131072, yarn_factor=32.0, yarn_original=4096, rope_base=150000.0)
_E2M1_RMS = float(np.sqrt(np.mean(np.array([0, 0.25, 1, 2.25, 4, 9, 16, 36]))))  # of a random MXFP4 value, scale 1


def _random_mxfp4(rng, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Raw MXFP4 blocks ``[..., K / 32 * 17]`` of random values whose RMS is about ``scale``: each
    block's E8M0 exponent near ``log2(scale / rms(e2m1))`` (+-1), its 32 nibbles uniform."""
    *lead, k = shape
    nb = k // 32
    e = 127 + int(round(np.log2(scale / _E2M1_RMS))) + rng.integers(-1, 2, (*lead, nb, 1))  # value = 2^(e - 127) * e2m1
    qs = rng.integers(0, 256, (*lead, nb, 16), dtype=np.uint8)
    return np.concatenate([e.astype(np.uint8), qs], axis=-1).reshape(*lead, nb * 17)


def synthetic_gpt_oss(target: Path, tokenizer_source: Path, seed: int = 0, reference: bool = False, router: float = 3.0,
                      ffn: float = 1.0, head: float = 0.0, expert_type: str = "MXFP4", **shapes) -> tuple[Path, dict]:
    """A ``gpt-oss`` GGUF of random weights with the tokenizer (and chat template) of
    ``tokenizer_source``: experts MXFP4 (GGML type 39), attention and head Q8_0, norms, biases,
    sinks and router F32, the metadata keys convert_hf_to_gguf.py's GptOssModel writes. With
    ``reference``, also every weight as float (numpy order) for ``gpt_oss_reference``.

    ``head`` > 0 makes the logits peaked: the head's rows are ``head`` times a fixed permutation of
    the embedding's rows plus unit noise, so each position's residual stream (its token's embedding
    plus what the layers add) leads one logit by a margin the layers move but rounding does not."""
    import gguf
    from gguf.quants import dequantize, quantize

    s = {**GPT_OSS_SHAPES, **shapes}
    H, nh, nkv, D, E, k, F, L = (s[n] for n in ("hidden", "heads", "kv_heads", "head_dim", "experts", "used", "expert_ffn", "layers"))
    reader = gguf.GGUFReader(str(tokenizer_source))
    a = "gpt-oss"
    writer = gguf.GGUFWriter(str(target), a)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    for key, value in (("block_count", L), ("context_length", s["context"]), ("embedding_length", H), ("feed_forward_length", F),
                       ("expert_feed_forward_length", F), ("expert_count", E), ("expert_used_count", k), ("attention.head_count", nh),
                       ("attention.head_count_kv", nkv), ("attention.key_length", D), ("attention.value_length", D),
                       ("attention.sliding_window", s["window"]), ("rope.scaling.original_context_length", s["yarn_original"])):
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", s["rope_base"])
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string(f"{a}.rope.scaling.type", "yarn")
    writer.add_float32(f"{a}.rope.scaling.factor", s["yarn_factor"])
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    Q8, MX = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4

    def q8(name: str, shape: tuple[int, ...], scale: float, values: np.ndarray | None = None) -> None:
        data = quantize((rng.standard_normal(shape) * scale if values is None else values).astype(np.float32), Q8)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=Q8)
        if reference:
            weights[name] = dequantize(data, Q8).reshape(shape)

    def mxfp4(name: str, shape: tuple[int, ...], scale: float) -> None:  # (expert_type="Q8_0": the kernel library's 3-D path today)
        if expert_type == "Q8_0":
            return q8(name, shape, scale)
        data = _random_mxfp4(rng, shape, scale)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=MX)
        if reference:
            weights[name] = dequantize(data, MX).reshape(shape)

    def f32(name: str, value: np.ndarray) -> None:
        writer.add_tensor(name, value.astype(np.float32))
        if reference:
            weights[name] = value.astype(np.float32)

    table = rng.standard_normal((vocab, H)).astype(np.float32)
    q8("token_embd.weight", (vocab, H), 1.0, table)
    f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(H))
    q8("output.weight", (vocab, H), 1.0, head * table[rng.permutation(vocab)] + rng.standard_normal((vocab, H)) if head else None)
    del table
    for i in range(L):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(H))
        for t, rows in (("q", nh * D), ("k", nkv * D), ("v", nkv * D)):
            q8(p + f"attn_{t}.weight", (rows, H), H ** -0.5)
            f32(p + f"attn_{t}.bias", 0.1 * rng.standard_normal(rows))
        q8(p + "attn_output.weight", (H, nh * D), (nh * D) ** -0.5)
        f32(p + "attn_output.bias", 0.1 * rng.standard_normal(H))
        f32(p + "attn_sinks.weight", rng.standard_normal(nh) * 2)
        f32(p + "post_attention_norm.weight", 1 + 0.1 * rng.standard_normal(H))
        f32(p + "ffn_gate_inp.weight", rng.standard_normal((E, H)) * H ** -0.5 * router)
        f32(p + "ffn_gate_inp.bias", 0.5 * rng.standard_normal(E))
        mxfp4(p + "ffn_gate_exps.weight", (E, F, H), H ** -0.5)
        mxfp4(p + "ffn_up_exps.weight", (E, F, H), H ** -0.5)
        mxfp4(p + "ffn_down_exps.weight", (E, H, F), F ** -0.5 * ffn)
        f32(p + "ffn_gate_exps.bias", 0.1 * rng.standard_normal((E, F)))
        f32(p + "ffn_up_exps.bias", 0.1 * rng.standard_normal((E, F)))
        f32(p + "ffn_down_exps.bias", 0.1 * rng.standard_normal((E, H)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target, {"shapes": s, **weights}


def _yarn_tables(s: dict, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[positions, D / 2]`` as ggml's ``rope_yarn`` (ext_factor 1, beta_fast 32, beta_slow 1)."""
    D, base, factor, original = s["head_dim"], s["rope_base"], s["yarn_factor"], s["yarn_original"]
    corr = lambda rot: D * np.log(original / (rot * 2 * np.pi)) / (2 * np.log(base))  # noqa: E731
    low, high = max(0.0, np.floor(corr(32.0))), min(D - 1.0, np.ceil(corr(1.0)))
    i = np.arange(D // 2)
    extrapolated = base ** (-2.0 * i / D)
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
    theta = np.arange(positions)[:, None] * (extrapolated / factor * (1 - ramp) + extrapolated * ramp)[None, :]
    mscale = 1 + 0.1 * np.log(factor)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def gpt_oss_reference(weights: dict, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's gpt-oss graph (``llm_build_openai_moe_iswa``, ``build_moe_ffn`` with
    SOFTMAX_WEIGHT and SWIGLU_OAI_MOE) in float64 numpy: ``(hidden after the last layer [S, H],
    logits [S, V])`` for one sequence."""
    s = weights["shapes"]
    nh, nkv, D, k, window = s["heads"], s["kv_heads"], s["head_dim"], s["used"], s["window"]
    w = {n: v.astype(np.float64) for n, v in weights.items() if n != "shapes"}
    x = w["token_embd.weight"][ids]
    S = len(ids)
    half = D // 2
    cos, sin = (t[:, None, :] for t in _yarn_tables(s, S))

    def rope(t):  # NEOX: rotate the two halves of each head
        a, b = t[..., :half], t[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    pos = np.arange(S)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], 1e-5)
        q = rope((h @ w[p + "attn_q.weight"].T + w[p + "attn_q.bias"]).reshape(S, nh, D))
        kk = rope((h @ w[p + "attn_k.weight"].T + w[p + "attn_k.bias"]).reshape(S, nkv, D))
        v = (h @ w[p + "attn_v.weight"].T + w[p + "attn_v.bias"]).reshape(S, nkv, D)
        kk, v = np.repeat(kk, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        seen = pos[None, :] <= pos[:, None]
        if i % 2 == 0:  # the sliding-window layers (pattern 2): distance below the window
            seen &= pos[:, None] - pos[None, :] < window
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(D) + np.where(seen, 0.0, -np.inf)
        sink = w[p + "attn_sinks.weight"][:, None, None]
        top = np.maximum(scores.max(-1, keepdims=True), sink)
        att = np.exp(scores - top)
        att /= att.sum(-1, keepdims=True) + np.exp(sink - top)
        x = x + np.einsum("hqk,khd->qhd", att, v).reshape(S, nh * D) @ w[p + "attn_output.weight"].T + w[p + "attn_output.bias"]
        h = _rms(x, w[p + "post_attention_norm.weight"], 1e-5)
        logits = h @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"]
        out = np.zeros_like(h)
        for r in range(S):
            chosen = np.argsort(-logits[r], kind="stable")[:k]
            weight = np.exp(logits[r, chosen] - logits[r, chosen].max())
            weight /= weight.sum()
            for e, we in zip(chosen, weight):
                gate = w[p + "ffn_gate_exps.weight"][e] @ h[r] + w[p + "ffn_gate_exps.bias"][e]
                up = w[p + "ffn_up_exps.weight"][e] @ h[r] + w[p + "ffn_up_exps.bias"][e]
                gx, uy = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
                act = gx / (1 + np.exp(-1.702 * gx)) * (uy + 1)
                out[r] += we * (w[p + "ffn_down_exps.weight"][e] @ act + w[p + "ffn_down_exps.bias"][e])
        x = x + out
    return x, _rms(x, w["output_norm.weight"], 1e-5) @ w["output.weight"].T


if __name__ == "__main__":
    main()
