"""Speculative decoding's arithmetic (pure): which drafted tokens a verify pass keeps, how many to
draft next, and the two drafters (n-gram lookup; a small model with the same tokenizer).

A verify pass feeds the target ``[t, d1 .. dk]`` (the last token and ``k`` drafts) as one chunk
and gets back, per position ``i``, the token the target chooses after ``t, d1 .. di``. Greedy:
keep drafts while they equal the target's choice, then the target's own token (at the first
mismatch, or the bonus after all ``k``): ``accepted + 1`` tokens per pass, exactly the tokens
one decode step each would give (the stages run ``graphs.verify_form``, whose verify rows are
bit-identical to decode steps). Sampled, in the pipeline: each position samples with the seeded
draw its token would get decoding one step at a time (``uniform_draw(seed, index)``), the drafter
samples with the same draws, and a draft is kept when it equals the target's sample: the output
is then the non-speculative seeded output token for token, so its distribution is the target's
(no distribution crosses the wire; a coupling by common draws keeps fewer drafts than the optimal
one). The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), for a drafter and
target whose distributions are at hand, is :func:`accept_sampled`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy verify pass yields: drafts up to the first one the target disagrees
    with, then the target's token there (``targets`` has ``len(drafts) + 1`` entries)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"a verify pass of {len(drafts)} drafts returns {len(drafts) + 1} tokens, got {len(targets)}")
    out: list[int] = []
    for draft, target in zip(drafts, targets):
        out.append(target)
        if draft != target:
            return out
    out.append(targets[-1])
    return out


def accept_sampled(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """The speculative-sampling rule: draft ``d_i`` (drawn from ``q[i]``) is kept with probability
    ``min(1, p[i][d_i] / q[i][d_i])``; the first one rejected is replaced by a draw from
    ``norm(max(0, p[i] - q[i]))`` and the pass ends; when all ``k`` are kept a bonus token is drawn
    from ``p[k]``. The output is distributed exactly as sampling from ``p`` one token at a time.

    ``q``: ``[k, V]`` the draft's probabilities, ``p``: ``[k + 1, V]`` the target's (both after
    temperature, top-k and top-p)."""
    k = len(drafts)
    if q.shape[0] != k or p.shape[0] != k + 1 or q.shape[1] != p.shape[1]:
        raise ValueError(f"accept_sampled: {k} drafts need q [k, V] and p [k + 1, V], got {q.shape} and {p.shape}")
    out: list[int] = []
    for i, d in enumerate(drafts):
        if q[i, d] <= 0:
            raise ValueError(f"draft {i} (token {d}) has probability 0 under its own distribution")
        if rng.random() * q[i, d] < p[i, d]:  # u < p/q without dividing
            out.append(int(d))
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        out.append(_draw(residual / residual.sum(), rng))
        return out
    out.append(_draw(p[k], rng))
    return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cumulative = np.cumsum(probs)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(probs) - 1))


@dataclass
class DraftLength:
    """How many tokens to draft next, from the acceptance rate seen so far.

    ``rate`` is a moving average of the share of drafts the target kept. With a share ``a`` the
    ``j``-th draft survives with probability ``a ** j``; drafting stops where that falls below
    ``worth`` (a draft that costs compute, a model's, is worth less than a free n-gram one):
    ``k = floor(log(worth) / log(a))``, at most ``k_max``. A pass that keeps every draft lets the
    next one try one more (the average alone would take several passes to get there). Where not
    even the first draft is worth it (``a < worth``) drafting pauses (``k = 0``: plain decode
    steps) and tries ``k_min`` again after ``retry_after`` steps."""

    k_max: int = 8
    k_min: int = 1
    worth: float = 0.25
    smoothing: float = 0.3  # weight of the latest pass in the moving average
    rate: float = 0.6  # a start that drafts a few tokens
    retry_after: int = 16  # decode steps without drafting before trying again
    k: int = field(init=False, default=0)
    paused: int = field(init=False, default=0)  # steps decoded without drafts since drafting paused

    def __post_init__(self) -> None:
        if not (1 <= self.k_min <= self.k_max and 0 < self.worth < 1 and 0 < self.smoothing <= 1 and 0 <= self.rate <= 1
                and self.retry_after >= 1):
            raise ValueError("DraftLength needs 1 <= k_min <= k_max, 0 < worth < 1, 0 < smoothing <= 1, 0 <= rate <= 1, retry_after >= 1")
        self.k = self._from_rate()

    def _from_rate(self) -> int:
        if self.rate >= 1.0:
            return self.k_max
        if self.rate < self.worth:
            return 0
        return max(self.k_min, min(self.k_max, int(math.log(self.worth) / math.log(self.rate))))

    def update(self, drafted: int, kept: int) -> int:
        """Take one step's outcome (``kept`` of ``drafted``; 0 of 0: a step without drafts); returns the next ``k``."""
        if drafted <= 0:
            if self.k == 0:
                self.paused += 1
                if self.paused >= self.retry_after:  # try again: the text may have become predictable
                    self.paused, self.k = 0, self.k_min
            return self.k
        self.rate = (1 - self.smoothing) * self.rate + self.smoothing * (kept / drafted)
        self.k = min(self.k_max, self.k + 1) if kept == drafted and drafted >= self.k else self._from_rate()
        return self.k


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``ids`` (a sequence's prompt and output so far)."""

    name: str

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        """``params`` (``GenerationParams``) of a sampled request: draft ``j`` samples with
        ``uniform_draw(params.seed, step + j)``, the target's draw for that token; None: greedy."""

    def prime(self, seq: str, ids: list[int]) -> None:
        """Take in ``ids`` ahead of the first draft (a prompt, while the target prefills it)."""

    def forget(self, seq: str) -> None: ...


@dataclass
class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens (``n`` from ``max_n`` down to ``min_n``), in its prompt and output. Free to run,
    and right often where the output copies its input (code editing, quoting, refactoring)."""

    max_n: int = 4
    min_n: int = 3  # two tokens repeat all the time in prose (", the"): what follows them rarely does
    name: str = "ngram"

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(ids, np.int64)
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            # every window of n tokens that ends before the last position, compared at once
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence: nearest context
                return [int(t) for t in arr[start:start + k]]
        return []

    def prime(self, seq: str, ids: list[int]) -> None:
        pass

    def forget(self, seq: str) -> None:
        pass


class ModelDrafter:
    """A small model with the target's tokenizer, whole in one stage runner of this process,
    drafting greedily. Keeps each sequence's KV between passes: what the target rejected is
    rewound (``StageRunner.rewind``), what it accepted is fed on the next call."""

    def __init__(self, runner, name: str = "draft"):
        if not (runner.takes_token_ids and runner.emits_tokens):
            raise ValueError("a draft model must run whole in one stage (embedding to head)")
        self.runner = runner
        self.name = name
        self.fed: dict[str, list[int]] = {}  # per sequence: the ids whose KV the runner holds

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        from .sequence import uniform_draw
        from .stage_runner import SamplingBatch

        def sampling(j: int) -> SamplingBatch:
            if params is None or params.greedy:
                return SamplingBatch.greedy(1)
            return SamplingBatch(True, np.array([params.temperature], np.float32), np.array([params.top_k], np.int64),
                                 np.array([params.top_p], np.float32), np.array([uniform_draw(params.seed, step + j)], np.float32))

        if k <= 0 or not ids:
            return []
        held = self.fed.get(seq, [])
        common = _common_prefix(held, ids)
        if common == len(ids):  # nothing new to feed: take back the last one so a step has input
            common -= 1
        self.runner.rewind(seq, common)
        fed = list(ids[:common])
        out: list[int] = []
        feed = ids[common:]
        try:
            for j in range(k):
                token = int(self.runner.run(seq, np.array([feed], np.int64), sampling(j))[0])
                fed += feed
                out.append(token)
                feed = [token]
        finally:
            self.fed[seq] = fed
        return out

    def prime(self, seq: str, ids: list[int]) -> None:
        from .stage_runner import SamplingBatch

        self.forget(seq)
        if ids:
            self.runner.run(seq, np.array([ids], np.int64), SamplingBatch.greedy(1))
            self.fed[seq] = list(ids)

    def forget(self, seq: str) -> None:
        self.fed.pop(seq, None)
        self.runner.drop(seq)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
