"""Speculative decoding's arithmetic: acceptance (greedy and the sampling rule), draft length, n-gram drafts.

The sampling rule is checked statistically on a tiny random model (bigram tables over 5 tokens):
three tokens drawn through drafts and verification, over many seeds, follow the target's own
distribution (chi-square), and a rule that keeps every draft is caught by the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from edgepipe.runtime.speculative import DraftLength, NgramDrafter, accept_greedy, accept_sampled

pytestmark = pytest.mark.pure  # no process, no model


@pytest.mark.parametrize("drafts, targets, expected", [
    ([], [7], [7]),  # nothing drafted: one decode step
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all kept, plus the bonus token
    ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # the first mismatch ends the pass with the target's token
    ([1, 2, 3], [5, 2, 3, 4], [5]),  # nothing kept: still one token
    ([1, 2, 3], [1, 2, 8, 4], [1, 2, 8]),
    ([1, 2, 3], [1, 2, 8], [1, 2, 8]),  # a last stage that applied the sampling rule stops at its first rejection
    ([1, 2, 3], [5], [5]),
])
def test_accept_greedy(drafts, targets, expected):
    assert accept_greedy(drafts, targets) == expected


@pytest.mark.parametrize("drafts, targets", [([1, 2], [1, 2]), ([1, 2], []), ([1, 2], [1, 2, 3, 4])])
def test_accept_greedy_needs_a_target_up_to_the_first_rejection(drafts, targets):
    with pytest.raises(ValueError, match="returns"):
        accept_greedy(drafts, targets)


V, LENGTH, RUNS = 5, 3, 8_000


def _tables(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A target and a (different) draft bigram model: row ``a`` is the next-token distribution after ``a``."""
    rng = np.random.default_rng(seed)

    def softmax(x):
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    p = softmax(rng.normal(0, 1.5, (V, V)))
    q = softmax(rng.normal(0, 1.5, (V, V)))
    return p, q


def _speculative_run(p: np.ndarray, q: np.ndarray, seed: int, k: int, rule) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    out = [0]
    while len(out) < LENGTH + 1:
        drafts, prev = [], out[-1]
        for _ in range(k):  # the draft samples from its own distribution
            d = _draw(q[prev], rng)
            drafts.append(d)
            prev = d
        context = [out[-1]] + drafts
        q_rows = np.stack([q[t] for t in context[:-1]])
        p_rows = np.stack([p[t] for t in context])  # the target after each position of the verify pass
        out += rule(drafts, q_rows, p_rows, rng)
    return tuple(out[1:LENGTH + 1])


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    return min(int(np.searchsorted(np.cumsum(probs), rng.random(), side="right")), V - 1)


def _exact(p: np.ndarray) -> np.ndarray:
    probs = np.zeros((V,) * LENGTH)
    for seq in np.ndindex(*probs.shape):
        prev, prob = 0, 1.0
        for t in seq:
            prob *= p[prev, t]
            prev = t
        probs[seq] = prob
    return probs.reshape(-1)


def _chi_square_p(p, q, rule, k: int) -> float:
    counts = np.zeros(V ** LENGTH)
    for seed in range(RUNS):
        counts[np.ravel_multi_index(_speculative_run(p, q, seed, k, rule), (V,) * LENGTH)] += 1
    expected = _exact(p) * RUNS
    keep = expected >= 5  # chi-square wants at least ~5 expected per cell: pool the rare ones
    observed = np.append(counts[keep], counts[~keep].sum())
    return float(chisquare(observed, np.append(expected[keep], expected[~keep].sum())).pvalue)


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_output_follows_the_targets_distribution(k):
    p, q = _tables(3)
    assert _chi_square_p(p, q, accept_sampled, k) > 1e-3


def test_the_statistical_check_catches_a_wrong_rule():
    """Keeping every draft gives the draft's distribution: the same check must reject it."""
    p, q = _tables(3)

    def keep_all(drafts, q_rows, p_rows, rng):
        return drafts + [_draw(p_rows[-1], rng)]

    assert _chi_square_p(p, q, keep_all, 3) < 1e-6


