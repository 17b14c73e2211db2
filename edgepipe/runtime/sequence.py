"""What one request is: its parameters, its tokens so far, and when it stops.

Pure logic shared by the single-process generator and the coordinator's scheduler: turning
sampled ids into streamed text (holding back bytes of an unfinished character and any tail
that could still become a stop string), the stop rules, and the per-step random draw that
makes a seeded request reproducible on any pipeline and across recoveries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy (the API routes default to api.generation.SAMPLING_DEFAULTS)
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    min_p: float = 0.0  # keep tokens at least this times as likely as the best (0 = off)
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # Logit controls and logprobs (applied in the head graph, see runtime.controls):
    presence_penalty: float = 0.0  # OpenAI: logit -= presence * (count > 0) + frequency * count,
    frequency_penalty: float = 0.0  # counts of the tokens this sequence generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit
    logprobs: bool = False  # return each sampled token's logprob
    top_logprobs: int = 0  # and its N best alternatives (0..20)
    prompt_logprobs: bool = False  # and the prompt's (echo): position i's logprob of token i + 1
    # llama.cpp's / Ollama's repeat penalty, multiplicative: each id among the last repeat_last_n
    # tokens (prompt and output; -1 = all, 0 = none) has its logit divided by it when positive,
    # multiplied when negative. 1.0 = off.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if any(not -100 <= v <= 100 for _, v in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not (0 < self.repeat_penalty <= 100 and self.repeat_last_n >= -1):
            raise ValueError("repeat_penalty must be in (0, 100] and repeat_last_n >= -1")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def uniform_draw(seed: int, step: int) -> float:
    """The random number for sampling step ``step``: a pure function of (seed, step)."""
    return float(np.random.Generator(np.random.Philox(key=seed & (2**64 - 1), counter=step)).random())


@dataclass
class TextDelta:
    text: str
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass
class SequenceState:
    """Token ids and emitted text of one request; ``push`` each sampled id in order."""

    prompt_ids: list[int]
    params: GenerationParams
    decode: object  # callable list[int] -> str
    eos_ids: tuple[int, ...]
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
    finish_reason: FinishReason | None = None
    # Constrained decoding: called before every step with the ids generated so far (the same list
    # again when a step is retried), returns the allowed-token bitmask of the next token (packed
    # uint8, little bit order, or a bool array [V]) or None (no constraint). See runtime.controls.
    token_mask: object | None = None
    logprobs: list = field(default_factory=list)  # controls.TokenLogprob of each id in ``generated``
    prompt_logprobs: list | None = None  # controls.TokenLogprob | None per prompt id (echo; the first is None)
    # Incremental detokenisation (vLLM's): ``_text`` is the decode of ``generated[:_read]`` up to its
    # last whole character, and ``generated[_prefix:_read]`` the window the next tokens are decoded
    # after, so a push decodes a few ids, not all of them (a decoder that drops the first token's
    # leading space drops it from both decodes of the window alike).
    _text: str = field(default="", init=False, repr=False)
    _prefix: int = field(default=0, init=False, repr=False)
    _read: int = field(default=0, init=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    def push(self, token: int, logprob=None) -> TextDelta:
        """Take the next sampled id (and its ``controls.TokenLogprob`` when asked for)."""
        if self.finished:
            raise RuntimeError("sequence already finished")
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
            return TextDelta(self._flush(self._decoded()), True, "stop")
        self.generated.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        text = self._decoded()
        for stop in self.params.stop:
            at = text.find(stop, max(0, len(self.emitted) - len(stop)))
            if at != -1:
                self.finish_reason = "stop"
                return TextDelta(self._flush(text[:at]), True, "stop")
        if len(self.generated) >= self.params.max_tokens:
            self.finish_reason = "length"
            return TextDelta(self._flush(text), True, "length")
        safe = len(text)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character
            safe = len(text.rstrip("\ufffd"))
        for stop in self.params.stop:  # hold back what may be the start of a stop string
            for k in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - k:safe] == stop[:k]:
                    safe -= k
                    break
        return TextDelta(self._flush(text[: max(safe, len(self.emitted))]), False)

    def _decoded(self) -> str:
        """The decode of every generated id (a trailing unfinished character as U+FFFD), decoding
        only the ids since the last whole character and the window before them."""
        before = self.decode(self.generated[self._prefix:self._read]) if self._read > self._prefix else ""
        window = self.decode(self.generated[self._prefix:])
        tail = window[len(before):]
        if not tail.endswith("\ufffd"):
            self._text += tail
            self._prefix, self._read = self._read, len(self.generated)
            return self._text
        return self._text + tail

    def _flush(self, text: str) -> str:
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta
