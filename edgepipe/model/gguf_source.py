"""Read a GGUF file: architecture metadata, tokenizer data and weights.

The header is parsed by ``gguf_header.parse_header`` (``gguf.GGUFReader`` decodes every
vocabulary string one numpy call at a time: ~45 s for a 150k vocabulary on a busy machine), and
tensors are read row range by row range with ``pread``, so nothing maps the whole file into memory. Block types in
``weights.NATIVE_TYPES`` decode exactly into MatMulNBits blocks; float types into float32;
anything else is refused from the header, naming the tensor and its type.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig, UnsupportedModel
from ..native.quant_types import GGML_TYPE_IDS, kernel_handles
from .weights import FLOAT_TYPES, BlockQuantized, Weight, decode_float, decode_native, row_bytes


class CorruptModel(ValueError):
    """The model file is truncated or not what it claims to be."""


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


@dataclass(frozen=True)
class TensorEntry:
    name: str
    kind: str  # GGUF type name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # numpy order: [rows, cols] (out, in)
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1


class UnsupportedTensorType(UnsupportedModel):
    """A tensor's GGUF type has no exact representation here."""


def read_gguf_header(path: Path) -> tuple[dict, dict[str, TensorEntry]]:
    """Every metadata value (arrays as lists) and the tensor table; raises ValueError when damaged."""
    import mmap

    import gguf

    from .gguf_header import parse_header

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, tensors_raw, pos = parse_header(buf, full_arrays=True)
    align = int(meta.get("general.alignment", 32))
    data_start = -(-pos // align) * align
    tensors = {}
    for name, dims, type_id, offset in tensors_raw:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            kind = qtype.name
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            kind, block, type_size = f"ggml type {type_id}", 1, 0
        shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest axis first
        elems = int(np.prod(shape, dtype=np.int64))
        tensors[name] = TensorEntry(name, kind, shape, data_start + offset, elems // block * type_size)
    end = max((t.offset + t.nbytes for t in tensors.values()), default=0)
    if end > size:
        raise ValueError(f"truncated: tensor data ends at byte {end}, the file has {size}")
    return meta, tensors


def refuse_unsupported_types(path: Path, tensors: dict[str, TensorEntry]) -> None:
    """One line naming the first tensor whose type has no exact layout (before reading any data)."""
    for t in tensors.values():
        if not kernel_handles(t.kind) and t.kind not in FLOAT_TYPES:
            others = sum(1 for u in tensors.values() if u.kind == t.kind) - 1
            more = f" (and {others} more of that type)" if others else ""
            raise UnsupportedTensorType(
                f"{path.name}: tensor {t.name} has GGUF type {t.kind}{more}, which edgepipe cannot keep exactly "
                f"(supported: {', '.join(FLOAT_TYPES + tuple(GGML_TYPE_IDS))})")


class GGUFSource:
    """Random access to one GGUF file's metadata and tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such model file")
        from .gguf_header import check_supported  # refuses from the header in well under a second

        check_supported(self.path)
        try:
            self._meta, self._tensors = read_gguf_header(self.path)
        except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
            raise CorruptModel(f"{self.path.name}: not a readable GGUF file, truncated or damaged ({exc})") from exc
        refuse_unsupported_types(self.path, self._tensors)
        self._file = None  # opened by the first ``raw_rows``, kept for the rest of the import; ``close`` ends it
        self.config = self._read_config()

    def close(self) -> None:
        """Close the file the tensors are read from (reading again reopens it)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- metadata ---------------------------------------------------------------------------
    def _field(self, key: str, default=None):
        return self._meta.get(key, default)

    def _read_config(self) -> ModelConfig:
        from .families import family, family_config, refusal

        arch = self._field("general.architecture")
        if refusal(arch):
            raise UnsupportedModel(refusal(arch))
        fam = family(arch)
        a = lambda k, d=None: self._field(f"{arch}.{k}", d)  # noqa: E731
        n_heads = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        head_dim = int(a("attention.key_length", hidden // n_heads))
        vocab = a("vocab_size") or len(self._meta.get("tokenizer.ggml.tokens", ()))
        if "token_embd.weight" not in self._tensors:
            raise CorruptModel(f"{self.path.name}: no token_embd.weight tensor")
        ffn = a("feed_forward_length")
        if ffn is None:  # (GPT-2 files may leave it out: the up projection's rows say it)
            up = self._tensors.get("blk.0.ffn_up.weight")
            ffn = up.shape[0] if up is not None else 4 * hidden
        from .moe import moe_config

        return moe_config(family_config(ModelConfig(
            architecture=arch,
            name=str(self._field("general.name", self.path.stem)),
            n_layers=int(a("block_count")),
            hidden_size=hidden,
            intermediate_size=int(ffn),
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            vocab_size=int(vocab),
            context_length=int(a("context_length", 2048)),
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rms_eps=float(a(fam.eps_key, 1e-6 if fam.norm == "rms" else 1e-5)),
            tie_embeddings="output.weight" not in self._tensors,
            rope_interleaved=False,  # (the family's layout: family_config)
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            embedding_scale=float(a("embedding_scale", 1.0)),
            residual_scale=float(a("residual_scale", 1.0)),
            attention_scale=(float(a("attention.scale")) if a("attention.scale") else None),
            logit_scale=float(a("logit_scale", 1.0)),
        ), a, self.has), a)

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

    def tensor(self, name: str) -> TensorEntry:
        return self._require(name)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def raw_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Bytes of rows ``[start, stop)`` as ``[rows, row_bytes]`` uint8, read with ``pread``."""
        t = self._require(name)
        width = row_bytes(t.kind, t.shape[-1])
        if self._file is None:
            self._file = open(self.path, "rb")
        data = os.pread(self._file.fileno(), (stop - start) * width, t.offset + start * width)
        return np.frombuffer(data, np.uint8).reshape(stop - start, width)

    def rows(self, name: str, start: int, stop: int) -> Weight:
        """Rows ``[start, stop)`` as exact blocks (block types) or float32 (float types)."""
        t = self._require(name)
        raw = self.raw_rows(name, start, stop)
        if t.kind in FLOAT_TYPES:
            return decode_float(raw, t.kind, t.shape[-1])
        return decode_native(raw, t.kind, t.shape[-1])

    def dense(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, numpy layout ``[rows, cols]`` (out, in)."""
        t = self._require(name)
        w = self.rows(name, 0, t.rows)
        w = w.dequantize() if isinstance(w, BlockQuantized) else w
        return np.asarray(w, np.float32).reshape(t.shape)

    def linear(self, name: str) -> Weight:
        """A ``[N, K]`` weight: the file's own blocks, exactly, or float32 for float types."""
        t = self._require(name)
        return self.rows(name, 0, t.rows)

    def _require(self, name: str) -> TensorEntry:
        t = self._tensors.get(name)
        if t is None:
            raise CorruptModel(f"{self.path.name}: tensor {name} is missing")
        return t
