"""The architectures edgepipe builds: one :class:`Family` record each, in :data:`FAMILIES`.

Adding an architecture is one record here. Everything that reads a model differently per
architecture reads the record: ``gguf_header`` (is it supported, which tensors must be there),
``gguf_source`` (metadata keys, RoPE layout, the layer structure it puts in ``ModelConfig``),
``hf_source`` (config.json class and keys, tensor names), ``tokenizer`` (SentencePiece text
handling), the chat template a file without one gets, and the graph flags ``graphs`` builds from
(through ``ModelConfig``). Pure data and pure functions: metadata in, config out; RoPE tables per
layer kind; chat templates and end-of-turn tokens.

A later axis (mixture-of-experts layers, say) is one more field of :class:`Family` with a
default that keeps today's records as they are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import numpy as np

if TYPE_CHECKING:
    from .config import ModelConfig

Meta = Callable[..., object]  # a("attention.sliding_window", default) reads "{arch}.attention.sliding_window"
Has = Callable[[str], bool]  # whether the file holds a tensor of that name


# -- chat templates and end-of-turn tokens ------------------------------------------------------
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{% if message['role'] == 'system' %}{{ '<start_of_turn>user\n' + message['content'] + '\n\n' }}"
    "{% else %}{% if not (loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system') %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% endif %}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LLAMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_INST_TEMPLATE = (  # Llama 2 / Mistral
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ ' ' + message['content'] + '</s>' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}{% endfor %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """A chat template a file without ``tokenizer.chat_template`` gets when its vocabulary has
    ``markers``: any family's file where ``any_family`` (those markers plus ``any_family``'s name
    the format), else only the files of families whose record names this format."""

    name: str
    template: str
    markers: tuple[str, ...]
    any_family: tuple[str, ...] | None = ()  # None: only the family's own


# Tried in this order; the first that applies wins.
CHAT_FORMATS: tuple[ChatFormat, ...] = (
    ChatFormat("gemma", _GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>")),
    ChatFormat("phi3", _PHI3_TEMPLATE, ("<|end|>",), any_family=None),
    ChatFormat("llama3", _LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|eot_id|>")),
    ChatFormat("chatml", _CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    ChatFormat("inst", _INST_TEMPLATE, ("</s>",), any_family=("[INST]",)),
)

# Tokens that end an assistant turn, in the templates above and in the families' own templates.
END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")


# -- what the families add to the Llama layer, read from their metadata --------------------------
def _sliding(pattern: int, softcaps: bool) -> Callable[["ModelConfig", Meta, Has], dict]:
    """Gemma 2 / 3: a sliding-window layer unless (layer + 1) % pattern == 0; embeddings scaled
    by sqrt(H); the 27B models scale attention by the hidden width per head."""
    def configure(cfg: "ModelConfig", a: Meta, has: Has) -> dict:
        H = cfg.hidden_size
        window = int(a("attention.sliding_window", 4096))
        big = cfg.n_layers == (46 if softcaps else 62)  # the 27B models
        changes = dict(
            embedding_scale=float(np.float32(math.sqrt(H))),
            attention_scale=1.0 / math.sqrt(H / cfg.n_heads if big else cfg.head_dim),
            sliding_window=window,
            layer_windows=tuple(window if (i + 1) % pattern else 0 for i in range(cfg.n_layers)),
        )
        if softcaps:
            changes["attn_logit_softcap"] = float(a("attn_logit_softcapping", 50.0))
            changes["final_logit_softcap"] = float(a("final_logit_softcapping", 30.0))
        else:
            changes["rope_theta_local"] = float(a("rope.freq_base_swa", 10000.0))
        return changes
    return configure


def _phi3(cfg: "ModelConfig", a: Meta, has: Has) -> dict:
    if not has("rope_factors_long.weight"):
        return {}
    return dict(rope_attn_factor=_longrope_attn_factor(a, cfg.context_length),
                rope_original_context=int(a("rope.scaling.original_context_length", cfg.context_length)))


def _mistral(cfg: "ModelConfig", a: Meta, has: Has) -> dict:
    if not a("attention.sliding_window"):
        return {}
    window = int(a("attention.sliding_window"))
    return dict(sliding_window=window, layer_windows=(window,) * cfg.n_layers)


def _gpt_oss(cfg: "ModelConfig", a: Meta, has: Has) -> dict:
    """gpt-oss (llama.cpp's ``LLM_ARCH_OPENAI_MOE``): sliding-window layers where
    ``layer % pattern < pattern - 1`` (``set_swa_pattern``; pattern 2: the even layers), the others
    full; a learned sink logit per query head in every softmax (``attn_sinks``)."""
    from .config import UnsupportedModel

    window = int(a("attention.sliding_window", 128))
    pattern = a("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):  # one flag per layer
        swa = [bool(x) for x in pattern]
    else:
        pattern = int(pattern)
        swa = [pattern == 0 or i % pattern < pattern - 1 for i in range(cfg.n_layers)]
    if len(swa) != cfg.n_layers:
        raise UnsupportedModel(f"attention.sliding_window_pattern has {len(swa)} flags for {cfg.n_layers} layers")
    return dict(sliding_window=window, layer_windows=tuple(window if s else 0 for s in swa), attention_sinks=True)


def _longrope_attn_factor(a: Meta, context: int) -> float:
    if a("rope.scaling.attn_factor"):
        return float(a("rope.scaling.attn_factor"))
    original = int(a("rope.scaling.original_context_length", context))
    factor = context / original
    return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(original))


# -- the record -------------------------------------------------------------------------------
# Tensors every family of the Llama layer lists (layer 0 stands for every layer).
_LLAMA_TENSORS = ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.attn_output.weight",
                  "blk.0.ffn_down.weight", "blk.0.ffn_up.weight")
_GATE = ("blk.0.ffn_gate.weight",)
_SPLIT_QKV = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")  # unless the file fuses them (attn_qkv)
_QK_NORM = ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight")
_POST_NORMS = ("blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight")

# Hugging Face names of the Llama layer's tensors, under their GGUF names.
_LLAMA_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_HF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}
# config.json keys of the ModelConfig fields (transformers' Llama-style names)
_LLAMA_HF_KEYS = {"n_layers": "num_hidden_layers", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                  "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "context_length": "max_position_embeddings",
                  "eps": "rms_norm_eps"}


@dataclass(frozen=True)
class Family:
    """One architecture, everything edgepipe reads or builds differently for it.

    The graph flags (``rope`` .. ``biases``) become ``ModelConfig`` fields, which is what the
    unit graphs are built from; ``configure`` reads what only this family's metadata says."""

    name: str  # GGUF general.architecture; ModelConfig.architecture
    gguf: bool = True  # importable from a GGUF (False: only from a Hugging Face folder)
    refused: str | None = None  # a known architecture edgepipe cannot build: what is missing, in a few words
    # -- metadata and tensors --
    eps_key: str = "attention.layer_norm_rms_epsilon"  # the norm's epsilon, "{arch}.<eps_key>"
    required: tuple[str, ...] = _LLAMA_TENSORS + _GATE  # tensors the header must list
    # -- graph flags --
    rope: Literal["interleaved", "neox", "none"] = "neox"  # GGUF q/k layout: llama.cpp permutes "llama" rows to rotate adjacent pairs
    positions: Literal["rope", "learned"] = "rope"  # learned: position_embd added to the token embedding (GPT-2)
    norm: Literal["rms", "layer"] = "rms"  # RMSNorm, or LayerNorm with a bias (GPT-2)
    gated_ffn: bool = True  # act(gate) * up (a fused ffn_up of 2F rows where there is no ffn_gate); False: act(up)
    activation: Literal["silu", "gelu_tanh", "swiglu_oai"] = "silu"
    post_norms: bool = False  # Gemma 2/3: a norm on the attention and MLP outputs before each residual add
    biases: bool = False  # every linear and norm carries a bias (GPT-2; Qwen2's q/k/v biases are read off the file)
    ffn_norm: str = "ffn_norm"  # the FFN's input norm tensor (gpt-oss: "post_attention_norm")
    configure: Callable[["ModelConfig", Meta, Has], dict] | None = None  # ModelConfig changes only this family's metadata makes
    # -- text --
    sentencepiece: Literal["llama", "gemma", "phi3"] = "llama"  # SentencePiece text handling (spaces, prefix space)
    chat: str | None = None  # the ChatFormat of its own a file without a template gets (others by their markers)
    # -- Hugging Face folders --
    hf_classes: tuple[str, ...] = ()  # config.json "architectures" read as this family
    hf_keys: dict = field(default_factory=lambda: dict(_LLAMA_HF_KEYS))
    hf_layer: dict = field(default_factory=lambda: dict(_LLAMA_HF_LAYER))  # GGUF name after "blk.N." -> HF name after the layer prefix
    hf_global: dict = field(default_factory=lambda: dict(_LLAMA_HF_GLOBAL))
    hf_layer_prefix: str = "model.layers."
    hf_conv1d: bool = False  # weights stored [in, out] (GPT-2's Conv1D): transposed on read

    def required_tensors(self, tensors) -> list[str]:
        """The tensors a file of this family must hold, given the names it does hold."""
        names = list(self.required)
        if "blk.0.attn_qkv.weight" not in names and "blk.0.attn_qkv.weight" not in tensors:
            names += _SPLIT_QKV
        return names

    def graph_flags(self) -> dict:
        """The ModelConfig fields this family fixes, whatever the file says."""
        flags = dict(rope_interleaved=self.rope == "interleaved", ffn_activation=self.activation, post_norms=self.post_norms)
        if self.positions == "learned":
            flags["learned_positions"] = True
        if self.norm != "rms":
            flags["norm"] = self.norm
        if not self.gated_ffn:
            flags["gated_ffn"] = False
        if self.biases:
            flags["biases"] = True
        return flags


# GPT-2's Hugging Face checkpoint (transformers' GPT2LMHeadModel), under GGUF names.
_GPT2_HF_LAYER = {
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
}
_GPT2_HF_GLOBAL = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                   "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
                   "output.weight": "lm_head.weight"}
