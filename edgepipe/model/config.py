"""The architecture description every other part of the model package reads.

One frozen dataclass, filled from GGUF metadata or a Hugging Face ``config.json``; which
architectures there are, and what each sets here, is ``families.FAMILIES``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .families import SUPPORTED_ARCHITECTURES  # noqa: F401 - re-exported: the registry is families.FAMILIES


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
    # -- layer structure beyond Llama (defaults keep the Llama layer) --
    ffn_activation: str = "silu"  # "silu" or "gelu_tanh" (Gemma): act(gate) * up; "swiglu_oai" (gpt-oss): llama.cpp's ggml_swiglu_oai
    post_norms: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs before each residual add
    rotary_dim: int = 0  # rotated dims per head (Phi-4-mini rotates 3/4); 0 = head_dim
    sliding_window: int = 0  # tokens a sliding-window layer sees (itself included); 0 = none
    layer_windows: tuple[int, ...] = ()  # per layer: sliding_window or 0 (global); empty = all global
    rope_theta_local: float | None = None  # RoPE base of sliding-window layers (Gemma 3: 10000)
    rope_linear_factor: float = 1.0  # linear position scaling of the global layers' RoPE
    rope_attn_factor: float = 1.0  # LongRoPE: cos/sin scaled by this (Phi-3 "su")
    rope_original_context: int = 0  # LongRoPE: past this context the long factors apply
    rope_yarn_factor: float = 0.0  # YaRN (gpt-oss): the context scale factor; 0 = no YaRN (rope_original_context: its original context)
    rope_yarn_beta_fast: float = 32.0  # YaRN's ramp corners (llama.cpp's yarn_beta_fast / yarn_beta_slow)
    rope_yarn_beta_slow: float = 1.0
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head in each softmax's denominator (attn_sinks)
    attn_logit_softcap: float = 0.0  # Gemma 2: tanh soft-capping of attention scores; 0 = off
    final_logit_softcap: float = 0.0  # Gemma 2: tanh soft-capping of the logits; 0 = off
    # -- GPT-2's layer (defaults keep the Llama layer) --
    learned_positions: bool = False  # position_embd rows added to the token embedding; no RoPE
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm with a bias); rms_eps is either's epsilon
    gated_ffn: bool = True  # act(gate) * up; False: act(up) (one up projection)
    biases: bool = False  # every linear (qkv, attn_output, ffn_up, ffn_down) and norm carries a bias
    # -- mixture of experts (model/moe.py; 0 experts = dense FFNs) --
    n_experts: int = 0  # E: experts per MoE layer
    n_experts_used: int = 0  # k: experts each row is routed to
    expert_intermediate_size: int = 0  # an expert's FFN width (qwen3moe: expert_feed_forward_length)
    expert_weights_norm: bool = True  # the k selected weights divided by their sum (llama.cpp's norm_w)
    expert_weights_scale: float = 0.0  # the weights times this where it is not 0 or 1 (llama.cpp's w_scale)
    expert_gating: str = "softmax"  # "softmax": over all E logits, then top k; "softmax_weight" (gpt-oss): top k logits, softmax over those

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
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
        return 2 * self.n_kv_heads * self.head_dim * 4  # K and V, fp32 (the gguf form's fp16 cache: half, see Manifest.kv_bytes_per_token)

    def window(self, layer: int) -> int:
        """Tokens layer ``layer`` (0-based) attends to, itself included; 0 = the whole context."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)
