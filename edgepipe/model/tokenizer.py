"""Tokenizer and chat template, rebuilt from GGUF metadata with the ``tokenizers`` package.

Only the coordinator tokenizes; workers see token ids and activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

from .config import UnsupportedModel

# The pre-tokenizer regexes llama.cpp names by ``tokenizer.ggml.pre``.
_SPLIT_REGEX = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# o200k (gpt-oss, GPT-4o): llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O
_SPLIT_REGEX["gpt-4o"] = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))
_SPLIT_REGEX["llama3"] = _SPLIT_REGEX["llama-bpe"]
_SPLIT_REGEX["smaug-bpe"] = _SPLIT_REGEX["llama-bpe"]
_SPLIT_REGEX["deepseek-r1-qwen"] = _SPLIT_REGEX["qwen2"]

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that must never be split
SUPPORTED_TOKENIZERS: tuple[str, ...] = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE


def _sentencepiece_style(architecture: str) -> str:
    """How a family's SentencePiece vocabulary handles text (``Family.sentencepiece``): Llama 2's
    Metaspace with a prefix space, Gemma's spaces kept as spaces, or Phi-3's."""
    from .families import family

    fam = family(architecture)
    return fam.sentencepiece if fam is not None else "llama"


def tokenizer_json_from_gguf(data, architecture: str = "") -> str:
    """A ``tokenizer.json`` equivalent to the GGUF's vocabulary: byte-level BPE ("gpt2") or
    SentencePiece BPE with byte fallback ("llama"), each as Hugging Face reads the same file."""
    if data.model == "gpt2":
        return _byte_level(data)
    if data.model == "llama":
        return _sentencepiece(data, architecture)
    raise UnsupportedModel(
        f"tokenizer model {data.model!r} is not supported (supported: {', '.join(SUPPORTED_TOKENIZERS)})"
    )


def _byte_level(data) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    if data.pre in _SPLIT_REGEX:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX[data.pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif data.pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = data.token_types or [1] * len(data.tokens)
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(data.tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens(specials)
    return tok.to_str()


def _sentencepiece(data, architecture: str) -> str:
    """BPE over ``▁``-spaced pieces with ``<0xXX>`` byte fallback; merges from the file or, as
    llama.cpp ranks them, from the pieces' scores (Gemma: from the file order)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = list(data.tokens)
    style = _sentencepiece_style(architecture)
    if style == "gemma":  # runs of spaces are stored as spaces, looked up as ``▁``
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = data.scores or [-float(i) for i in range(len(tokens))]
        ranks = dict(zip(tokens, scores))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges] if data.merges else merges_from_ranks(vocab, ranks)
    unk = tokens[data.unk_id] if style == "gemma" and getattr(data, "unk_id", None) is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if style == "gemma":
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    elif style == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    types = data.token_types or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok.to_str()


def merges_from_ranks(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-ranked result first."""
    found = []
    for piece, rank in ranks.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


@dataclass
class TextTokenizer:
    """Encode, decode and format chats for one package."""

    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None
    eos_ids: tuple[int, ...]
    bos_id: int | None
    add_bos: bool

    @classmethod
    def from_json(cls, text: str, chat_template: str | None, eos_ids, bos_id, add_bos) -> "TextTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text), chat_template, tuple(eos_ids), bos_id, add_bos)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def format_chat(self, messages: list[dict]) -> str:
        """Render messages with the model's own template (Jinja2, sandboxed)."""
        if not self.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")
