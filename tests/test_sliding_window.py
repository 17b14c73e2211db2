"""Sliding-window layers keep only their window of KV, and stay exact.

A tiny Gemma 3 (5 window layers of 8 tokens : 1 global layer, written as a GGUF in
``test_families``) decodes 40 tokens past a prompt: its window layers hold at most
``window_positions(8)`` positions while the global layer holds them all; the tokens equal the
same runners with trimming switched off, at 1 and 3 stages (cuts between a window and the
global layer, and a stage of window layers only); batched equals solo (batch-invariant runners); and a sequence whose
KV moves mid-generation to runners with other cuts continues with the same tokens.

The tiny random model's greedy tokens hardly move (it repeats one token), so every comparison
is also made on the hidden state entering the head, bit for bit: a cache one position short
changes it (by ~5e-6), which ``test_a_cache_one_position_short_is_caught`` shows.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.model.importer import import_model
from edgepipe.model.package import Package
from edgepipe.runtime import stage_runner
from edgepipe.runtime.stage_runner import SamplingBatch, window_positions, window_start

pytest.importorskip("gguf")
from test_families import PROMPT, write_tiny_gguf  # noqa: E402

WINDOW = 8
N_NEW = 40
HEAD = 7  # unit index of the head: every pipeline here cuts before it, to read the hidden state


@pytest.fixture(scope="module", params=["fp32", "gguf"])  # gguf: the kernel form's KvAttention over an fp16 cache
def gemma3(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("sliding-window")
    path = write_tiny_gguf(root / "gemma3.gguf", "gemma3", seed=11)
    pkg = Package(import_model(path, root / "models", request.param, max_context=256, measure_cost=False))
    assert list(pkg.manifest.config["layer_windows"]) == [WINDOW] * 5 + [0]
    return pkg


def pipeline(pkg, cuts: list[int], batch_invariant: bool = False):
    return pkg.pipeline([*cuts, HEAD], batch_invariant=batch_invariant)


def decode(pipe, seq: str, feed: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the last position's hidden state entering the head, per step."""
    tokens, hidden = [], []
    for _ in range(n):
        x = np.array([feed], np.int64)
        for runner in pipe.runners[:-1]:
            x = runner.run(seq, x)
        hidden.append(x[0, -1].copy())
        tokens.append(int(pipe.runners[-1].run(seq, x)[0]))
        feed = tokens[-1:]
    return tokens, np.stack(hidden)


def untrimmed(monkeypatch):
    """The same graphs with the window layers' caches never trimmed (positions = buffer indices)."""
    monkeypatch.setattr(stage_runner, "window_start", lambda length, window: 0)


def test_window_start_is_a_pure_function_of_length():
    for window in (1, 8, 512):
        slack = stage_runner.window_slack(window)
        for length in range(0, 3 * window + 200):
            kept = length - window_start(length, window)
            assert min(length, window - 1) <= kept <= window - 1 + slack - 1
            assert kept + 1 <= window_positions(window)  # a decode step fits the buffer


def test_window_layers_keep_only_their_window(gemma3):
    pipe = gemma3.pipeline([])
    runner = pipe.runners[0]
    ids = gemma3.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * WINDOW
    feed, lengths = ids, []
    for _ in range(N_NEW):
        token = pipe.step("s", feed, SamplingBatch.greedy(1))
        feed = [token]
        length = runner.length("s")
        kv = runner.export_kv("s")
        for u in range(1, 6):  # window layers: the window and at most a slack block more
            assert kv[f"key.{u}"].shape[2] == length - window_start(length, WINDOW) <= window_positions(WINDOW) - 1
            assert runner._pool.arrays[f"value.{u}"].shape[2] <= window_positions(WINDOW)
        assert kv["key.6"].shape[2] == kv["value.6"].shape[2] == length  # the global layer keeps everything
        lengths.append(length)
    assert lengths[-1] == len(ids) + N_NEW - 1 > 5 * WINDOW
    pool = runner._pool
    assert pool.window_capacity == window_positions(WINDOW)  # a prefill's extra room was given back
    per_position = 2 * pool.kv_heads * pool.head_dim * pool.dtype.itemsize  # K and V, fp32 (fp16 in the kernel form)
    assert pool.dtype == (np.float16 if gemma3.manifest.precision == "gguf" else np.float32)
    assert per_position == gemma3.manifest.kv_bytes_per_token(1)
    assert runner.kv_bytes == pool.rows * per_position * (pool.capacity + 5 * pool.window_capacity)