_GPT2_HF_KEYS = {"n_layers": "n_layer", "hidden_size": "n_embd", "intermediate_size": "n_inner", "n_heads": "n_head",
                 "n_kv_heads": "n_head", "context_length": "n_positions", "eps": "layer_norm_epsilon"}
_GPT2_TENSORS = tuple(["token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"] + [
    f"blk.0.{t}.{p}" for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down") for p in ("weight", "bias")])

_GEMMA = dict(activation="gelu_tanh", post_norms=True, sentencepiece="gemma")

# gpt-oss's tensors (llama_model_openai_moe::load_arch_tensors): biases on q/k/v/o, the router and
# the experts, a sink per head, the FFN's norm named post_attention_norm, an untied head.
_GPT_OSS_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight", "blk.0.attn_norm.weight",
                    "blk.0.attn_output.weight", "blk.0.attn_output.bias", "blk.0.attn_q.bias", "blk.0.attn_k.bias",
                    "blk.0.attn_v.bias", "blk.0.attn_sinks.weight", "blk.0.post_attention_norm.weight",
                    "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias",
                    "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias")

# Every architecture edgepipe knows, each checked against a reference (tests/test_families.py:
# Hugging Face transformers token for token; tests/test_gpt2.py for gpt2). Mistral 7B / Llama 2 /
# TinyLlama GGUFs say "llama" (with a SentencePiece vocabulary): gguf has no "mistral"
# architecture ("mistral" is read from HF folders). Granite was written but transformers cannot
# read a granite GGUF to check it: folders only.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", rope="interleaved", chat="inst", hf_classes=("LlamaForCausalLM",)),
    Family("mistral", gguf=False, rope="interleaved", chat="inst", configure=_mistral, hf_classes=("MistralForCausalLM",)),
    Family("granite", gguf=False, rope="interleaved", hf_classes=("GraniteForCausalLM",)),
    Family("qwen2", hf_classes=("Qwen2ForCausalLM",)),
    Family("qwen3", required=_LLAMA_TENSORS + _GATE + _QK_NORM, hf_classes=("Qwen3ForCausalLM",)),
    Family("qwen3moe", required=_LLAMA_TENSORS + _GATE + _QK_NORM),  # Qwen3's layer, a MoE FFN (model/moe.py; tests/test_moe_qwen3.py)
    Family("gpt-oss", required=_GPT_OSS_TENSORS, configure=_gpt_oss, activation="swiglu_oai", ffn_norm="post_attention_norm"),
    Family("gemma2", required=_LLAMA_TENSORS + _GATE + _POST_NORMS, configure=_sliding(2, softcaps=True), **_GEMMA),
    Family("gemma3", required=_LLAMA_TENSORS + _GATE + _POST_NORMS + _QK_NORM, configure=_sliding(6, softcaps=False), **_GEMMA),
    Family("phi3", required=_LLAMA_TENSORS, configure=_phi3, sentencepiece="phi3", chat="phi3"),  # fused qkv and gate-up
    Family("gpt2", eps_key="attention.layer_norm_epsilon", required=_GPT2_TENSORS, rope="none", positions="learned",
           norm="layer", gated_ffn=False, activation="gelu_tanh", biases=True,
           hf_classes=("GPT2LMHeadModel",), hf_keys=_GPT2_HF_KEYS, hf_layer=_GPT2_HF_LAYER, hf_global=_GPT2_HF_GLOBAL,
           hf_layer_prefix="transformer.h.", hf_conv1d=True),
    # Known and refused, naming what edgepipe lacks for them:
    Family("deepseek2", refused="multi-head latent attention (MLA: low-rank compressed keys and values) is not supported"),
    Family("mamba", refused="state-space (Mamba) layers are not supported: edgepipe's layers are attention layers"),
)}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(f.name for f in FAMILIES.values() if f.gguf and not f.refused)
HF_CLASSES: dict[str, Family] = {c: f for f in FAMILIES.values() if not f.refused for c in f.hf_classes}


