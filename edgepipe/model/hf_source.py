"""Read a local Hugging Face model folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

Offers the same interface as :class:`GGUFSource` under GGUF tensor names, so the importer
builds the same units. Safetensors are parsed directly (a JSON header and raw little-endian
tensors), bf16 included, so this needs nothing beyond numpy. Hugging Face checkpoints keep
q/k in the rotate-half layout, so rotary runs non-interleaved.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import ModelConfig, UnsupportedModel
from .gguf_source import CorruptModel

_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
         "Qwen3ForCausalLM": "qwen3", "GraniteForCausalLM": "granite"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


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
        arch = _ARCH.get((self.hf.get("architectures") or [""])[0])
        if arch is None:
            raise UnsupportedModel(f"architecture {(self.hf.get('architectures') or ['?'])[0]!r} is not supported "
                                   f"(supported: {', '.join(_ARCH)})")
        # transformers >= 5 writes rope settings under rope_parameters; older configs use rope_theta / rope_scaling
        rope = {**(self.hf.get("rope_scaling") or {}), **(self.hf.get("rope_parameters") or {})}
        if rope.get("rope_type", "default") not in ("default", None):
            raise UnsupportedModel(f"rope scaling {rope.get('rope_type')!r} is not supported from a folder; import the GGUF")
        theta = float(rope.get("rope_theta", self.hf.get("rope_theta", 10000.0)))
        heads = int(self.hf["num_attention_heads"])
        hidden = int(self.hf["hidden_size"])
        return ModelConfig(
            architecture=arch, name=self.path.name, n_layers=int(self.hf["num_hidden_layers"]), hidden_size=hidden,
            intermediate_size=int(self.hf["intermediate_size"]), n_heads=heads, n_kv_heads=int(self.hf.get("num_key_value_heads", heads)),
            head_dim=int(self.hf.get("head_dim") or hidden // heads), vocab_size=int(self.hf["vocab_size"]),
            context_length=int(self.hf.get("max_position_embeddings", 2048)), rope_theta=theta,
            rms_eps=float(self.hf.get("rms_norm_eps", 1e-6)), tie_embeddings="lm_head.weight" not in self._index,
            rope_interleaved=False, attention_bias="model.layers.0.self_attn.q_proj.bias" in self._index,
            qk_norm="model.layers.0.self_attn.q_norm.weight" in self._index,
            embedding_scale=float(self.hf.get("embedding_multiplier", 1.0)), residual_scale=float(self.hf.get("residual_multiplier", 1.0)),
            attention_scale=self.hf.get("attention_multiplier"), logit_scale=float(self.hf.get("logits_scaling", 1.0)),
        )

    # -- tensors, under GGUF names --------------------------------------------------------------
    @staticmethod
    def _hf_name(name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        _, layer, rest = name.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"

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
        return np.asarray(arr, np.float32)

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
