"""What each model family adds to the Llama layer, read from GGUF metadata as llama.cpp reads it.

Pure functions: a base :class:`ModelConfig` plus the file's metadata in, the family's config
out; RoPE tables per layer kind; the chat template and end-of-turn tokens a family uses when
the file carries none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from .config import ModelConfig, UnsupportedModel

Meta = Callable[..., object]  # a("attention.sliding_window", default) reads "{arch}.attention.sliding_window"

# Gemma 2 / 3 layer schedule: a sliding-window layer unless (layer + 1) % pattern == 0.
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}


def family_config(cfg: ModelConfig, a: Meta, has: Callable[[str], bool]) -> ModelConfig:
    """``cfg`` with the family's layer structure filled in from the metadata ``a``."""
    arch = cfg.architecture
    changes: dict = {}
    scaling = a("rope.scaling.type")
    if scaling == "linear" and a("rope.scaling.factor"):
        changes["rope_linear_factor"] = float(a("rope.scaling.factor"))
    if a("rope.dimension_count") and int(a("rope.dimension_count")) != cfg.head_dim:
        changes["rotary_dim"] = int(a("rope.dimension_count"))
    if arch in _SLIDING_PATTERN:
        H = cfg.hidden_size
        window = int(a("attention.sliding_window", 4096))
        pattern = _SLIDING_PATTERN[arch]
        big = (arch == "gemma2" and cfg.n_layers == 46) or (arch == "gemma3" and cfg.n_layers == 62)  # the 27B models
        changes.update(
            ffn_activation="gelu_tanh", post_norms=True, rope_interleaved=False,
            embedding_scale=float(np.float32(math.sqrt(H))),
            attention_scale=1.0 / math.sqrt(H / cfg.n_heads if big else cfg.head_dim),
            sliding_window=window,
            layer_windows=tuple(window if (i + 1) % pattern else 0 for i in range(cfg.n_layers)),
        )
        if arch == "gemma2":
            changes["attn_logit_softcap"] = float(a("attn_logit_softcapping", 50.0))
            changes["final_logit_softcap"] = float(a("final_logit_softcapping", 30.0))
        else:
            changes["rope_theta_local"] = float(a("rope.freq_base_swa", 10000.0))
    elif arch == "phi3":
        changes["rope_interleaved"] = False
        if has("rope_factors_long.weight"):
            changes["rope_attn_factor"] = _longrope_attn_factor(a, cfg.context_length)
            changes["rope_original_context"] = int(a("rope.scaling.original_context_length", cfg.context_length))
    elif arch == "mistral" and a("attention.sliding_window"):
        window = int(a("attention.sliding_window"))
        changes.update(sliding_window=window, layer_windows=(window,) * cfg.n_layers)
    out = dataclasses.replace(cfg, **changes)
    if (out.rotary_dim or out.head_dim) % 16:
        raise UnsupportedModel(f"a rotary width of {out.rotary_dim or out.head_dim} is not supported (ONNX Runtime's "
                               "GroupQueryAttention needs a multiple of 16)")
    return out


def _longrope_attn_factor(a: Meta, context: int) -> float:
    if a("rope.scaling.attn_factor"):
        return float(a("rope.scaling.attn_factor"))
    original = int(a("rope.scaling.original_context_length", context))
    factor = context / original
    return 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(original))


def inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def rope_tables(cfg: ModelConfig, max_positions: int, factors: np.ndarray | None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """cos/sin caches ``[max_positions, rotary_dim / 2]`` per layer kind: "global" and, where
    sliding-window layers have their own base, "local". ``factors`` divide the frequencies
    (llama-3.1's rope_freqs, Phi-3's LongRoPE short or long factors)."""
    dim = cfg.rotary_dim or cfg.head_dim
    positions = np.arange(max_positions, dtype=np.float64)[:, None]

    def table(theta: float, linear: float, freq_factors) -> tuple[np.ndarray, np.ndarray]:
        f = inv_freq(theta, dim) / linear
        if freq_factors is not None:
            f = f / np.asarray(freq_factors, np.float64).reshape(-1)
        angles = positions * f[None, :]
        return (np.cos(angles) * cfg.rope_attn_factor).astype(np.float32), (np.sin(angles) * cfg.rope_attn_factor).astype(np.float32)

    tables = {"global": table(cfg.rope_theta, cfg.rope_linear_factor, factors)}
    if cfg.rope_theta_local is not None:
        tables["local"] = table(cfg.rope_theta_local, 1.0, None)
    return tables


def rope_factor_tensor(cfg: ModelConfig, max_context: int, has: Callable[[str], bool]) -> str | None:
    """Which GGUF tensor holds the frequency factors for a package of ``max_context`` tokens."""
    if has("rope_freqs.weight"):
        return "rope_freqs.weight"
    if has("rope_factors_long.weight"):  # llama.cpp: long factors once the context passes the original one
        long = bool(cfg.rope_original_context) and max_context > cfg.rope_original_context
        return "rope_factors_long.weight" if long or not has("rope_factors_short.weight") else "rope_factors_short.weight"
    return None


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

# Tokens that end an assistant turn, in the templates above and in the families' own templates.
END_OF_TURN = ("<end_of_turn>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>")


def default_chat_template(architecture: str, tokens: list[str]) -> str | None:
    """The family's chat format, for files that carry no ``tokenizer.chat_template``."""
    vocab = set(tokens)
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return _GEMMA_TEMPLATE
    if architecture == "phi3" and "<|end|>" in vocab:
        return _PHI3_TEMPLATE
    if "<|start_header_id|>" in vocab and "<|eot_id|>" in vocab:
        return _LLAMA3_TEMPLATE
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        return _CHATML_TEMPLATE
    if "[INST]" in vocab or architecture in ("llama", "mistral"):
        return _INST_TEMPLATE if "</s>" in vocab else None
    return None


def end_of_turn_ids(tokens: list[str], template: str | None) -> set[int]:
    """Ids of the end-of-turn markers this vocabulary has and its template writes (or, for
    files without a template, every known marker the vocabulary has)."""
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN}
    return {i for t, i in index.items() if template is None or t in template or t == "<|endoftext|>"}
