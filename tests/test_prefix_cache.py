"""The prefix cache: its pure decisions (``cluster.prefix``), and reused KV that is bit for bit
what recomputing gives (``runtime.prefix_store`` on real stage runners)."""

from __future__ import annotations

import numpy as np
import pytest

from edgepipe.cluster.state import prefix as P
from edgepipe.net.validate import prefix_entry
from edgepipe.runtime.prefix_store import PrefixMiss, PrefixStore
from edgepipe.runtime.stage_runner import SamplingBatch
from edgepipe.model.store import local_form

B = 4


def committed(cache, ids, rid="a", room=100, reuse=True):
    cache, decision = P.prefill(cache, ids, rid, room, B, reuse)
    return P.commit(cache, rid), decision


def test_block_names_chain_over_the_prefix():
    a = P.block_hashes(list(range(10)), B)
    assert len(a) == 2  # the partial third block has no name
    assert P.block_hashes(list(range(8)) + [99], B) == a
    b = P.block_hashes([7] + list(range(1, 10)), B)  # one id of block 0 differs: every later name differs
    assert b[0] != a[0] and b[1] != a[1]
    assert P.block_hashes(list(range(4)) + [50, 51, 52, 53], B)[0] == a[0]


def test_a_prompt_reuses_the_committed_blocks_it_starts_with():
    cache = P.for_plan(P.PrefixCache(), plan=1)
    first = list(range(100, 111))  # 11 ids: blocks 0 and 1
    cache, decision = P.prefill(cache, first, "a", 100, B)
    assert decision.reuse == () and [i for i, _ in decision.save] == [0, 1] and decision.evict == ()
    assert cache.reusable(first + [5, 6, 7], B) == 0  # pending until its token comes back
    cache = P.commit(cache, "a")
    second = first[:9] + [1, 2, 3, 4, 5]
    cache, decision = P.prefill(cache, second, "b", 100, B)
    assert decision.reuse == tuple(P.block_hashes(first, B)) and decision.reused_positions == 8
    assert [i for i, _ in decision.save] == [2]  # its own third block, computed now


def test_a_reuse_leaves_two_positions_to_compute():
    """A one-position chunk runs the one-row kernels, whose sums differ from a prefill's row."""
    cache, _ = committed(P.for_plan(P.PrefixCache(), 1), list(range(12)))
    assert cache.reusable(list(range(12)), B) == 2  # 12 ids: blocks 0 and 1, then 4 to compute
    assert cache.reusable(list(range(9)), B) == 1  # 9 ids: block 0; 2 reused would leave 1
    assert cache.reusable(list(range(10)), B) == 2


def test_prompt_logprobs_save_but_do_not_reuse():
    cache, _ = committed(P.for_plan(P.PrefixCache(), 1), list(range(12)))
    cache, decision = P.prefill(cache, list(range(16)), "b", 100, B, reuse=False)
    assert decision.reuse == () and [i for i, _ in decision.save] == [3]


def test_eviction_takes_least_recently_used_leaves_and_never_the_reused_chain():
    cache = P.for_plan(P.PrefixCache(), 1)
    cache, _ = committed(cache, [1] * 13, "a")  # blocks a0 a1 a2
    cache, _ = committed(cache, [2] * 9, "b")  # blocks b0 b1
    assert cache.held == 5
    names_a, names_b = P.block_hashes([1] * 13, B), P.block_hashes([2] * 9, B)
    # Room for 5 and one new block: the least recently used leaf goes (a2; a0, a1 are not leaves).
    _, decision = P.prefill(cache, [1] * 8 + [3] * 6, "x", 5, B)
    assert decision.reuse == tuple(names_a[:2]) and decision.evict == (names_a[2],) and len(decision.save) == 1
    # Reusing a0..a2 (the LRU chain) keeps it: b1 goes instead.
    cache, decision = P.prefill(cache, [1] * 12 + [3] * 6, "c", 5, B)
    assert decision.reuse == tuple(names_a) and decision.evict == (names_b[1],) and len(decision.save) == 1
    # No room at all (running requests need the KV): the new sequence still copies a0 a1, then
    # everything goes, the reused chain last, and nothing is saved.
    cache = P.commit(cache, "c")
    cache, decision = P.prefill(cache, [1] * 13, "d", 0, B)
    assert decision.reuse == tuple(names_a[:2]) and decision.save == () and cache.held == 0
    assert len(decision.evict) == 5 and set(decision.evict[-2:]) == set(names_a[:2])


def test_concurrent_prefills_of_one_prompt_save_it_once():
    cache = P.for_plan(P.PrefixCache(), 1)
    cache, first = P.prefill(cache, list(range(12)), "a", 100, B)
    cache, second = P.prefill(cache, list(range(12)), "b", 100, B)
    assert len(first.save) == 3 and second.empty