@pytest.mark.parametrize("cuts", [[], [2, 6], [1, 4]], ids=["1-stage", "cut-window|global", "window-only-stage"])
def test_trimmed_tokens_equal_untrimmed(gemma3, cuts, monkeypatch):
    ids = gemma3.tokenizer.encode(PROMPT)
    tokens, hidden = decode(pipeline(gemma3, cuts), "s", ids, N_NEW)
    untrimmed(monkeypatch)
    full = pipeline(gemma3, cuts)
    full_tokens, full_hidden = decode(full, "s", ids, N_NEW)
    assert full_tokens == tokens
    assert np.array_equal(full_hidden, hidden)  # bit for bit
    first_layer = next(r for r in full.runners if 1 in r.layers)
    assert first_layer._pool.arrays["key.1"].shape[2] >= len(ids) + N_NEW - 1  # the reference kept everything


def test_a_cache_one_position_short_is_caught(gemma3, monkeypatch):
    ids = gemma3.tokenizer.encode(PROMPT)
    _, hidden = decode(pipeline(gemma3, []), "s", ids, 20)
    short = stage_runner.window_start
    monkeypatch.setattr(stage_runner, "window_start", lambda length, window: max(short(length, window), length - window + 2))
    _, wrong = decode(pipeline(gemma3, []), "s", ids, 20)
    assert not np.array_equal(wrong, hidden)


def test_batched_decode_equals_solo_with_trimmed_windows(gemma3):
    pipe = pipeline(gemma3, [2, 6], batch_invariant=True)
    tok = gemma3.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("Hello, world! Hello there."), tok.encode(PROMPT + " and more, more, more.")]
    expected = []
    for i, ids in enumerate(prompts):
        expected.append(decode(pipe, f"solo{i}", ids, 30))
        pipe.drop(f"solo{i}")
    seqs = [f"b{i}" for i in range(len(prompts))]
    firsts = [decode(pipe, s, ids, 1) for s, ids in zip(seqs, prompts)]
    got = [list(t) for t, _ in firsts]
    hidden = [[h[0]] for _, h in firsts]
    for _ in range(29):
        x = np.array([[g[-1]] for g in got], np.int64)
        for runner in pipe.runners[:-1]:
            x = runner.run_batch(seqs, x)
        for h, row in zip(hidden, x[:, -1]):
            h.append(row.copy())
        for g, t in zip(got, pipe.runners[-1].run_batch(seqs, x, SamplingBatch.greedy(len(seqs)))):
            g.append(int(t))
    for (tokens, solo_hidden), g, h in zip(expected, got, hidden):
        assert g == tokens
        assert np.array_equal(np.stack(h), solo_hidden)


@pytest.mark.parametrize("at", [5, 19])  # moved before the first trim, and well past it
def test_kv_moved_mid_generation_continues_identically(gemma3, at):
    ids = gemma3.tokenizer.encode(PROMPT)
    reference, reference_hidden = decode(pipeline(gemma3, [2, 6]), "ref", ids, N_NEW)

    source = pipeline(gemma3, [2, 6])
    first, first_hidden = decode(source, "s", ids, at)
    length = source.runners[0].length("s")
    moved = {name: t for r in source.runners for name, t in r.export_kv("s").items()}
    assert moved["key.1"].shape[2] < length == moved["key.6"].shape[2]  # window layers travel trimmed
    target = pipeline(gemma3, [1, 4])  # other cuts: a stage of window layers only needs the length
    for runner in target.runners:
        mine = {name: t for name, t in moved.items() if int(name.split(".")[1]) in runner.layers}
        if runner.layers == [1, 2, 3]:
            with pytest.raises(ValueError, match="length"):
                runner.import_kv("probe", mine)
        runner.import_kv("s", mine, length=length)
    rest, rest_hidden = decode(target, "s", [first[-1]], N_NEW - at)
    assert first + rest == reference
    assert np.array_equal(np.concatenate([first_hidden, rest_hidden]), reference_hidden)


