"""Synthetic GGUFs of real architectures' shapes: random Q4_K / Q6_K blocks written with the
``gguf`` writer, so a benchmark can measure an 8B-shaped model on a machine that holds no model file
(a GPU machine reached without network). The weights are random; the shapes, types and bytes are real."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..native.quant_types import BY_NAME

SHAPES = {
    "tiny": dict(n_layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=2048),
    "llama-3.2-1b": dict(n_layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256),
    "llama-3-8b": dict(n_layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
}
LLAMA3_8B = SHAPES["llama-3-8b"]


def write_synthetic_gguf(path: Path, n_layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, seed: int = 0) -> int:
    """A Llama GGUF of the given shapes: random Q4_K blocks (Q6_K for attn_v, ffn_down, output), F32 norms."""
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": ((vocab, hidden), Q.Q4_K), "output_norm.weight": ((hidden,), Q.F32), "output.weight": ((vocab, hidden), Q.Q6_K)}
    for i in range(n_layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": ((hidden,), Q.F32), p + "ffn_norm.weight": ((hidden,), Q.F32),
                       p + "attn_q.weight": ((hidden, hidden), Q.Q4_K), p + "attn_k.weight": ((kv_heads * head_dim, hidden), Q.Q4_K),
                       p + "attn_v.weight": ((kv_heads * head_dim, hidden), Q.Q6_K), p + "attn_output.weight": ((hidden, hidden), Q.Q4_K),
                       p + "ffn_gate.weight": ((ffn, hidden), Q.Q4_K), p + "ffn_up.weight": ((ffn, hidden), Q.Q4_K),
                       p + "ffn_down.weight": ((hidden, ffn), Q.Q6_K)})
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    byte_tokens = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    byte_tokens += [chr(256 + i) for i in range(256 - len(byte_tokens))]
    tokens = byte_tokens + [f"tok{i}" for i in range(vocab - len(byte_tokens))]
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    def block(qtype):  # (values, bytes) per block, from the type table
        return BY_NAME[qtype.name].block_values, BY_NAME[qtype.name].block_bytes

    for name, (shape, qtype) in shapes.items():
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            elems, size = block(qtype)
            w.add_tensor_info(name, (shape[0], shape[1] // elems * size), np.dtype(np.uint8), shape[0] * shape[1] // elems * size, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, (shape, qtype) in shapes.items():
        if qtype == Q.F32:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        elems, size = block(qtype)
        raw = np.frombuffer(rng.bytes(shape[0] * shape[1] // elems * size), np.uint8).reshape(-1, size).copy()
        scales = (rng.uniform(0.5, 1.5, (raw.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)
        if qtype == Q.Q6_K:
            raw[:, 208:210] = scales[:, 0:2]
        else:
            raw[:, 0:4] = scales
        w.write_tensor_data(raw.reshape(shape[0], -1))
        del raw
    w.close()
    return path.stat().st_size




def random_gguf_rows(kind: str, n: int, k: int, rng) -> np.ndarray:
    """``n`` rows of ``k`` weights as random GGUF blocks of type ``kind`` (``[n, k / block * block_bytes]``
    uint8), each block's scales set to small float16 values so that the decoded weights are finite."""
    t = BY_NAME[kind]
    raw = rng.integers(0, 256, (n, k // t.block_values, t.block_bytes), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, raw.shape[:2] + (2,)) * 1e-3).astype(np.float16).view(np.uint8)
    if kind == "MXFP4":  # E8M0 exponents 2^-16..2^-12: weights up to ~3e-3, as the fp16 scales give
        raw[..., 0] = rng.integers(112, 117, raw.shape[:2], dtype=np.uint8)
    elif kind == "Q6_K":
        raw[..., 208:210] = scales[..., :2]
    else:
        raw[..., 0:4] = scales.reshape(*raw.shape[:2], 4)
    return raw.reshape(n, -1)
