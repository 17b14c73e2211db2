"""Synthetic GGUFs with real architectures' per-layer shapes, in the block types llama.cpp's files use.

For checks against llama.cpp on models that cannot be downloaded here (Qwen3-30B-A3B, Mixtral-8x7B,
GPT-2 small): ``write_arch_gguf`` writes a file of ``SHAPES[name]`` with ``layers`` layers, the
bundled SmolLM2's tokenizer (vocabulary 49152, its chat template) and random weights, streamed
tensor by tensor with the ``gguf`` writer (as ``synthetic.py`` writes the 8B-shaped file), so a
Qwen3-30B-A3B of 24 layers is written in constant memory.

Block types follow llama.cpp's ``Q4_K_M`` choice (``llama_tensor_get_type``): Q4_K by default,
Q6_K for the head and for ``attn_v`` / ``ffn_down`` (experts' too) on the layers its
``use_more_bits`` picks, Q8_0 for ``attn_k`` / ``attn_v`` of an 8-expert model, Q5_K for GPT-2's
fused ``attn_qkv``; norms, biases, routers and GPT-2's positions stay F32.

Each block holds uniform random quants under scales set so that its weights have mean 0 and a
chosen standard deviation (``sigma / sqrt(fan_in)``): activations keep their size through the
layers and the head's logits have a standard deviation of about ``HEAD_LOGIT_STD``, peaked enough
that top-1 is decided by the weights, not by rounding. (The quants are uniform, not a quantized
Gaussian: the types, bytes and arithmetic are llama.cpp's, the value distribution is not a trained
model's.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..native.quant_types import BY_NAME

HEAD_LOGIT_STD = 8.0

SHAPES: dict[str, dict] = {
    # Qwen3-30B-A3B: 48 layers in the real model
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, ffn=768,
                          dense_ffn=6144, rope_theta=1e6, eps=1e-6, layers=48),
    # Mixtral-8x7B: 32 layers in the real model
    "mixtral-8x7b": dict(arch="llama", hidden=4096, heads=32, kv_heads=8, head_dim=128, experts=8, used=2, ffn=14336,
                         rope_theta=1e6, eps=1e-5, layers=32),
    # GPT-2 small: 12 layers, 1024 positions
    "gpt2-small": dict(arch="gpt2", hidden=768, heads=12, kv_heads=12, head_dim=64, experts=0, used=0, ffn=3072, eps=1e-5, layers=12,
                       context=1024),
}

# GPT-2's tied head would favour the same few tokens at every position (GELU's positive mean leaves a
# direction common to all positions): large position rows make each position's residual its own,
# a final norm gain of 4 peaks the logits (tuned on llama.cpp's greedy text: 23 distinct tokens of 48).
GPT2_SIGMAS = dict(token=0.1, position=3.0, attn_out=3.0, ffn_down=3.0, head_gain=4.0)



def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K ``attn_v`` / ``ffn_down``."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, layer: int, layers: int, experts: int) -> str:
    """The block type of a 2-D/3-D tensor in a Q4_K_M file (``llama_tensor_get_type``, simplified)."""
    if name == "output.weight":
        return "Q6_K"
    if ".attn_qkv." in name:
        return "Q5_K"
    if (".attn_v." in name or ".attn_k." in name) and experts == 8:
        return "Q8_0"
    if (".attn_v." in name or ".ffn_down" in name) and use_more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def random_blocks(kind: str, rows: int, k: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``k`` weights as blocks of ``kind`` (``[rows, k / block * bytes]`` uint8):
    uniform random quants, per-block scales about ``sigma / std(quants)`` (times 0.8..1.2) so the
    weights have mean ~0 and standard deviation ~``sigma``."""
    elems, size = BY_NAME[kind].block_values, BY_NAME[kind].block_bytes
    n = rows * (k // elems)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    jitter = rng.uniform(0.8, 1.2, n)
    if kind == "Q8_0":
        raw[:, :2] = (sigma / 73.9 * jitter).astype(np.float16).view(np.uint8).reshape(n, 2)
        return raw.reshape(rows, -1)
    if kind == "Q6_K":  # w = d * scale * (q - 32), q uniform in 0..63
        raw[:, 192:208] = 16
        raw[:, 208:210] = (sigma / (16 * 18.47) * jitter).astype(np.float16).view(np.uint8).reshape(n, 2)
        return raw.reshape(rows, -1)
    # Q4_K / Q5_K: w = d * sc * q - dmin * m with every 6-bit sc = m = 32 (llama.cpp's get_scale_min_k4 packing)
    levels = 16 if kind == "Q4_K" else 32
    d = sigma / (32 * np.sqrt((levels * levels - 1) / 12)) * jitter
    raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n, 2)
    raw[:, 2:4] = ((levels - 1) / 2 * d).astype(np.float16).view(np.uint8).reshape(n, 2)
    raw[:, 4:12] = 0b10100000
    raw[:, 12:16] = 0
    return raw.reshape(rows, -1)


