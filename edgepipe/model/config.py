"""The architecture description every other part of the model package reads.

One frozen dataclass, filled from GGUF metadata or a Hugging Face ``config.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Architecture = Literal["llama", "qwen2", "qwen3", "mistral", "granite"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "granite")


class UnsupportedModel(ValueError):
    """The source names an architecture or feature edgepipe cannot build."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layers: int
    hidden_size: int  # width of the residual stream, H
    intermediate_size: int  # MLP width, I
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA: n_heads % n_kv_heads == 0)
    head_dim: int  # D
    vocab_size: int  # V
    context_length: int  # trained context; the runtime may cap it lower
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool  # LM head reuses the token embedding matrix
    rope_interleaved: bool  # GGUF "llama" layout rotates adjacent pairs; HF/neox rotates halves
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    embedding_scale: float = 1.0  # Granite multiplies embeddings; 1.0 elsewhere
    residual_scale: float = 1.0
    attention_scale: float | None = None  # None means 1/sqrt(head_dim)
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModel(
                f"{self.n_heads} query heads is not a multiple of {self.n_kv_heads} kv heads"
            )

    @property
    def n_units(self) -> int:
        """Token embedding + decoder layers + head."""
        return self.n_layers + 2

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim * 4  # K and V, fp32

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)
