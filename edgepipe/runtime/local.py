"""Single-process generation: a chain of stage runners driven by one loop.

This is the reference every distributed run is checked against, and the engine behind
``edgepipe generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import controls
from .sequence import GenerationParams, SequenceState, uniform_draw
from .stage_runner import SamplingBatch, StageRunner


def sampling_for(params: GenerationParams, step: int) -> SamplingBatch:
    if params.greedy:
        return SamplingBatch.greedy(1)
    return SamplingBatch(
        True, np.array([params.temperature], np.float32), np.array([params.top_k], np.int64),
        np.array([params.top_p], np.float32), np.array([uniform_draw(params.seed, step)], np.float32),
        min_p=np.array([params.min_p], np.float32),
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
    logprobs: list = field(default_factory=list)  # controls.TokenLogprob per token, when params ask for them
    prompt_logprobs: list | None = None  # per prompt token (echo: params.prompt_logprobs)

    @property
    def tokens_per_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def generate(pipeline: LocalPipeline, prompt_ids: list[int], params: GenerationParams, decode: Callable[[list[int]], str],
             eos_ids: tuple[int, ...], on_text: Callable[[str], None] | None = None, seq: str = "local",
             token_mask: Callable | None = None) -> GenerationResult:
    """Prefill the prompt, then decode one token at a time until a stop rule fires.

    Logit controls, logprobs and ``token_mask`` (see ``controls``) go through the same wire
    entries and head inputs as on a worker."""
    state = SequenceState(list(prompt_ids), params, decode, eos_ids, token_mask=token_mask)
    head = pipeline.runners[-1]
    sampled: list[int] = []
    t0 = time.perf_counter()
    feed = list(prompt_ids)
    ttft = 0.0
    try:
        while True:
            fields = controls.step_fields(state, head.vocab or 0, len(feed) > 1)
            item = {"seq": seq, "sampling": {**controls.wire_sampling(params, len(sampled)), **fields}}
            sampling = SamplingBatch.from_wire([item], head.vocab) if fields else sampling_for(params, len(sampled))
            token = pipeline.step(seq, feed, sampling)
            entry = head.logprobs_field([item]).get("logprobs", [None])[0]
            if "targets" in fields:
                state.prompt_logprobs = controls.prompt_from_wire(state.prompt_ids, entry, params.top_logprobs)
            if not sampled:
                ttft = time.perf_counter() - t0
            sampled.append(token)
            delta = state.push(token, controls.from_wire(token, entry, params.top_logprobs))
            if on_text and delta.text:
                on_text(delta.text)
            if delta.finished:
                break
            feed = [token]
    finally:
        pipeline.drop(seq)
    total = time.perf_counter() - t0
    return GenerationResult(list(prompt_ids), sampled, state.emitted, state.finish_reason or "stop", ttft, total - ttft,
                            state.logprobs, state.prompt_logprobs)
