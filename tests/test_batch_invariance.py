"""Batch invariance (``serve --batch-invariant``): a sequence decoded alone, or batched with
others, gets the same greedy tokens.

MLAS runs one-row 4-bit MatMulNBits calls with a kernel of their own whose sums differ in the
last bits; an invariant stage runner never issues one (a lone step takes a bystander row along),
so lanes and the single-process reference agree token for token whatever the batching."""

from __future__ import annotations

import numpy as np

from edgepipe.runtime.stage_runner import SamplingBatch

PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Write one line about the sea.", "Say hi."]


def test_batched_decode_equals_solo_decode(int4_pkg):
    pipe, tok = int4_pkg.pipeline(batch_invariant=True), int4_pkg.tokenizer
    ids = [tok.encode(tok.format_chat([{"role": "user", "content": p}])) for p in PROMPTS]

    def solo(i: int, n: int) -> list[int]:
        out, feed = [], ids[i]
        for _ in range(n):
            out.append(pipe.step(f"solo{i}", feed, SamplingBatch.greedy(1)))
            feed = out[-1:]
        pipe.drop(f"solo{i}")
        return out

    expected = [solo(i, 24) for i in range(len(PROMPTS))]
    seqs = [f"b{i}" for i in range(len(PROMPTS))]
    got = [[pipe.step(s, ids[i], SamplingBatch.greedy(1))] for i, s in enumerate(seqs)]
    for _ in range(23):
        x = np.array([[g[-1]] for g in got], np.int64)
        for runner in pipe.runners:
            x = runner.run_batch(seqs, x, SamplingBatch.greedy(len(seqs)) if runner.emits_tokens else None)
        for g, t in zip(got, x):
            g.append(int(t))
    for prompt, e, g in zip(PROMPTS, expected, got):
        assert g == e, prompt


def test_spin_only_when_the_cores_are_free(monkeypatch):
    """Pool threads spin between ops only with 2+ threads on a machine with most cores free."""
    import os
    import threading

    from edgepipe.runtime import stage_runner

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(stage_runner, "busy_cores", lambda: 0.5)
    assert stage_runner.spin_by_default(2) and stage_runner.spin_by_default(None) and not stage_runner.spin_by_default(1)
    monkeypatch.setattr(stage_runner, "busy_cores", lambda: 2.0)
    assert not stage_runner.spin_by_default(2)
    monkeypatch.undo()
    stop = threading.Event()

    def spin() -> None:  # one busy core
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        assert stage_runner.busy_cores(0.3, reuse_s=0) >= 0.7
    finally:
        stop.set()
        spinner.join()