def family(name: str | None) -> Family | None:
    """The record of architecture ``name`` (refused ones included), None when unknown."""
    return FAMILIES.get(name or "")


def refusal(name: str | None) -> str | None:
    """Why a GGUF of architecture ``name`` cannot be built, in one line; None when it can."""
    fam = family(name)
    if fam is not None and fam.refused:
        return f"architecture {name!r}: {fam.refused}"
    if fam is None or not fam.gguf:
        return f"architecture {name!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    return None


def family_config(cfg: "ModelConfig", a: Meta, has: Has) -> "ModelConfig":
    """``cfg`` with the family's layer structure filled in from the metadata ``a``."""
    from .config import UnsupportedModel

    fam = FAMILIES[cfg.architecture]
    changes: dict = fam.graph_flags()
    scaling = a("rope.scaling.type")
    if scaling == "linear" and a("rope.scaling.factor"):
        changes["rope_linear_factor"] = float(a("rope.scaling.factor"))
    if scaling == "yarn" and float(a("rope.scaling.factor", 1.0) or 1.0) > 1.0:
        if a("rope.scaling.yarn_log_multiplier"):
            raise UnsupportedModel("YaRN with rope.scaling.yarn_log_multiplier is not supported")
        changes.update(rope_yarn_factor=float(a("rope.scaling.factor")),
                       rope_original_context=int(a("rope.scaling.original_context_length", cfg.context_length)),
                       rope_attn_factor=float(a("rope.scaling.attn_factor", 1.0) or 1.0),
                       rope_yarn_beta_fast=float(a("rope.scaling.yarn_beta_fast", 32.0)),
                       rope_yarn_beta_slow=float(a("rope.scaling.yarn_beta_slow", 1.0)))
    if a("rope.dimension_count") and int(a("rope.dimension_count")) != cfg.head_dim:
        changes["rotary_dim"] = int(a("rope.dimension_count"))
    if fam.configure is not None:
        changes.update(fam.configure(cfg, a, has))
    out = dataclasses.replace(cfg, **changes)
    if not out.learned_positions and (out.rotary_dim or out.head_dim) % 16:
        raise UnsupportedModel(f"a rotary width of {out.rotary_dim or out.head_dim} is not supported (ONNX Runtime's "
                               "GroupQueryAttention needs a multiple of 16)")
    return out


def inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def rope_tables(cfg: "ModelConfig", max_positions: int, factors: np.ndarray | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """cos/sin caches ``[max_positions, rotary_dim / 2]`` per layer kind: "global" and, where
    sliding-window layers have their own base, "local". ``factors`` divide the frequencies
    (llama-3.1's rope_freqs, Phi-3's LongRoPE short or long factors)."""
    dim = cfg.rotary_dim or cfg.head_dim
    positions = np.arange(max_positions, dtype=np.float64)[:, None]

    def table(theta: float, linear: float, freq_factors) -> tuple[np.ndarray, np.ndarray]:
        f = inv_freq(theta, dim) / linear
        if freq_factors is not None:
            f = f / np.asarray(freq_factors, np.float64).reshape(-1)
        scale = cfg.rope_attn_factor
        if cfg.rope_yarn_factor:
            f, scale = yarn_frequencies(f, theta, dim, cfg)
        angles = positions * f[None, :]
        return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)

    tables = {"global": table(cfg.rope_theta, cfg.rope_linear_factor, factors)}
    if cfg.rope_theta_local is not None:
        tables["local"] = table(cfg.rope_theta_local, 1.0, None)
    return tables


def yarn_frequencies(extrapolated: np.ndarray, theta: float, dim: int, cfg: "ModelConfig") -> tuple[np.ndarray, float]:
    """YaRN as ggml's ``rope_yarn`` computes it (ext_factor 1): per rotated pair ``i``, the
    frequency ``f / factor`` (interpolated) mixed with ``f`` (extrapolated) by a ramp that is 1
    below pair ``low`` and 0 above ``high`` (``ggml_rope_yarn_corr_dims`` at beta_fast and
    beta_slow of the original context), and cos/sin scaled by ``attn_factor * (1 + 0.1 ln factor)``."""
    factor, original = cfg.rope_yarn_factor, cfg.rope_original_context or cfg.context_length

    def corr_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(0.0, math.floor(corr_dim(cfg.rope_yarn_beta_fast)))
    high = min(dim - 1.0, math.ceil(corr_dim(cfg.rope_yarn_beta_slow)))
    pair = np.arange(len(extrapolated), dtype=np.float64)
    ramp = 1.0 - np.clip((pair - low) / max(0.001, high - low), 0.0, 1.0)
    mixed = extrapolated / factor * (1.0 - ramp) + extrapolated * ramp
    return mixed, cfg.rope_attn_factor * (1.0 + 0.1 * math.log(factor))