def test_failures_and_plan_switches_drop_everything():
    cache, _ = committed(P.for_plan(P.PrefixCache(), 1), list(range(12)))
    epoch = cache.epoch
    assert P.for_plan(cache, 1) is cache
    moved = P.for_plan(cache, 2)
    assert moved.held == 0 and moved.epoch == epoch + 1 and moved.plan == 2
    cache, decision = P.prefill(cache, list(range(20)), "b", 100, B)
    failed = P.abort(cache, "b")
    assert failed.held == 0 and failed.epoch == epoch + 1 and not failed.pending
    assert P.abort(cache, "nobody") is cache  # a request whose frames carried no decision changes nothing


def test_room_is_what_live_requests_leave():
    assert P.room_blocks(4096, None, 10_000, 32) == 128
    assert P.room_blocks(4096, 3000, 1000, 32) == 62
    assert P.room_blocks(4096, 3000, 5000, 32) == 0


def test_decisions_are_deterministic():
    def play():
        cache, out = P.for_plan(P.PrefixCache(), 3), []
        for i, ids in enumerate([[1] * 20, [1] * 12 + [2] * 9, [3] * 30, [1] * 25]):
            cache, d = P.prefill(cache, ids, f"r{i}", 9, B)
            cache = P.commit(cache, f"r{i}")
            out.append(d.wire())
        return out
    assert play() == play()


def test_bad_prefix_entries_are_refused_in_one_line():
    assert prefix_entry({"seq": "x"}) is None
    good = {"epoch": 1, "block": 32, "reuse": ["ab"], "save": [[1, "cd"]], "evict": []}
    assert prefix_entry({"prefix": good}) == good
    for bad in ({"epoch": -1, "block": 32}, {"epoch": 1, "block": 0}, {**good, "save": [["x", "cd"]]}, {**good, "reuse": [3]}, "x"):
        with pytest.raises(ValueError, match="prefix entry must be"):
            prefix_entry({"prefix": bad})


# -- real stage runners ---------------------------------------------------------------------------
def run_pipeline(pipe, stores, seq, ids, entry=None):
    """One prefill through the runners as the workers run it: the entry's install, the compute, its saves."""
    x = np.array([ids], np.int64)
    for runner, store in zip(pipe.runners, stores):
        if entry:
            store.before(runner, seq, entry)
        x = runner.run(seq, x, SamplingBatch.greedy(1) if runner.emits_tokens else None)
        if entry:
            store.after(runner, seq, entry)
    return int(x[0])


def check_reuse_is_exact(pkg, cuts):
    """Prompt A saved, prompt B = A's first blocks + new text: B from the cache equals B computed
    whole, in its KV (every layer, every position, bit for bit) and its token."""
    tok = pkg.tokenizer
    system = "You are a terse assistant who answers in one line. " * 6
    a = tok.encode(tok.format_chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]))
    b = tok.encode(tok.format_chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a colour, please."}]))
    pipe = pkg.pipeline(cuts=cuts, precision=local_form(pkg))
    stores = [PrefixStore() for _ in pipe.runners]
    cache = P.for_plan(P.PrefixCache(), 1)
    cache, first = P.prefill(cache, a, "a", 1000, 16)
    run_pipeline(pipe, stores, "a", a, first.wire())
    cache = P.commit(cache, "a")
    cache, second = P.prefill(cache, b, "b", 1000, 16)
    assert second.reused_positions >= 64, "the prompts share the system prompt"
    hit = run_pipeline(pipe, stores, "b", b[second.reused_positions:], second.wire())
    whole = run_pipeline(pipe, stores, "whole", b)
    for runner in pipe.runners:
        cached, computed = runner.export_kv("b"), runner.export_kv("whole")
        assert cached.keys() == computed.keys()
        for name in computed:
            assert np.array_equal(cached[name], computed[name]), name
    assert hit == whole
    with pytest.raises(PrefixMiss):  # a block this stage never kept: refused, nothing computed
        stores[0].before(pipe.runners[0], "c", {**second.wire(), "reuse": ["00" * 12]})


@pytest.mark.parametrize("cuts", [(), (10, 21)])
def test_reused_kv_is_bit_identical_to_recomputing_it(native_pkg, cuts):
    check_reuse_is_exact(native_pkg, cuts)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["native", "gguf"])
def test_reused_kv_is_bit_identical_on_qwen(home, precision):
    """Qwen2.5-Coder-0.5B: its own blocks (MatMulNBits) and the GGUF kernel library's form."""
    from edgepipe.model.store import missing_reference, reference_gguf, resolve

    if missing := missing_reference("qwen05"):
        pytest.fail(missing)
    check_reuse_is_exact(resolve(str(reference_gguf("qwen05")), precision, home), (8, 17))


@pytest.mark.slow
def test_reused_kv_is_bit_identical_in_fp32(fp32_pkg):
    check_reuse_is_exact(fp32_pkg, (10, 21))