def _tensors(s: dict, layers: int, vocab: int) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, numpy shape [.., rows, k], type, sigma) in file order; F32 tensors carry sigma of their noise."""
    H, D, nh, nkv, E, F = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["ffn"]
    out: list[tuple[str, tuple[int, ...], str, float]] = []

    def add(name: str, shape: tuple[int, ...], sigma: float, layer: int = 0) -> None:
        kind = "F32" if len(shape) == 1 or name.endswith("ffn_gate_inp.weight") else q4_k_m_type(name, layer, layers, E)
        out.append((name, shape, kind, sigma))

    gpt2 = s["arch"] == "gpt2"
    g = GPT2_SIGMAS
    add("token_embd.weight", (vocab, H), 1.0 if not gpt2 else g["token"])
    if gpt2:
        add("position_embd.weight", (s["context"], H), g["position"])
    add("output_norm.weight", (H,), 0.1)
    if gpt2:
        add("output_norm.bias", (H,), 0.1)
    else:
        add("output.weight", (vocab, H), HEAD_LOGIT_STD / np.sqrt(H))
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (H,), 0.1)
        if gpt2:
            add(p + "attn_norm.bias", (H,), 0.1)
            add(p + "attn_qkv.weight", (3 * H, H), H ** -0.5, i)
            add(p + "attn_qkv.bias", (3 * H,), 0.1)
            add(p + "attn_output.weight", (H, H), g["attn_out"] * H ** -0.5, i)
            add(p + "attn_output.bias", (H,), 0.1)
            add(p + "ffn_norm.weight", (H,), 0.1)
            add(p + "ffn_norm.bias", (H,), 0.1)
            add(p + "ffn_up.weight", (F, H), H ** -0.5, i)
            add(p + "ffn_up.bias", (F,), 0.1)
            add(p + "ffn_down.weight", (H, F), g["ffn_down"] * F ** -0.5, i)
            add(p + "ffn_down.bias", (H,), 0.1)
            continue
        add(p + "attn_q.weight", (nh * D, H), H ** -0.5, i)
        add(p + "attn_k.weight", (nkv * D, H), H ** -0.5, i)
        add(p + "attn_v.weight", (nkv * D, H), H ** -0.5, i)
        add(p + "attn_output.weight", (H, nh * D), (nh * D) ** -0.5, i)
        if s["arch"] == "qwen3moe":
            add(p + "attn_q_norm.weight", (D,), 0.1)
            add(p + "attn_k_norm.weight", (D,), 0.1)
        add(p + "ffn_norm.weight", (H,), 0.1)
        add(p + "ffn_gate_inp.weight", (E, H), 3 * H ** -0.5)
        add(p + "ffn_gate_exps.weight", (E, F, H), H ** -0.5, i)
        add(p + "ffn_up_exps.weight", (E, F, H), H ** -0.5, i)
        add(p + "ffn_down_exps.weight", (E, H, F), F ** -0.5, i)
    return out


def write_arch_gguf(path: Path, shape: str, tokenizer_source: Path, layers: int | None = None, seed: int = 0) -> dict:
    """Write ``path``: ``SHAPES[shape]`` with ``layers`` layers (default the real count); returns
    ``{"bytes": file size, "routed_bytes": weight bytes one decode token reads, "types": {type: count}}``
    (``routed_bytes``: every tensor but a gathered embedding, each MoE layer's experts at ``used / experts``)."""
    import gguf

    s = dict(SHAPES[shape])
    layers = layers or s["layers"]
    arch, H, E = s["arch"], s["hidden"], s["experts"]
    reader = gguf.GGUFReader(str(tokenizer_source))
    w = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    del reader
    w.add_name(f"synthetic {shape} ({layers} layers)")
    ints = {"block_count": layers, "context_length": s.get("context", 4096), "embedding_length": H,
            "feed_forward_length": s.get("dense_ffn", s["ffn"]), "attention.head_count": s["heads"]}
    if arch != "gpt2":
        ints.update({"attention.head_count_kv": s["kv_heads"], "rope.dimension_count": s["head_dim"],
                     "expert_count": E, "expert_used_count": s["used"]})
    if arch == "qwen3moe":
        ints.update({"expert_feed_forward_length": s["ffn"], "attention.key_length": s["head_dim"], "attention.value_length": s["head_dim"]})
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    if arch == "gpt2":
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", s["eps"])
    else:
        w.add_float32(f"{arch}.rope.freq_base", s["rope_theta"])
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", s["eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tensors = _tensors(s, layers, vocab)
    Q = gguf.GGMLQuantizationType
    routed, types = 0, {}
    for name, shp, kind, _ in tensors:
        if kind == "F32":
            nbytes = int(np.prod(shp)) * 4
            w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes)
        else:
            elems, size = BY_NAME[kind].block_values, BY_NAME[kind].block_bytes
            byte_shape = (*shp[:-1], shp[-1] // elems * size)
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=getattr(Q, kind))
        types[kind] = types.get(kind, 0) + 1
        if name == "token_embd.weight" and arch != "gpt2":
            continue  # gathered, not streamed (GPT-2's tied head reads it whole)
        routed += nbytes * s["used"] / E if "_exps." in name else nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shp, kind, sigma in tensors:
        if kind == "F32":
            if name.endswith("ffn_gate_inp.weight") or name == "position_embd.weight":
                data = rng.standard_normal(shp) * sigma
            elif name.endswith(".bias"):
                data = rng.standard_normal(shp) * sigma
            else:  # norms: 1 + noise (GPT-2's last one times its gain: the tied head's logits peaked)
                data = (1 + rng.standard_normal(shp) * sigma) * (GPT2_SIGMAS["head_gain"] if name == "output_norm.weight" and arch == "gpt2" else 1)
            w.write_tensor_data(data.astype(np.float32))
            continue
        rows = int(np.prod(shp[:-1]))
        blocks = random_blocks(kind, rows, shp[-1], sigma, rng)
        w.write_tensor_data(blocks.reshape(*shp[:-1], -1))
        del blocks
    w.close()
    return {"bytes": path.stat().st_size, "routed_bytes": int(routed), "types": types, "layers": layers, "shape": shape}
