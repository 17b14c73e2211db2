"""Read a GGUF file: architecture metadata, tokenizer data and weights (``gguf`` package).

Q4_1, Q4_0 and Q8_0 blocks are decoded into :class:`BlockQuantized` without loss, so an int4
or int8 package keeps the file's own quantization; every other type is dequantized with
``gguf.quants`` and re-quantized (or kept as fp32) by the importer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModel
from .weights import BlockQuantized, Weight


class CorruptModel(ValueError):
    """The model file is truncated or not what it claims to be."""


# llama.cpp's converter permutes q/k rows for these so its "normal" rope rotates adjacent
# pairs; the others keep the Hugging Face (neox, rotate-half) layout.
_INTERLEAVED_ROPE = {"llama", "mistral", "granite"}


@dataclass(frozen=True)
class TokenizerData:
    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece)
    pre: str
    tokens: list[str]
    merges: list[str]
    scores: list[float] | None
    token_types: list[int] | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    eos_ids: tuple[int, ...]  # every id that ends generation (eos, eot, im_end...)
    unk_id: int | None = None


class GGUFSource:
    """Random access to one GGUF file's metadata and tensors."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such model file")
        from .gguf_header import check_supported  # refuses from the header in well under a second

        check_supported(self.path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
            self._tensors = {t.name: t for t in self._reader.tensors}
            expected_end = max(
                (int(t.data_offset) + int(t.n_bytes) for t in self._reader.tensors), default=0
            )
        except Exception as exc:  # the reader raises assorted errors on damaged files
            raise CorruptModel(f"{self.path.name}: not a readable GGUF file, truncated or damaged ({exc})") from exc
        if expected_end > self.path.stat().st_size:
            raise CorruptModel(f"{self.path.name}: truncated GGUF file")
        self.config = self._read_config()

    # -- metadata ---------------------------------------------------------------------------
    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _read_config(self) -> ModelConfig:
        arch = self._field("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        a = lambda k, d=None: self._field(f"{arch}.{k}", d)  # noqa: E731
        n_heads = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        head_dim = int(a("attention.key_length", hidden // n_heads))
        vocab = a("vocab_size") or len(self._reader.fields["tokenizer.ggml.tokens"].data)
        if "token_embd.weight" not in self._tensors:
            raise CorruptModel(f"{self.path.name}: no token_embd.weight tensor")
        from .families import family_config

        return family_config(ModelConfig(
            architecture=arch,
            name=str(self._field("general.name", self.path.stem)),
            n_layers=int(a("block_count")),
            hidden_size=hidden,
            intermediate_size=int(a("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            context_length=int(a("context_length", 2048)),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_embeddings="output.weight" not in self._tensors,
            rope_interleaved=arch in _INTERLEAVED_ROPE,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            embedding_scale=float(a("embedding_scale", 1.0)),
            residual_scale=float(a("residual_scale", 1.0)),
            attention_scale=(float(a("attention.scale")) if a("attention.scale") else None),
            logit_scale=float(a("logit_scale", 1.0)),
        ), a, self.has)

    def tokenizer_data(self) -> TokenizerData:
        f = self._field
        tokens = list(f("tokenizer.ggml.tokens"))
        eos = f("tokenizer.ggml.eos_token_id")
        eos_ids = {int(eos)} if eos is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            if f(key) is not None:
                eos_ids.add(int(f(key)))
        from .families import default_chat_template, end_of_turn_ids

        model = str(f("tokenizer.ggml.model", "gpt2"))
        template = f("tokenizer.chat_template") or default_chat_template(self.config.architecture, tokens)
        eos_ids |= end_of_turn_ids(tokens, template)
        scores = f("tokenizer.ggml.scores")
        types = f("tokenizer.ggml.token_type")
        return TokenizerData(
            model=model,
            pre=str(f("tokenizer.ggml.pre", "default")),
            tokens=tokens,
            merges=list(f("tokenizer.ggml.merges") or []),
            scores=[float(s) for s in scores] if scores is not None else None,
            token_types=[int(t) for t in types] if types is not None else None,
            bos_id=int(f("tokenizer.ggml.bos_token_id")) if f("tokenizer.ggml.bos_token_id") is not None else None,
            eos_id=int(eos) if eos is not None else None,
            add_bos=bool(f("tokenizer.ggml.add_bos_token", model == "llama")),  # SentencePiece: BOS unless told not
            chat_template=template,
            eos_ids=tuple(sorted(eos_ids)),
            unk_id=int(f("tokenizer.ggml.unknown_token_id")) if f("tokenizer.ggml.unknown_token_id") is not None else None,
        )

    def tokenizer_json(self) -> str:
        from .tokenizer import tokenizer_json_from_gguf

        return tokenizer_json_from_gguf(self.tokenizer_data(), self.config.architecture)

    def tokenizer_info(self) -> TokenizerData:
        return self.tokenizer_data()

    # -- tensors ----------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self._tensors

    def vector(self, name: str) -> np.ndarray:
        return self.dense(name).reshape(-1)

    def dense(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, numpy layout ``[rows, cols]`` (out, in)."""
        import gguf

        t = self._require(name)
        data = np.asarray(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16):
            out = gguf.quants.dequantize(data, t.tensor_type) if t.tensor_type == gguf.GGMLQuantizationType.BF16 else data
            return np.asarray(out, dtype=np.float32).reshape(self._shape(t))
        return np.asarray(gguf.quants.dequantize(data, t.tensor_type), np.float32).reshape(self._shape(t))

    def linear(self, name: str) -> Weight:
        """A ``[N, K]`` weight, as exact blocks where the file's type maps onto MatMulNBits."""
        import gguf

        t = self._require(name)
        q = gguf.GGMLQuantizationType
        if t.tensor_type in (q.Q4_0, q.Q4_1, q.Q8_0) and self._shape(t)[1] % 32 == 0:
            return _decode_blocks(np.asarray(t.data), t.tensor_type.name, self._shape(t))
        return self.dense(name)

    @staticmethod
    def _shape(t) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(t.shape))  # GGUF lists the fastest axis first

    def _require(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise CorruptModel(f"{self.path.name}: tensor {name} is missing")
        return t


def _decode_blocks(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> BlockQuantized:
    """Decode llama.cpp's 32-element blocks without changing a single value."""
    n, k = shape
    nb = k // 32
    raw = raw.reshape(n, nb, -1)
    if kind == "Q8_0":  # d:f16, qs:int8[32]; w = d * q
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 2:34].copy().view(np.int8).astype(np.int16) + 128
        return BlockQuantized(8, 32, qs.astype(np.uint8).reshape(n, k), d, None)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":  # d:f16, m:f16, qs[16]; w = d * q + m
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = raw[..., 4:20]
    else:  # Q4_0: d:f16, qs[16]; w = d * (q - 8)
        m = -8.0 * d
        qs = raw[..., 2:18]
    low, high = qs & 0x0F, qs >> 4  # llama.cpp: element j in the low nibble, j+16 in the high
    q = np.concatenate([low, high], axis=-1).reshape(n, k).astype(np.uint8)
    safe_d = np.where(d == 0, np.float32(1.0), d)
    zero = np.where(d == 0, np.float32(0.0), -m / safe_d).astype(np.float32)
    scale = np.where(d == 0, np.float32(0.0), d).astype(np.float32)
    # A block with d == 0 is constant m: represent it as scale 0 (value 0) plus nothing; such
    # blocks only occur for all-zero weights in practice, where m == 0 too.
    return BlockQuantized(4, 32, q, scale, zero)