def test_accept_sampled_keeps_a_draft_the_target_likes_more():
    """p >= q at the draft: always kept (the rule's min(1, p/q) = 1), whatever the draw."""
    p = np.array([[0.1, 0.9], [0.5, 0.5]])
    q = np.array([[0.5, 0.5]])
    for seed in range(50):
        out = accept_sampled([1], q, p, np.random.default_rng(seed))
        assert out[0] == 1 and len(out) == 2


def test_accept_sampled_replaces_a_draft_the_target_rules_out():
    """p = 0 at the draft: always rejected, and the replacement comes from max(0, p - q)."""
    p = np.array([[0.0, 0.6, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.5, 0.5, 0.0]])
    seen = {accept_sampled([0], q, p, np.random.default_rng(seed))[0] for seed in range(200)}
    assert seen <= {1, 2} and 2 in seen  # max(0, p - q) = [0, 0.1, 0.4]: mostly 2, never 0


def test_draft_length_follows_the_acceptance_rate():
    length = DraftLength(k_max=8, worth=0.25, smoothing=0.5, rate=0.7)  # the j-th draft kept with 0.7 ** j
    start = length.k
    assert start == int(np.log(0.25) / np.log(0.7))  # 3
    length.update(length.k, 0)  # nothing kept: fewer
    assert 1 <= length.k < start
    for _ in range(6):
        length.update(max(length.k, 1), 0)  # still nothing: the first draft is not worth it, drafting pauses
    assert length.k == 0
    for _ in range(length.retry_after - 1):
        assert length.update(0, 0) == 0  # plain decode steps
    assert length.update(0, 0) == length.k_min  # then one more try
    seen = []
    for _ in range(5):
        seen.append(length.update(length.k, length.k))  # everything kept: twice as many each pass, to k_max
    assert seen == [2, 4, 8, 8, 8]
    length.update(8, 4)
    assert 1 <= length.k < 8
    with pytest.raises(ValueError):
        DraftLength(k_min=3, k_max=2)


@pytest.mark.parametrize("ids, k, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, [4, 9, 1]),  # "1 2 3" seen before: what followed it
    ([1, 2, 3, 4, 9, 1, 2, 3], 1, [4]),
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the latest earlier occurrence wins
    ([1, 2, 3, 4], 3, []),  # no repeat: no draft
    ([1, 2, 3, 1, 2], 5, [3, 1, 2]),  # stops where the ids end
    ([1, 2, 3], 0, []),
])
def test_ngram_drafts(ids, k, expected):
    assert NgramDrafter(max_n=3, min_n=2).draft("s", ids, k) == expected


def test_which_requests_speculate():
    """Requests whose head controls are the same at every position (greedy or sampled); not masks
    (structured output), logit bias or penalties, which change with every token."""
    from edgepipe.cluster.shells.speculation import Speculation
    from edgepipe.runtime import controls
    from edgepipe.runtime.sequence import GenerationParams, SequenceState

    def state(**params) -> SequenceState:
        return SequenceState([1, 2, 3], GenerationParams(**params), lambda ids: "", (0,))

    def eligible(s: SequenceState) -> bool:
        return Speculation.eligible(s, controls.step_fields(s, 16, prefill=False))

    assert eligible(state()) and eligible(state(logprobs=True, top_logprobs=3)) and eligible(state(temperature=0.7, seed=1))
    assert not eligible(state(logit_bias=((5, -3.0),)))
    assert not eligible(state(repeat_penalty=1.1))
    masked = state()
    masked.token_mask = lambda generated: None
    assert not eligible(masked)


