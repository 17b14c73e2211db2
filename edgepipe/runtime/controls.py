"""Per-step logit controls and log-probabilities of a sequence (pure; coordinator and local runner).

What the head graph gets per sequence per step (see ``graphs.head_unit``), built here from the
request and the tokens so far, and sent sparse (``stage_runner.RowControls`` makes it dense on
the last stage):

- ``adjust_ids`` / ``adjust``: one value per token id, ``logit_bias`` plus OpenAI's penalties
  ``-(presence * (count > 0) + frequency * count)`` over the tokens generated so far;
- ``repeat_ids`` / ``repeat_penalty``: llama.cpp's repeat penalty, the distinct ids among the
  last ``repeat_last_n`` tokens (prompt and output) and the factor; the head divides their
  positive logits by it and multiplies their negative ones (before ``adjust``), as Ollama does;
- ``mask``: the allowed-token bitmask from ``SequenceState.token_mask`` (``ceil(V/8)`` bytes,
  little bit order: token ``i`` is bit ``i % 8`` of byte ``i // 8``), disallowed = -inf;
- ``top``: how many alternatives to return; ``logprobs``: return the chosen token's logprob;
- ``targets``: on the first step (the prompt's prefill) of an ``echo`` request, each prompt
  position's next prompt token, whose logprobs come back from the same prefill.

Constrained decoding (the entry point for structured output): set ``state.token_mask`` to a
callable ``(generated_ids: list[int]) -> np.ndarray | bytes | None`` on a ``SequenceState`` from
``Coordinator.new_sequence`` before streaming it. It is called before every step with the ids
generated so far (again with the same list when a step is retried after a pipeline change, so it
must not consume a token twice) and returns the next token's allowed set: packed ``uint8``
(``np.packbits(allowed, bitorder="little")``, or llguidance's int32 bitmask ``.view(np.uint8)``;
bytes past ``ceil(V/8)`` are dropped, missing ones disallow) or a bool array ``[V]``; None = no
constraint this step. A mask that allows nothing fails the request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .sequence import GenerationParams, SequenceState, uniform_draw

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token, its logprob (raw model logits), the best alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def adjustment(state: SequenceState) -> tuple[list[int], list[float]]:
    """Sparse ``(ids, values)`` added to the next step's logits: logit_bias and penalties."""
    p = state.params
    values: dict[int, float] = {}
    for token, bias in p.logit_bias:
        values[token] = values.get(token, 0.0) + float(bias)
    if p.presence_penalty or p.frequency_penalty:
        for token, count in Counter(state.generated).items():
            values[token] = values.get(token, 0.0) - (p.presence_penalty + p.frequency_penalty * count)
    ids = sorted(t for t, v in values.items() if v != 0.0)
    return ids, [values[t] for t in ids]


def repeat_window(state: SequenceState) -> list[int]:
    """The distinct ids the repeat penalty applies to next step (empty when it is off)."""
    p = state.params
    if p.repeat_penalty == 1.0 or p.repeat_last_n == 0:
        return []
    tokens = list(state.prompt_ids) + list(state.generated)
    return sorted(set(tokens if p.repeat_last_n < 0 else tokens[-p.repeat_last_n:]))


def packed_mask(mask, vocab: int) -> bytes:
    """A provider's mask as exactly ``ceil(V/8)`` bytes (bits past V cleared); ValueError if it allows nothing."""
    arr = np.asarray(mask) if not isinstance(mask, (bytes, bytearray)) else np.frombuffer(mask, np.uint8)
    if arr.dtype == bool:
        if arr.shape != (vocab,):
            raise ValueError(f"a bool token mask must have {vocab} entries, got {arr.shape}")
        arr = np.packbits(arr, bitorder="little")
    arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    size = (vocab + 7) // 8
    out = np.zeros(size, np.uint8)
    out[: min(size, arr.size)] = arr[:size]
    if vocab % 8:
        out[-1] &= (1 << (vocab % 8)) - 1
    if not out.any():
        raise ValueError("the token mask allows no token")
    return out.tobytes()


def wire_sampling(params: GenerationParams, step: int) -> dict:
    """A step's ``sampling`` entry as it travels to the head (before the controls of ``step_fields``)."""
    out = {"do_sample": not params.greedy, "temperature": params.temperature or 1.0, "top_k": params.top_k,
           "top_p": params.top_p, "uniform": uniform_draw(params.seed, step) if not params.greedy else 0.0}
    if params.min_p and not params.greedy:  # absent: 0 (heads and workers before min_p read no such field)
        out["min_p"] = params.min_p
    return out


def fed_uniforms(params: GenerationParams, step: int, ahead: int) -> list[float]:
    """The draws of the ``ahead`` steps after ``step`` that a stage may feed itself (the direct
    token path: the entry's ``uniforms``; each is the ``uniform`` ``wire_sampling`` would send); empty if greedy."""
    return [] if params.greedy else [uniform_draw(params.seed, step + 1 + i) for i in range(ahead)]


def step_fields(state: SequenceState, vocab: int, prefill: bool) -> dict:
    """The ``sampling`` fields this step adds for the head (empty for a plain request)."""
    p, out = state.params, {}
    ids, values = adjustment(state)
    if ids:
        out["adjust_ids"], out["adjust"] = ids, values
    repeat = repeat_window(state)
    if repeat:
        out["repeat_ids"], out["repeat_penalty"] = repeat, p.repeat_penalty
    if state.token_mask is not None:
        mask = state.token_mask(list(state.generated))
        if mask is not None:
            out["mask"] = packed_mask(mask, vocab)
    if p.logprobs or p.top_logprobs:
        out["logprobs"] = True
        if p.top_logprobs:
            out["top"] = p.top_logprobs
    if p.prompt_logprobs and prefill and not state.generated:
        out["targets"] = state.prompt_ids[1:] + [0]  # the last position's target is unused
        out["logprobs"], out["top"] = True, p.top_logprobs
    return out


def from_wire(token: int, entry: dict | None, top: int) -> TokenLogprob | None:
    """The TOKEN frame's logprobs entry of one sequence as a TokenLogprob."""
    if entry is None:
        return None
    return TokenLogprob(token, float(entry["logprob"]), tuple(zip(entry["top_ids"][:top], entry["top_logprobs"][:top])))


def prompt_from_wire(prompt_ids: list[int], entry: dict | None, top: int) -> list[TokenLogprob | None] | None:
    """Per prompt id its logprob given the ids before it (None for the first), from a prefill's entry."""
    if entry is None or "prompt" not in entry:
        return None
    lps, top_ids, top_lps = entry["prompt"]
    out: list[TokenLogprob | None] = [None]
    for i, token in enumerate(prompt_ids[1:]):
        out.append(TokenLogprob(token, float(lps[i]), tuple(zip(top_ids[i][:top], top_lps[i][:top]))))
    return out
