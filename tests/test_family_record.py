"""The Family registry (``families.FAMILIES``): pure lookups, no model."""

from __future__ import annotations

import pytest

from edgepipe.model import families
from edgepipe.model.config import SUPPORTED_ARCHITECTURES
from edgepipe.model.families import FAMILIES, HF_CLASSES, default_chat_template, family, refusal

pytestmark = pytest.mark.pure


def test_supported_are_the_gguf_records_that_are_not_refused():
    assert SUPPORTED_ARCHITECTURES == ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss", "gemma2", "gemma3", "phi3", "gpt2")
    assert all(refusal(a) is None for a in SUPPORTED_ARCHITECTURES)
    assert "mistral" not in SUPPORTED_ARCHITECTURES and HF_CLASSES["MistralForCausalLM"].name == "mistral"  # folders only
    assert HF_CLASSES["GPT2LMHeadModel"] is FAMILIES["gpt2"]


@pytest.mark.parametrize("arch, words", [
    ("deepseek2", "architecture 'deepseek2': multi-head latent attention (MLA"),
    ("bert", "architecture 'bert' is not supported (supported: llama,"),
    ("granite", "architecture 'granite' is not supported"),  # folders only: transformers cannot check its GGUF
    (None, "architecture None is not supported"),
])
def test_refusal_says_what_is_missing(arch, words):
    assert refusal(arch).startswith(words)


def test_required_tensors_follow_the_file():
    llama = family("llama")
    assert "blk.0.attn_q.weight" in llama.required_tensors({"token_embd.weight": 1})
    assert "blk.0.attn_q.weight" not in llama.required_tensors({"blk.0.attn_qkv.weight": 1})  # a fused file
    gpt2 = family("gpt2").required_tensors({})
    assert {"position_embd.weight", "blk.0.attn_qkv.bias", "output_norm.bias"} <= set(gpt2) and "blk.0.attn_q.weight" not in gpt2


def test_graph_flags():
    assert family("gpt2").graph_flags() == dict(rope_interleaved=False, ffn_activation="gelu_tanh", post_norms=False,
                                                 learned_positions=True, norm="layer", gated_ffn=False, biases=True)
    assert family("llama").graph_flags() == dict(rope_interleaved=True, ffn_activation="silu", post_norms=False)


GEMMA, PHI3, LLAMA3, CHATML, INST = (f.template for f in families.CHAT_FORMATS)


@pytest.mark.parametrize("arch, vocab, template", [
    ("qwen2", ["<start_of_turn>", "<end_of_turn>"], GEMMA),  # by its markers, any family
    ("phi3", ["<|end|>", "<|im_start|>", "<|im_end|>"], PHI3),  # the family's own first
    ("llama", ["<|end|>", "<|im_start|>", "<|im_end|>"], CHATML),  # <|end|> alone is Phi-3's, for Phi-3 only
    ("llama", ["<|start_header_id|>", "<|eot_id|>", "</s>"], LLAMA3),
    ("llama", ["</s>"], INST), ("mistral", ["</s>"], INST), ("qwen2", ["</s>"], None), ("qwen2", ["[INST]", "</s>"], INST),
    ("llama", ["[INST]"], None), ("gpt2", ["<|endoftext|>"], None),
])
def test_default_chat_template(arch, vocab, template):
    assert default_chat_template(arch, vocab) == template