def test_drafts_for_the_next_pass_are_made_during_this_one():
    """A model drafter whose drafts are kept drafts the next pass while this one is verified; its
    guess is used only where the target kept every draft and chose the drafter's next token."""
    import asyncio

    from edgepipe.cluster.shells.speculation import Speculation
    from edgepipe.runtime.sequence import GenerationParams, SequenceState

    class Counting:  # drafts "the next integers": right until the target says otherwise
        name = "counting"

        def __init__(self):
            self.calls = []

        def draft(self, seq, ids, k, params=None, step=0):
            self.calls.append(len(ids))
            return [ids[-1] + 1 + j for j in range(k)]

        def prime(self, seq, ids):
            pass

        def forget(self, seq):
            pass

    async def run():
        drafter = Counting()
        spec = Speculation(drafter, k_max=8)
        spec.lengths["r"] = DraftLength(k_max=8, worth=0.5, rate=0.9)  # 6 drafts
        state = SequenceState([1, 2, 3], GenerationParams(max_tokens=64), lambda ids: "", (0,))
        state.generated.append(4)
        first = (await spec.propose("r", state, 64)).tokens
        state.generated += first + [first[-1] + 1]  # all kept, and the target's bonus is the drafter's guess
        spec.learn("r", len(first), len(first))
        second = (await spec.propose("r", state, 64)).tokens
        assert second == [state.all_ids[-1] + 1 + j for j in range(len(second))] and spec.ahead_used == 1
        assert len(first) == 6 and len(second) == 8  # all kept: 8 now, the guess's 6 then 2 drafted on after them
        state.generated += second[:1] + [99]  # one kept, then the target disagrees: the guess is not used
        spec.learn("r", len(second), 1)
        third = (await spec.propose("r", state, 64)).tokens
        assert third[0] == 100 and spec.ahead_used == 1
        spec.forget("r")

    asyncio.run(run())


@pytest.mark.parametrize("timed", [False, True])
def test_an_acceptance_only_length_starts_every_request_alike(timed):
    """A seeded request decided by the sampling rule repeats its tokens only if its draft lengths
    do: with acceptance-only lengths a new request starts from the same rate whatever the server
    served before; timed lengths (whose tokens follow the machine anyway) start from the drafts'
    overall acceptance once there is some."""
    from edgepipe.cluster.shells.speculation import PRIOR_AFTER, Speculation

    fresh = Speculation(NgramDrafter(), k_max=8, timed=timed)
    busy = Speculation(NgramDrafter(), k_max=8, timed=timed)
    for n in range(PRIOR_AFTER + 2):  # other requests, every draft kept
        busy.learn(f"other{n}", 6, 6)
    first, later = fresh._length("r"), busy._length("r")
    if timed:
        assert later.rate == 1.0 and first.rate == 0.6
    else:
        assert (later.rate, later.k) == (first.rate, first.k) == (0.6, first.k)


def test_lookup_then_model_drafts_for_free_where_the_lookup_finds_a_match():
    """Prompt lookup first; the model only where it finds nothing. For the sampling rule a lookup
    draft's distribution is its one token (it is certain given the ids)."""
    from edgepipe.runtime.sequence import GenerationParams
    from edgepipe.runtime.speculative import Distribution, LookupThenModel

    class Model:  # stands in for ModelDrafter: records what it was asked
        name, states_distributions = "model", True

        def __init__(self):
            self.asked = []

        def draft(self, seq, ids, k, params=None, step=0):
            self.asked.append(len(ids))
            return [7] * k

        def draft_sampled(self, seq, ids, k, params, step=0):
            self.asked.append(len(ids))
            return [7] * k, [Distribution.of([7, 8], [0.5, 0.5])] * k

    model = Model()
    drafter = LookupThenModel(NgramDrafter(max_n=3, min_n=2), model)
    repeating = [1, 2, 3, 4, 9, 1, 2, 3]
    assert drafter.draft("s", repeating, 3) == [4, 9, 1] and model.asked == []
    assert drafter.draft("s", [1, 2, 3, 4], 2) == [7, 7] and model.asked == [4]
    tokens, q = drafter.draft_sampled("s", repeating, 2, GenerationParams(temperature=1.0))
    assert tokens == [4, 9] and [(d.prob(t), len(d.ids)) for d, t in zip(q, tokens)] == [(1.0, 1), (1.0, 1)]
    tokens, q = drafter.draft_sampled("s", [5, 6], 2, GenerationParams(temperature=1.0))
    assert tokens == [7, 7] and q[0].prob(8) == 0.5
    assert drafter.name == "ngram+model" and drafter.states_distributions
