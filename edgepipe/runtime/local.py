"""Single-process generation: a chain of stage runners driven by one loop.

This is the reference every distributed run is checked against, and the engine behind
``edgepipe generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .sequence import GenerationParams, SequenceState, uniform_draw
from .stage_runner import SamplingBatch, StageRunner


def sampling_for(params: GenerationParams, step: int) -> SamplingBatch:
    if params.greedy:
        return SamplingBatch.greedy(1)
    return SamplingBatch(
        True, np.array([params.temperature], np.float32), np.array([params.top_k], np.int64),
        np.array([params.top_p], np.float32), np.array([uniform_draw(params.seed, step)], np.float32),
    )


class LocalPipeline:
    """Stage runners in order; the first takes token ids, the last returns one."""

    def __init__(self, runners: list[StageRunner]):
        if not runners[0].takes_token_ids or not runners[-1].emits_tokens:
            raise ValueError("a pipeline must start at the embedding and end at the head")
        self.runners = runners

    def step(self, seq: str, ids: list[int], sampling: SamplingBatch) -> int:
        x: np.ndarray = np.array([ids], np.int64)
        for runner in self.runners:
            x = runner.run(seq, x, sampling if runner.emits_tokens else None)
        return int(x[0])

    def drop(self, seq: str) -> None:
        for runner in self.runners:
            runner.drop(seq)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    ttft_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def generate(pipeline: LocalPipeline, prompt_ids: list[int], params: GenerationParams, decode: Callable[[list[int]], str],
             eos_ids: tuple[int, ...], on_text: Callable[[str], None] | None = None, seq: str = "local") -> GenerationResult:
    """Prefill the prompt, then decode one token at a time until a stop rule fires."""
    state = SequenceState(list(prompt_ids), params, decode, eos_ids)
    sampled: list[int] = []
    t0 = time.perf_counter()
    feed = list(prompt_ids)
    ttft = 0.0
    try:
        while True:
            token = pipeline.step(seq, feed, sampling_for(params, len(sampled)))
            if not sampled:
                ttft = time.perf_counter() - t0
            sampled.append(token)
            delta = state.push(token)
            if on_text and delta.text:
                on_text(delta.text)
            if delta.finished:
                break
            feed = [token]
    finally:
        pipeline.drop(seq)
    total = time.perf_counter() - t0
    return GenerationResult(list(prompt_ids), sampled, state.emitted, state.finish_reason or "stop", ttft, total - ttft)