def test_planner_counts_window_layers_at_their_window(gemma3):
    """The manifest marks window layers; the planner sizes them at their window, so a device
    too small for six full-context caches holds the model (and would not without the trim)."""
    from dataclasses import replace

    from edgepipe.plan import DeviceProfile, ModelProfile, NetworkProfile, PlanRequest, UnitProfile, plan

    units = gemma3.manifest.units
    assert [u.kv_window for u in units] == [0] + [window_positions(WINDOW)] * 5 + [0, 0]
    profile = ModelProfile("gemma3", tuple(UnitProfile(u.index, u.name, 0.01, 1000, u.kv_bytes_per_token, 256, u.kv_window)
                                           for u in units), context_tokens=256, runtime_overhead_bytes=0)
    per_token = units[1].kv_bytes_per_token
    assert profile.stage_bytes(0, len(units), 1) == 8 * 1000 + per_token * (256 + 5 * window_positions(WINDOW))
    full = replace(profile, units=tuple(replace(u, kv_window=0) for u in profile.units))
    assert full.stage_bytes(0, len(units), 1) == 8 * 1000 + per_token * 6 * 256
    device = DeviceProfile("d", profile.stage_bytes(0, len(units), 1), 1.0, 0.0)
    assert plan(profile, [device], NetworkProfile(), PlanRequest()).best.complete
    assert not plan(full, [device], NetworkProfile(), PlanRequest()).best.complete


@pytest.mark.slow
def test_rebalance_moves_trimmed_kv_between_worker_processes(tmp_path_factory):
    """Real workers: a forced rebalance mid-stream moves a sequence's trimmed KV of window layers
    1-3 only (the receiver needs the sender's length to place it); the text is the
    single-process reference's."""
    import httpx

    from edgepipe.runtime.local import generate
    from edgepipe.runtime.sequence import GenerationParams
    from harness import Server
    from test_living_cluster import PROMPT, events, stream_tokens

    home = tmp_path_factory.mktemp("sliding-window-home")
    path = write_tiny_gguf(home / "gemma3.gguf", "gemma3", seed=11)
    pkg = Package(import_model(path, home / "models", "fp32", name="tinygemma3", max_context=256))  # costs: calibration needs them
    tok = pkg.tokenizer
    ids = tok.encode(tok.format_chat([{"role": "user", "content": PROMPT}]))
    expected = tok.decode(generate(pkg.pipeline(), ids, GenerationParams(max_tokens=48, ignore_eos=True), tok.decode,
                                   pkg.manifest.eos_ids).tokens)
    # slowed down so that the sequence is still running when the new plan comes up
    with Server(home, workers=2, args=("--model", "tinygemma3", "--placement", "memory", "--worker-args", "--slowdown 40")) as server:
        stages = server.status()["plan"]["stages"]
        a, b = stages[0]["worker"], stages[1]["worker"]
        moved = {}

        def on_chunk(n):
            if n == 20 and not moved:  # ~40 positions: every window layer has trimmed
                moved["reply"] = httpx.post(server.url + "/v1/cluster/rebalance", timeout=120, json={"stages": [
                    {"worker": a, "start": 0, "end": 2}, {"worker": b, "start": 2, "end": 8}]}).json()

        text, _ = stream_tokens(server, 48, on_chunk)
        up = [e for e in events(server, "up") if e["plan"] == moved["reply"]["plan"]][0]
    assert up["kv_moved"] == 1 and up["kv_recomputed"] == 0 and up["kv_moved_bytes"] > 0, up
    assert text == expected
