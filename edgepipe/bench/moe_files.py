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
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_DENSE = ("ffn_gate", "ffn_up", "ffn_down")


def upcycle(source: Path, target: Path, experts: int = 4, used: int = 2, seed: int = 0, tied: bool = False) -> Path:
    """Write ``target``: ``source`` (a dense ``llama`` GGUF) with every FFN turned into
    ``experts`` copies, ``used`` of them routed per row, under a seeded random router."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_uint32(f"{arch}.expert_count", experts)
    writer.add_uint32(f"{arch}.expert_used_count", used)
    rng = np.random.default_rng(seed)
    hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[2] in _DENSE:
            layer = parts[1]
            stacked = np.ascontiguousarray(np.broadcast_to(t.data, (experts, *t.data.shape)))
            writer.add_tensor(f"blk.{layer}.{parts[2]}_exps.weight", stacked, raw_shape=stacked.shape, raw_dtype=t.tensor_type)
            if parts[2] == "ffn_gate":
                router = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1
                if tied:
                    router = np.repeat(router[::used], used, axis=0)[:experts]
                writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router)
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)  # bytes per row for blocks
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


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
