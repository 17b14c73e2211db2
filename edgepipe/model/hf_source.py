"""Read a local Hugging Face model folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

Offers the same interface as :class:`GGUFSource` under GGUF tensor names, so the importer
builds the same units. Safetensors are parsed directly (a JSON header and raw little-endian
tensors), bf16 included, so this needs nothing beyond numpy. Hugging Face checkpoints keep
q/k in the rotate-half layout, so rotary runs non-interleaved. Which class is which family, its
config.json keys and tensor names are the family's record (``families.Family.hf_*``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig, UnsupportedModel
from .gguf_source import CorruptModel

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}


@dataclass(frozen=True)
class HFTokenizerInfo:
    chat_template: str | None
    eos_ids: tuple[int, ...]
    bos_id: int | None
    add_bos: bool


class HFSource:
    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        try:
            self.hf = json.loads((self.path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CorruptModel(f"{self.path}: no readable config.json ({exc})") from None
        self._index: dict[str, tuple[Path, dict, int]] = {}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CorruptModel(f"{self.path}: no .safetensors files")
        for f in files:
            self._read_header(f)
        self.config = self._read_config()

    def _read_header(self, f: Path) -> None:
        with open(f, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CorruptModel(f"{f.name}: truncated safetensors file")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CorruptModel(f"{f.name}: bad safetensors header ({exc})") from None
        size = f.stat().st_size
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            begin, end = spec["data_offsets"]
            if 8 + n + end > size:
                raise CorruptModel(f"{f.name}: truncated safetensors file (tensor {name})")
            self._index[name] = (f, spec, 8 + n)

    def _read_config(self) -> ModelConfig:
        from .families import HF_CLASSES

        cls = (self.hf.get("architectures") or ["?"])[0]
        fam = HF_CLASSES.get(cls)
        if fam is None:
            raise UnsupportedModel(f"architecture {cls!r} is not supported (supported: {', '.join(HF_CLASSES)})")
        self.family = fam
        # transformers >= 5 writes rope settings under rope_parameters; older configs use rope_theta / rope_scaling
        rope = {**(self.hf.get("rope_scaling") or {}), **(self.hf.get("rope_parameters") or {})}
        if rope.get("rope_type", "default") not in ("default", None):
            raise UnsupportedModel(f"rope scaling {rope.get('rope_type')!r} is not supported from a folder; import the GGUF")
        theta = float(rope.get("rope_theta", self.hf.get("rope_theta", 10000.0)))
        key = lambda field, default=None: self.hf.get(fam.hf_keys[field], default)  # noqa: E731
        heads = int(key("n_heads"))
        hidden = int(key("hidden_size"))
        flags = {k: v for k, v in fam.graph_flags().items() if k != "rope_interleaved"}
        return ModelConfig(
            architecture=fam.name, name=self.path.name, n_layers=int(key("n_layers")), hidden_size=hidden,
            intermediate_size=int(key("intermediate_size") or 4 * hidden), n_heads=heads, n_kv_heads=int(key("n_kv_heads", heads) or heads),
            head_dim=int(self.hf.get("head_dim") or hidden // heads), vocab_size=int(self.hf["vocab_size"]),
            context_length=int(key("context_length", 2048)), rope_theta=theta,
            rms_eps=float(key("eps", 1e-6)), tie_embeddings=not self.has("output.weight"),
            rope_interleaved=False, attention_bias=self.has("blk.0.attn_q.bias"),
            qk_norm=self.has("blk.0.attn_q_norm.weight"),
            embedding_scale=float(self.hf.get("embedding_multiplier", 1.0)), residual_scale=float(self.hf.get("residual_multiplier", 1.0)),
            attention_scale=self.hf.get("attention_multiplier"), logit_scale=float(self.hf.get("logits_scaling", 1.0)), **flags,
        )

    # -- tensors, under GGUF names --------------------------------------------------------------
    def _hf_name(self, name: str) -> str:
        fam = self.family
        if name in fam.hf_global:
            return fam.hf_global[name]
        _, layer, rest = name.split(".", 2)
        return f"{fam.hf_layer_prefix}{layer}.{fam.hf_layer[rest]}"

    def has(self, name: str) -> bool:
        try:
            return self._hf_name(name) in self._index
        except (KeyError, ValueError):
            return False

    def dense(self, name: str) -> np.ndarray:
        hf = self._hf_name(name)
        if hf not in self._index:
            raise CorruptModel(f"{self.path.name}: tensor {hf} is missing")
        f, spec, base = self._index[hf]
        begin, end = spec["data_offsets"]
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise UnsupportedModel(f"{hf}: dtype {spec['dtype']} is not supported")
        raw = np.fromfile(f, dtype=np.uint8, count=end - begin, offset=base + begin)
        arr = raw.view(dtype).reshape(spec["shape"])
        if spec["dtype"] == "BF16":  # the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        if self.family.hf_conv1d and arr.ndim == 2 and name.startswith("blk."):  # Conv1D keeps [in, out]
            arr = arr.T
        return np.ascontiguousarray(arr, np.float32)

    def vector(self, name: str) -> np.ndarray:
        return self.dense(name).reshape(-1)

    def linear(self, name: str) -> np.ndarray:
        return self.dense(name)

    # -- tokenizer --------------------------------------------------------------------------------
    def tokenizer_json(self) -> str:
        path = self.path / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModel(f"{self.path}: no tokenizer.json (only fast tokenizers are supported)")
        return path.read_text()

    def tokenizer_info(self) -> HFTokenizerInfo:
        cfg = _json(self.path / "tokenizer_config.json")
        gen = _json(self.path / "generation_config.json")
        vocab = {t["content"]: t["id"] for t in json.loads(self.tokenizer_json()).get("added_tokens", [])}
        token = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        eos = set()
        for value in (gen.get("eos_token_id"), self.hf.get("eos_token_id")):
            eos.update(value if isinstance(value, list) else [value] if value is not None else [])
        if token(cfg.get("eos_token")) in vocab:
            eos.add(vocab[token(cfg.get("eos_token"))])
        for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            if special in vocab:
                eos.add(vocab[special])
        bos = vocab.get(token(cfg.get("bos_token")))
        template = cfg.get("chat_template")
        if template is None and (self.path / "chat_template.jinja").is_file():
            template = (self.path / "chat_template.jinja").read_text()
        return HFTokenizerInfo(template, tuple(sorted(int(e) for e in eos)), bos, bool(cfg.get("add_bos_token", False)))


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