def rope_factor_tensor(cfg: "ModelConfig", max_context: int, has: Has) -> str | None:
    """Which GGUF tensor holds the frequency factors for a package of ``max_context`` tokens."""
    if has("rope_freqs.weight"):
        return "rope_freqs.weight"
    if has("rope_factors_long.weight"):  # llama.cpp: long factors once the context passes the original one
        long = bool(cfg.rope_original_context) and max_context > cfg.rope_original_context
        return "rope_factors_long.weight" if long or not has("rope_factors_short.weight") else "rope_factors_short.weight"
    return None


def default_chat_template(architecture: str, tokens: list[str]) -> str | None:
    """The family's chat format, for files that carry no ``tokenizer.chat_template``."""
    vocab = set(tokens)
    fam = family(architecture)
    own = fam.chat if fam is not None else None
    for fmt in CHAT_FORMATS:
        if not all(m in vocab for m in fmt.markers):
            continue
        if fmt.name == own or (fmt.any_family is not None and all(m in vocab for m in fmt.any_family)):
            return fmt.template
    return None


def end_of_turn_ids(tokens: list[str], template: str | None) -> set[int]:
    """Ids of the end-of-turn markers this vocabulary has and its template writes (or, for
    files without a template, every known marker the vocabulary has)."""
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN}
    return {i for t, i in index.items() if template is None or t in template or t == "<|endoftext|>"}
