"""Every supported family, as a tiny random GGUF written here, generates exactly the greedy
tokens Hugging Face transformers generates from the same file, in one stage and in three.

The files are written with the ``gguf`` writer in llama.cpp's layout (tensor names, metadata
keys, Gemma's stored ``1 + w`` norms, Phi-3's fused qkv and gate-up); the vocabularies are
trained here with ``tokenizers`` (byte-level BPE, or SentencePiece-style pieces with ``<0xXX>``
byte fallback and scores). transformers reads the same files with its own GGUF loader.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from edgepipe.model.config import SUPPORTED_ARCHITECTURES, UnsupportedModel
from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.runtime.local import generate
from edgepipe.runtime.sequence import GenerationParams

gguf = pytest.importorskip("gguf")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }  // loop",
    "Hello, world! Hello there. How are you today? I am fine, thank you.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji time 🙂🚀🎉 and café, naïve, résumé, Ünïcödé.",
    "    indented text\twith tabs\n\nand  double  spaces   and   more.",
    "Numbers: 12345 67890 3.14159 2024-01-01 and 1,000,000.",
]

# Metadata and tensors per family: what each adds to the Llama layer.
SPECS = {
    "llama": dict(tok="bpe", pre="llama-bpe", n_layers=3, heads=4, kv=2, head_dim=16),
    "qwen2": dict(tok="bpe", pre="qwen2", n_layers=3, heads=4, kv=2, head_dim=16, bias=True, tied=True),
    # transformers reads no head_dim for qwen3 GGUFs and keeps its default, 128 (as the real models have).
    "qwen3": dict(tok="bpe", pre="qwen2", n_layers=3, heads=2, kv=1, head_dim=128, qk_norm=True),
    # Mistral 7B, Llama 2 and TinyLlama files: the llama architecture with a SentencePiece vocabulary.
    "mistral": dict(arch="llama", tok="spm", n_layers=3, heads=4, kv=2, head_dim=16),
    # Gemma: transformers fixes the attention scale at 256^-0.5 (query_pre_attn_scalar), llama.cpp
    # uses head_dim^-0.5: with head_dim 256 both agree, as they do for the real models.
    # embd_s: a small embedding (scaled by sqrt(H) in the graph) keeps the random model's greedy
    # tokens varied; at 0.5 it repeats one token, which would check little.
    "gemma2": dict(tok="gemma", n_layers=4, heads=2, kv=1, head_dim=256, window=8, tied=True, post_norms=True, embd_s=0.02),
    "gemma3": dict(tok="gemma", n_layers=6, heads=2, kv=1, head_dim=256, window=8, tied=True, post_norms=True, embd_s=0.02,
                   qk_norm=True),
    "phi3": dict(tok="phi3", n_layers=3, heads=4, kv=4, head_dim=16, fused=True),
}
HIDDEN, FFN = 64, 96

SPECIALS = {
    "bpe": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"],
    "spm": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
    "gemma": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_vocab(kind: str) -> dict:
    """tokens, scores, token types, merges and special ids for one tokenizer kind."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = SPECIALS[kind]
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=specials, show_progress=False)
        tok.train_from_iterator(CORPUS * 4, trainer)
        model = json.loads(tok.to_str())["model"]
        tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        types = [3 if t in specials else 1 for t in tokens]
        return dict(model="gpt2", tokens=tokens, merges=merges, scores=None, types=types,
                    bos=tokens.index("<|endoftext|>"), eos=tokens.index("<|endoftext|>"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[], show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    pieces = [t for t, _ in sorted(json.loads(tok.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    if kind == "gemma":  # Gemma keeps runs of spaces as real spaces
        pieces += ["  ", "   "]
    tokens = specials[:5] + byte_tokens + pieces + specials[5:]
    types = [3 if t in specials else 6 if t in byte_tokens else 1 for t in tokens]
    types[tokens.index("<unk>")] = 2
    scores = [0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)]
    bos, eos = ("<bos>", "<eos>") if kind == "gemma" else ("<s>", "</s>")
    return dict(model="llama", tokens=tokens, merges=None, scores=scores, types=types,
                bos=tokens.index(bos), eos=tokens.index(eos), unk=tokens.index("<unk>"))


def write_tiny_gguf(path: Path, family: str, seed: int = 0, extra_tensors: dict | None = None, spec: dict | None = None,
                    **extra_meta) -> Path:
    """A random model of ``family`` with a trained vocabulary, as llama.cpp would write it."""
    spec = {**SPECS[family], **(spec or {})}
    arch = spec.get("arch", family)
    vocab = train_vocab(spec["tok"])
    rng = np.random.default_rng(seed)
    L, H, F, nq, nkv, D = spec["n_layers"], HIDDEN, FFN, spec["heads"], spec["kv"], spec["head_dim"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(nq)
    w.add_head_count_kv(nkv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if "window" in spec:
        w.add_sliding_window(spec["window"])
    for key, value in extra_meta.items():
        w.add_float32(f"{arch}.{key}", value) if isinstance(value, float) else w.add_uint32(f"{arch}.{key}", value)
    w.add_tokenizer_model(vocab["model"])
    if vocab["model"] == "gpt2":
        w.add_tokenizer_pre(spec["pre"])
        w.add_token_merges(vocab["merges"])
    else:
        w.add_token_scores(vocab["scores"])
        w.add_unk_token_id(vocab["unk"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_pad_token_id(vocab["eos"])
    if arch in ("qwen2", "qwen3"):
        w.add_chat_template(CHATML)
        w.add_add_bos_token(False)
    if arch == "gemma3":
        w.add_add_bos_token(True)

    V = len(vocab["tokens"])
    dense = lambda *shape, s=0.15: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", dense(V, H, s=spec.get("embd_s", 1.0)))
    w.add_tensor("output_norm.weight", norm(H))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(array, np.float32))
    if not spec.get("tied"):
        w.add_tensor("output.weight", dense(V, H, s=0.3))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(H))
        if spec.get("fused"):
            w.add_tensor(p + "attn_qkv.weight", dense((nq + 2 * nkv) * D, H))
        else:
            w.add_tensor(p + "attn_q.weight", dense(nq * D, H))
            w.add_tensor(p + "attn_k.weight", dense(nkv * D, H))
            w.add_tensor(p + "attn_v.weight", dense(nkv * D, H))
        if spec.get("bias"):
            for x, n in (("q", nq), ("k", nkv), ("v", nkv)):
                w.add_tensor(p + f"attn_{x}.bias", dense(n * D, s=0.2))
        if spec.get("qk_norm"):
            w.add_tensor(p + "attn_q_norm.weight", norm(D))
            w.add_tensor(p + "attn_k_norm.weight", norm(D))
        w.add_tensor(p + "attn_output.weight", dense(H, nq * D))
        w.add_tensor(p + "ffn_norm.weight", norm(H))
        if spec.get("fused"):
            w.add_tensor(p + "ffn_up.weight", dense(2 * F, H))
        else:
            w.add_tensor(p + "ffn_gate.weight", dense(F, H))
            w.add_tensor(p + "ffn_up.weight", dense(F, H))
        w.add_tensor(p + "ffn_down.weight", dense(H, F))
        if spec.get("post_norms"):
            w.add_tensor(p + "post_attention_norm.weight", norm(H))
            w.add_tensor(p + "post_ffw_norm.weight", norm(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the reference ----------------------------------------------------------------------------
def hf_model(path: Path, **config_overrides):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(x, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


PROMPT = "def fibonacci(n): the quick brown fox jumps over the lazy dog 🙂 東京 12345"
N_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-families")


def test_every_supported_architecture_has_a_reference():
    # gpt2's reference is tests/test_gpt2.py (transformers' GPT2LMHeadModel, another layer than these);
    # qwen3moe's is tests/test_moe_qwen3.py and gpt-oss's tests/test_gpt_oss.py (numpy references of llama.cpp's graphs)
    assert set(SUPPORTED_ARCHITECTURES) <= {s.get("arch", f) for f, s in SPECS.items()} | {"gpt2", "qwen3moe", "gpt-oss"}


@pytest.mark.parametrize("arch", list(SPECS))
def test_family_greedy_matches_transformers(arch, tiny_dir):
    pytest.importorskip("torch")
    path = write_tiny_gguf(tiny_dir / f"{arch}.gguf", arch)
    pkg = Package(import_model(path, tiny_dir / "models", "fp32", max_context=256, measure_cost=False))
    ids = pkg.tokenizer.encode(PROMPT)
    window = SPECS[arch].get("window", 0)
    assert len(ids) > window, "the prompt must be longer than the sliding window"
    # Window layers keep only their last positions (stage_runner.window_start): 40 tokens past
    # the prompt trims them several times.
    n_tokens = 40 if window else N_TOKENS
    expected = hf_greedy(hf_model(path), ids, n_tokens)
    n_units = len(pkg.manifest.units)
    # The cut at n_units - 2 falls between a window layer and a global one (gemma2: also at 2;
    # gemma3's middle stage holds window layers only).
    for cuts in ([], [2, n_units - 2]):
        got = generate(pkg.pipeline(cuts), ids, GenerationParams(max_tokens=n_tokens), pkg.tokenizer.decode, eos_ids=())
        assert got.tokens == expected, f"{arch} at {len(cuts) + 1} stage(s)"


# -- fail fast: refused from the header, before any tensor is read -----------------------------
def _header_only_gguf(path: Path, arch: str, tokenizer_model: str = "gpt2", tensor_type=None, vocab: int = 1000) -> Path:
    """A GGUF whose header names a 64 MB tensor that the file does not contain: reading any
    tensor would fail with "truncated", so a refusal that names the real reason read none."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    qtype = tensor_type or gguf.GGMLQuantizationType.F32
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor_info("token_embd.weight", (4096, 4096), np.dtype(np.float32), 4096 * 4096 // block * size, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, tok_model, qtype, words", [
    ("bert", "gpt2", None, ["architecture 'bert' is not supported", "gemma3"]),
    ("deepseek2", "gpt2", None, ["architecture 'deepseek2'", "multi-head latent attention (MLA"]),
    ("gemma3", "t5", None, ["tokenizer model 't5' is not supported", "llama"]),
    ("llama", "gpt2", "Q8_1", ["tensor type Q8_1 is not supported"]),
    ("qwen2", "gpt2", None, ["missing tensors", "output_norm.weight", "more"]),
])
def test_unsupported_file_refused_from_header_in_under_a_second(tmp_path, arch, tok_model, qtype, words):
    qt = getattr(gguf.GGMLQuantizationType, qtype) if qtype else None
    path = _header_only_gguf(tmp_path / f"{arch}.gguf", arch, tok_model, qt, vocab=262_144)
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModel) as err:
        import_model(path, tmp_path / "models", "int4")
    elapsed = time.perf_counter() - t0
    for w in words:
        assert w in str(err.value), str(err.value)
    assert "truncated" not in str(err.value)
    assert elapsed < 1.0, f"refusal took {elapsed:.2f} s"
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


# -- RoPE scaling: transformers does not read it from a GGUF, so the reference is the same
# -- weights in a transformers model configured with the scaling the file describes.
def hf_with_rope(path: Path, rope: dict, **config):
    import copy

    base = hf_model(path)
    cfg = copy.deepcopy(base.config)
    cfg.rope_parameters = {**rope, "rope_theta": 10000.0}
    if "original_max_position_embeddings" in rope:  # Phi-3 keeps a copy at the top level
        cfg.original_max_position_embeddings = rope["original_max_position_embeddings"]
    for key, value in config.items():
        setattr(cfg, key, value)
    scaled = type(base)(cfg).eval()
    missing, unexpected = scaled.load_state_dict(base.state_dict(), strict=False)
    assert not [k for k in missing if "rotary" not in k] and not unexpected
    return base, scaled


def llama3_factors(head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for rope_type "llama3"."""
    freqs = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _ours(path: Path, tiny_dir: Path, name: str, max_context: int, cuts=()) -> list[int]:
    pkg = Package(import_model(path, tiny_dir / "models", "fp32", name=name, max_context=max_context, measure_cost=False))
    ids = pkg.tokenizer.encode(PROMPT)
    return ids, generate(pkg.pipeline(list(cuts)), ids, GenerationParams(max_tokens=N_TOKENS), pkg.tokenizer.decode, eos_ids=()).tokens


def test_llama3_rope_scaling_matches_transformers(tiny_dir):
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    factors = llama3_factors(16, 8.0, 1.0, 4.0, 32)
    assert 1.0 < factors.max() and factors.min() == 1.0  # all three regimes of the formula occur
    path = write_tiny_gguf(tiny_dir / "llama31.gguf", "llama", seed=3, extra_tensors={"rope_freqs.weight": factors})
    base, scaled = hf_with_rope(path, rope)
    ids, ours = _ours(path, tiny_dir, "llama31", 256, cuts=[2, 3])
    assert ours == hf_greedy(scaled, ids, N_TOKENS)
    assert ours != hf_greedy(base, ids, N_TOKENS)  # the scaling changes the tokens: the check can fail


@pytest.mark.parametrize("original", [64, 8])  # prompt + generated fit the original context / do not
def test_phi3_longrope_matches_transformers(tiny_dir, original):
    rng = np.random.default_rng(original)
    short, long = 1.0 + rng.random(8).astype(np.float32), 1.0 + 8 * rng.random(8).astype(np.float32)
    attn_factor = float(np.sqrt(1 + np.log(512 / original) / np.log(original)))  # as llama.cpp's converter writes it
    path = write_tiny_gguf(tiny_dir / f"phi3-longrope-{original}.gguf", "phi3", seed=5,
                           extra_tensors={"rope_factors_short.weight": short, "rope_factors_long.weight": long},
                           **{"rope.scaling.original_context_length": original, "rope.scaling.attn_factor": attn_factor})
    rope = dict(rope_type="longrope", short_factor=short.tolist(), long_factor=long.tolist(),
                original_max_position_embeddings=original)
    base, scaled = hf_with_rope(path, rope)
    ids, ours = _ours(path, tiny_dir, f"phi3-longrope-{original}", 64 if original == 64 else 256, cuts=[2, 3])
    assert len(ids) + N_TOKENS <= 64
    assert ours == hf_greedy(scaled, ids, N_TOKENS)
    assert ours != hf_greedy(base, ids, N_TOKENS)


def test_phi4_mini_partial_rotary_matches_transformers(tiny_dir):
    """Phi-4-mini rotates 3/4 of each head (rope.dimension_count); transformers' GGUF reader
    ignores the key, so the reference is configured with partial_rotary_factor."""
    # ONNX Runtime's rotary wants the rotated half-width to be a multiple of 8: 3/4 of 64 is 48.
    path = write_tiny_gguf(tiny_dir / "phi4mini.gguf", "phi3", seed=7, spec=dict(heads=1, kv=1, head_dim=64),
                           **{"rope.dimension_count": 48})
    base, scaled = hf_with_rope(path, dict(rope_type="default", partial_rotary_factor=0.75), partial_rotary_factor=0.75)
    ids, ours = _ours(path, tiny_dir, "phi4mini", 256, cuts=[2, 3])
    assert ours == hf_greedy(scaled, ids, N_TOKENS)
    assert ours != hf_greedy(base, ids, N_TOKENS)
