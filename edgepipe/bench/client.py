"""Client-side timing shared by the benchmarks."""

from __future__ import annotations

import time

import httpx


def stream_once(client: httpx.Client, tokens: int, prompt: str = "Once upon a time in a small village,") -> tuple[float, float, int]:
    """Stream one fixed-length greedy completion: (time to first chunk, first→last chunk seconds, chunks)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
    return first - t0, last - first, n
