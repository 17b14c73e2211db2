"""Speculative decoding's arithmetic (pure): which drafted tokens a verify pass keeps, how many to
draft next, and the two drafters (n-gram lookup; a small model with the same tokenizer).

A verify pass feeds the target ``[t, d1 .. dk]`` (the last token and ``k`` drafts) as one chunk
and gets back, per position ``i``, the token the target chooses after ``t, d1 .. di``. Greedy:
keep drafts while they equal the target's choice, then the target's own token (at the first
mismatch, or the bonus after all ``k``): ``accepted + 1`` tokens per pass, exactly the tokens
one decode step each would give (the stages run ``graphs.verify_form``, whose verify rows are
bit-identical to decode steps).

Sampled, two exact ways (each keeps the target's distribution; they may be mixed pass by pass):

- The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023), :func:`accept_drawn`:
  a model drafter draws each draft from a distribution ``q`` it states (its sampler's, cut to its
  ``DRAFT_SUPPORT`` likeliest tokens: the rule is exact for any ``q`` the drafts are really drawn
  from), the verify pass carries the drafts and their ``q`` to the last stage, and the last stage
  keeps draft ``d`` with probability ``min(1, p(d) / q(d))`` against its own sampler's ``p``
  (``graphs.sampler_form``), replacing the first one it rejects by a draw from
  ``norm(max(0, p - q))``; after ``k`` kept drafts the bonus is the target's own seeded sample.
  It keeps a draft with probability ``1 - TV(p, q)``, the most any exact scheme can. The draws
  are seeded per token (:func:`rule_draws`), so a seeded request repeats itself on a speculative
  cluster; it is not the token-for-token output of decoding without speculation.
- Common draws (n-gram drafts, and requests that want logprobs: the head's logprobs are of its
  own sample): each position samples with the seeded draw its token would get decoding one step
  at a time (``uniform_draw(seed, index)``), the drafter samples with the same draws, and a draft
  is kept when it equals the target's sample: the output is then the non-speculative seeded
  output token for token. For a fixed draft (n-gram: ``q`` is one token) this keeps it with
  probability ``p(d)``, as the rule would; for a model's drafts it keeps fewer than the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np


DRAFT_SUPPORT = 64  # tokens of a model draft's distribution that travel with it (the rule's q)
RULE_STREAM = 1 << 64  # the rule's draws: another Philox key than the sampler's uniform_draw(seed, index)


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verify pass yields: drafts up to the first one the target disagrees with, then
    the target's token there. ``targets``: the target's token at every position (greedy: ``k + 1``
    of them), or only up to the first disagreement (a last stage that applied the sampling rule)."""
    if not 1 <= len(targets) <= len(drafts) + 1:
        raise ValueError(f"a verify pass of {len(drafts)} drafts returns 1 to {len(drafts) + 1} tokens, got {len(targets)}")
    out: list[int] = []
    for draft, target in zip(drafts, targets):
        out.append(target)
        if draft != target:
            return out
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"a verify pass that kept {len(targets)} of {len(drafts)} drafts returns the token after them too")
    out.append(targets[-1])
    return out


@dataclass(frozen=True)
class Distribution:
    """A sampling distribution as a sampler holds it: token ids and their weights (``>= 0``, not
    necessarily normalised; the probability of ``ids[i]`` is ``weights[i] / total``). Ids that
    are not listed have probability 0; an id is listed once."""

    ids: np.ndarray  # [N] int64
    weights: np.ndarray  # [N] float

    def __post_init__(self) -> None:
        if self.ids.ndim != 1 or self.ids.shape != self.weights.shape or not self.ids.size:
            raise ValueError("a distribution needs one weight per token id, and at least one id")
        if not (np.isfinite(self.weights).all() and (self.weights >= 0).all() and self.weights.sum() > 0):
            raise ValueError("a distribution's weights must be finite, >= 0, and not all 0")

    @classmethod
    def of(cls, ids, weights) -> "Distribution":
        return cls(np.asarray(ids, np.int64).reshape(-1), np.asarray(weights, np.float64).reshape(-1))

    @property
    def total(self) -> float:
        return float(self.weights.sum())

    def probs_of(self, tokens: np.ndarray) -> np.ndarray:
        """The probability of each of ``tokens`` (0 for ids not listed); sorts this one's ids (a draft's few)."""
        order = np.argsort(self.ids, kind="stable")
        sorted_ids = self.ids[order]
        at = np.minimum(np.searchsorted(sorted_ids, tokens), len(sorted_ids) - 1)
        found = sorted_ids[at] == tokens
        return np.where(found, self.weights[order][at], 0.0) / self.total

    def prob(self, token: int) -> float:
        return float(self.weights[self.ids == token].sum()) / self.total

    def draw(self, u: float) -> int:
        """The token at draw ``u`` in ``[0, 1)``: where the cumulative weight, in listed order, first exceeds ``u * total``."""
        cumulative = np.cumsum(self.weights)
        return int(self.ids[min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), len(self.ids) - 1)])

    def head(self, n: int) -> "Distribution":
        """Its ``n`` first listed tokens with weight (a sampler's likeliest: ``sampler_form`` lists them best first)."""
        keep = np.flatnonzero(self.weights > 0)[:n]
        return Distribution(self.ids[keep], self.weights[keep] / self.weights[keep].sum())


def rule_draws(seed: int, index: int) -> tuple[float, float]:
    """The rule's two draws for token ``index`` of a seeded request (accept, replace): a pure
    function of (seed, index), independent of the sampler's ``uniform_draw(seed, index)``."""
    accept, replace = np.random.Generator(np.random.Philox(key=(seed & (2**64 - 1)) + RULE_STREAM, counter=index)).random(2)
    return float(accept), float(replace)


def accept_drawn(drafts: list[int], q: list[Distribution], p: list[Distribution], accept: list[float], replace: list[float],
                 bonus: int) -> list[int]:
    """The speculative-sampling rule with its draws given: draft ``d_i`` (drawn from ``q[i]``) is
    kept when ``accept[i] * q[i](d_i) < p[i](d_i)`` (probability ``min(1, p/q)``); the first one
    rejected is replaced by ``norm(max(0, p[i] - q[i]))`` drawn at ``replace[i]`` and the pass ends;
    after ``k`` kept drafts comes ``bonus``, a draw from ``p[k]`` (the target's own sample). The
    output is distributed exactly as sampling from ``p`` one token at a time."""
    k = len(drafts)
    if not (len(q) == len(accept) == len(replace) == k and len(p) >= k):
        raise ValueError(f"the rule needs a q, an accept and a replace draw per draft ({k}) and p at each")
    out: list[int] = []
    for i, d in enumerate(drafts):
        q_d = q[i].prob(d)
        if q_d <= 0:
            raise ValueError(f"draft {i} (token {d}) has probability 0 under the distribution it was drawn from")
        if accept[i] * q_d < p[i].prob(d):
            out.append(int(d))
            continue
        residual = np.maximum(p[i].weights / p[i].total - q[i].probs_of(p[i].ids), 0.0)
        # all 0: p <= q wherever p > 0, so p = q up to rounding, and q(d) > p(d) by a rounding only
        out.append(Distribution(p[i].ids, residual).draw(replace[i]) if residual.sum() > 0 else p[i].draw(replace[i]))
        return out
    out.append(int(bonus))
    return out


def accept_sampled(drafts: list[int], q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> list[int]:
    """:func:`accept_drawn` over dense distributions, drawing from ``rng``: ``q`` ``[k, V]`` the
    draft's probabilities, ``p`` ``[k + 1, V]`` the target's (both after temperature, top-k, top-p)."""
    k = len(drafts)
    if q.shape[0] != k or p.shape[0] != k + 1 or q.shape[1] != p.shape[1]:
        raise ValueError(f"accept_sampled: {k} drafts need q [k, V] and p [k + 1, V], got {q.shape} and {p.shape}")
    vocab = np.arange(p.shape[1])
    draws = rng.random((k, 2))
    return accept_drawn(drafts, [Distribution(vocab, row) for row in q], [Distribution(vocab, row) for row in p[:k]],
                        list(draws[:, 0]), list(draws[:, 1]), Distribution(vocab, p[k]).draw(rng.random()))


def rule_fields(drafts: list[int], q: list[Distribution], seed: int, step: int) -> dict:
    """A verify entry's ``sampling`` fields for the rule (drafts ``i`` is token ``step + i``): the
    drafts, each one's ``q`` and the rule's draws. The last stage reads them (:func:`head_verdict`)."""
    draws = [rule_draws(seed, step + i) for i in range(len(drafts))]
    return {"drafts": [int(d) for d in drafts], "draft_ids": [[int(t) for t in d.ids] for d in q],
            "draft_probs": [[float(w) for w in d.weights / d.total] for d in q],
            "accept": [a for a, _ in draws], "replace": [r for _, r in draws]}


def head_verdict(sampling: dict, probs: np.ndarray, ids: np.ndarray, sampled: list[int], vocab: int) -> list[int]:
    """What a last stage returns for a verify entry with :func:`rule_fields`: the rule's tokens
    (``len <= k + 1``), from its sampler's distribution per position (``probs``/``ids``
    ``[k + 1, N]``, ``graphs.sampler_form``) and its own sample at the last (``sampled``).
    ``ValueError`` (one line) for fields that do not fit the pass."""
    drafts, draft_ids, draft_probs = sampling.get("drafts"), sampling.get("draft_ids"), sampling.get("draft_probs")
    accept, replace = sampling.get("accept"), sampling.get("replace")
    k = len(sampled) - 1
    lists = (drafts, draft_ids, draft_probs, accept, replace)
    if not all(isinstance(v, list) and len(v) == k for v in lists) or probs.shape[0] != k + 1:
        raise ValueError(f"a verify entry of {k} drafts needs drafts, draft_ids, draft_probs, accept and replace of {k} entries each")
    if not all(_ids_in(row, vocab) for row in [drafts, *draft_ids]) or any(len(set(row)) != len(row) for row in draft_ids):
        raise ValueError(f"drafts and draft_ids must be token ids in [0, {vocab}), each of a distribution once")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 for v in accept + replace):
        raise ValueError("accept and replace draws must be numbers in [0, 1)")
    try:
        q = [Distribution.of(i, w) for i, w in zip(draft_ids, draft_probs)]
        p = [Distribution(ids[i], probs[i].astype(np.float64)) for i in range(k)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"draft distribution: {exc}") from None
    return accept_drawn(drafts, q, p, accept, replace, sampled[k])


def head_tokens(runner, entry: dict, sampled: np.ndarray) -> np.ndarray:
    """A last stage's tokens for a verify entry: its sampler's choice at every position, or, for
    an entry with :func:`rule_fields`, the rule's tokens (``runner``: the head's ``StageRunner``
    right after the pass, its sampler's distribution in ``last_sampler``)."""
    if "drafts" not in entry.get("sampling", {}):
        return sampled
    if runner.last_sampler is None:
        raise ValueError("this head does not state its sampler's distribution (not the verify form)")
    return np.array(head_verdict(entry["sampling"], runner.last_sampler.probs, runner.last_sampler.ids, [int(t) for t in sampled],
                                 runner.vocab or 0), np.int64)


def _ids_in(row, vocab: int) -> bool:
    return isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in row)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify pass of ``k`` drafts yields on average when each draft is kept with
    probability ``acceptance`` given the ones before it were: ``1 + a + a^2 + .. + a^k`` (the
    kept drafts, then the target's own token)."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class PassCosts:
    """What one speculative pass costs, measured (seconds). A pass of ``k`` drafts waits for the
    drafter (``draft_call_s + k * draft_step_s``), then travels the stages with ``k + 1``
    positions (``step_s + k * position_s``: ``step_s`` is a plain decode step, hops included).
    A drafter that drafts ahead (``ahead_from``: at an acceptance rate of at least this) makes
    the next pass's drafts while this one travels, as if every draft were kept; when they were
    and the target's own token is its first guess (probability about ``a ** (k + 1)``) the next
    pass waits only for what drafting took beyond this pass's travel."""

    step_s: float  # a plain decode step through every stage and hop (one position)
    position_s: float  # each extra position a verify pass carries
    draft_step_s: float  # each drafted token
    draft_call_s: float = 0.0  # a drafter call's fixed part (a remote drafter's round trip)
    ahead_from: float | None = None  # the acceptance rate from which the drafter drafts ahead (None: it does not)

    def __post_init__(self) -> None:
        values = (self.step_s, self.position_s, self.draft_step_s, self.draft_call_s)
        if not all(math.isfinite(v) and v >= 0 for v in values) or self.step_s <= 0:
            raise ValueError(f"pass costs must be finite seconds >= 0 (a step > 0), got {values}")

    def pass_s(self, k: int, acceptance: float = 0.0) -> float:
        """Seconds of a pass of ``k`` drafts (0: a plain decode step) at this acceptance rate."""
        if k <= 0:
            return self.step_s
        travel = self.step_s + k * self.position_s
        drafting = self.draft_call_s + k * self.draft_step_s
        if self.ahead_from is not None and acceptance >= self.ahead_from:
            hit = min(max(acceptance, 0.0), 1.0) ** (k + 1)
            drafting = (1 - hit) * drafting + hit * max(0.0, drafting - travel)
        return travel + drafting


def timed_draft_length(acceptance: float, costs: PassCosts, k_max: int, margin: float = 0.05) -> int:
    """The draft length with the most tokens per second, ``expected_tokens(a, k) / pass_s(k)``
    over ``k`` in ``[0, k_max]``; 0 (plain decoding) unless some ``k`` beats a plain step by
    ``margin`` (measured costs are noisy: a draft that barely pays is not worth the risk)."""
    plain = 1.0 / costs.step_s
    best_k, best = 0, plain * (1.0 + margin)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / costs.pass_s(k, acceptance)
        if rate > best:
            best_k, best = k, rate
    return best_k


def fit_line(points, prior_slope: float | None = None) -> tuple[float, float] | None:
    """``(intercept, slope)`` of ``y = intercept + slope * x`` through measured ``(x, y)`` points,
    robust to a slow outlier: the median ``y`` of each ``x``, then least squares over those
    medians (weighted by how many points each has). With one ``x`` measured: the line through it
    with ``prior_slope`` (None: through the origin). Slope and intercept are kept ``>= 0``. None
    without points."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(float(x), []).append(float(y))
    if not by_x:
        return None
    xs = sorted(by_x)
    medians = [float(np.median(by_x[x])) for x in xs]
    if len(xs) == 1:
        x, y = xs[0], medians[0]
        slope = y / x if prior_slope is None and x > 0 else (prior_slope or 0.0)
        slope = min(slope, y / x) if x > 0 else slope
        return max(0.0, y - slope * x), max(0.0, slope)
    weights = np.array([len(by_x[x]) for x in xs], np.float64)
    slope, intercept = np.polyfit(np.array(xs), np.array(medians), 1, w=np.sqrt(weights))
    if intercept < 0:  # through the origin instead
        slope, intercept = float(np.dot(weights * np.array(xs), medians) / np.dot(weights, np.array(xs) ** 2)), 0.0
    return max(0.0, float(intercept)), max(0.0, float(slope))


POSITION_SHARE = 0.45  # an extra verified position costs this share of a decode step (measured, stop 34) until measured here
MIN_PER_SIZE = 3  # passes of one size needed before that size shapes the fitted line


def pass_costs(steps, drafts, ahead_from: float | None = None) -> PassCosts | None:
    """Costs from measurements: ``steps`` ``(positions, seconds)`` of decode steps and verify
    passes through the stages, ``drafts`` ``(k, seconds)`` of drafter calls for ``k`` drafts
    (``ahead_from``: see ``PassCosts``). Where
    only one size of pass has been seen, an extra position costs ``POSITION_SHARE`` of a step.
    None until both a pass and a draft have been seen."""
    steps, draft = list(steps), fit_line(drafts)
    if not steps or draft is None:
        return None
    counts = {n: sum(1 for m, _ in steps if m == n) for n, _ in steps}
    sizes = sorted(n for n, c in counts.items() if c >= MIN_PER_SIZE) or sorted(counts)[:1]
    steps = [(n, s) for n, s in steps if n in sizes]  # sizes seen once or twice would tilt the line
    if len(sizes) >= 2:
        step_s, position_s = fit_line([(n - 1, s) for n, s in steps])
    else:  # one size: its median split as a step plus the extra positions at the measured share
        n = sizes[0]
        step_s = float(np.median([s for _, s in steps])) / (1 + POSITION_SHARE * (n - 1))
        position_s = POSITION_SHARE * step_s
    if step_s <= 0:
        return None
    return PassCosts(step_s, position_s, draft[1], draft[0], ahead_from)


@dataclass
class DraftLength:
    """How many tokens to draft next, from the acceptance rate seen so far and, where measured,
    what a pass costs.

    ``rate`` is a moving average of the share of drafts the target kept. With a share ``a`` the
    ``j``-th draft survives with probability ``a ** j``. Without costs, drafting stops where that
    falls below ``worth`` (a draft that costs compute, a model's, is worth less than a free n-gram
    one): ``k = floor(log(worth) / log(a))``, at most ``k_max``. With ``costs``
    (:class:`PassCosts`, from measured times) ``k`` is the one with the most tokens per second
    (:func:`timed_draft_length`), 0 where plain decoding is faster. A pass that keeps every
    draft at a high rate (``DOUBLE_ABOVE``) lets the next one try twice as many (the average alone
    would take several passes to get there, and a ramp of one more per pass spends most of a
    short answer's passes below ``k_max``). Where not even the first draft is worth it drafting
    pauses (``k = 0``: plain decode steps) and tries ``k_min`` again after ``retry_after`` steps
    (the text, or the load, may have changed). With costs, a try that finds drafting still not
    worth it doubles the wait before the next (up to ``RETRY_MOST``): a model drafter must first
    take in every token since it last drafted, so a try costs more the longer the pause; where
    drafting could not pay even if every draft were kept, tries come only every ``RETRY_MOST`` steps.

    With costs a try drafts what would pay on a predictable text (``TRY_RATE``), and a request
    starts with such a try unless drafting cannot pay at all: the rate it starts from is a guess,
    its own text decides. Over its first ``WARM_DRAFTS`` drafts the rate is the share kept with
    the starting rate counted as one draft, and over its first ``VERDICT_DRAFTS`` drafting does not
    pause (it drafts ``k_min`` where no more pays: one unlucky pass must not stop a predictable
    text); after that each draft counts as one observation in
    the moving average (weight ``DRAFT_WEIGHT`` each), so a pass of several drafts moves the rate
    as much as they say."""

    k_max: int = 8
    k_min: int = 1
    worth: float = 0.25
    smoothing: float = 0.3  # weight of the latest pass in the moving average
    rate: float = 0.6  # a start that drafts a few tokens
    retry_after: int = 16  # decode steps without drafting before trying again
    costs: PassCosts | None = None  # measured pass costs (None: decide from the acceptance rate alone)
    k: int = field(init=False, default=0)
    paused: int = field(init=False, default=0)  # steps decoded without drafts since drafting paused
    wait: int = field(init=False, default=0)  # steps to the next try while paused (retry_after, doubled after each failed try)
    trying: bool = field(init=False, default=False)  # the next pass is a try after a pause
    drafted: int = field(init=False, default=0)  # with costs: drafts observed so far (kept ones, and a pass's first rejected), and of them kept
    kept: int = field(init=False, default=0)

    DOUBLE_ABOVE: ClassVar[float] = 0.75  # with costs: a full pass doubles k only at this rate or more
    RETRY_MOST: ClassVar[int] = 512  # with costs: most steps between tries
    TRY_RATE: ClassVar[float] = 0.9  # with costs: a try drafts what would pay at this rate
    DRAFT_WEIGHT: ClassVar[float] = 0.15  # with costs: each draft's weight in the moving average
    WARM_DRAFTS: ClassVar[int] = 16  # with costs: drafts over which the rate is the share kept (the start counted as one)
    VERDICT_DRAFTS: ClassVar[int] = 4  # with costs: drafts observed before a request may pause (each forced one costs a draft step)

    def __post_init__(self) -> None:
        if not (1 <= self.k_min <= self.k_max and 0 < self.worth < 1 and 0 < self.smoothing <= 1 and 0 <= self.rate <= 1
                and self.retry_after >= 1):
            raise ValueError("DraftLength needs 1 <= k_min <= k_max, 0 < worth < 1, 0 < smoothing <= 1, 0 <= rate <= 1, retry_after >= 1")
        self.k = self._from_rate()
        self.wait, self.start_rate = self.retry_after, self.rate
        if self.k == 0 and self.costs is not None and not self._hopeless():  # a start is a try: this request's text decides
            self.k, self.trying = self._try_k(), True

    def _hopeless(self) -> bool:
        """Drafting could not pay at these costs even if every draft were kept."""
        return self.costs is not None and timed_draft_length(1.0, self.costs, self.k_max) == 0

    def _try_k(self) -> int:
        if self.costs is None:
            return self.k_min
        return max(self.k_min, timed_draft_length(self.TRY_RATE, self.costs, self.k_max))

    def _from_rate(self) -> int:
        if self.costs is not None:
            k = timed_draft_length(self.rate, self.costs, self.k_max)
            if k == 0 and 0 < self.drafted < self.VERDICT_DRAFTS and not self._hopeless():
                return self.k_min  # one or two drafts are not yet this text's verdict: one per pass until they are
            return k
        if self.rate >= 1.0:
            return self.k_max
        if self.rate < self.worth:
            return 0
        return max(self.k_min, min(self.k_max, int(math.log(self.worth) / math.log(self.rate))))

    def update(self, drafted: int, kept: int, costs: PassCosts | None = None) -> int:
        """Take one step's outcome (``kept`` of ``drafted``; 0 of 0: a step without drafts) and
        the latest measured ``costs`` (None: keep the ones held); returns the next ``k``."""
        if costs is not None:
            self.costs = costs
        if drafted <= 0:
            if self.k == 0:
                self.paused += 1
                # where no acceptance rate could make drafting pay at these costs, a try is all cost: rarely
                if self.paused >= (self.RETRY_MOST if self._hopeless() else self.wait):  # try again: the text may have become predictable
                    self.paused, self.k, self.trying = 0, self._try_k(), True
            return self.k
        if self.costs is None:
            self.rate = (1 - self.smoothing) * self.rate + self.smoothing * (kept / drafted)
        else:
            # Drafts after the first rejected one were drafted on a token the target did not
            # choose: they say nothing of the rate. A pass observes its kept drafts and, if any
            # was rejected, one rejection (kept / drafted would count the rest as rejections too).
            seen = kept + (kept < drafted)
            self.drafted, self.kept = self.drafted + seen, self.kept + kept
            if self.drafted <= self.WARM_DRAFTS:
                self.rate = (self.kept + self.start_rate) / (self.drafted + 1)
            else:
                weight = 1 - (1 - self.DRAFT_WEIGHT) ** seen
                self.rate = (1 - weight) * self.rate + weight * (kept / seen)
        k = self._from_rate()
        if self.trying:  # a try after a pause: back off further if it found drafting still not worth it
            self.wait = min(self.RETRY_MOST, 2 * self.wait) if k == 0 and self.costs is not None else self.retry_after
            self.trying = False
        elif k > 0:
            self.wait = self.retry_after
        full = kept == drafted and drafted >= self.k
        if full and (self.costs is None or (k > 0 and self.rate >= self.DOUBLE_ABOVE)):
            k = max(k, min(self.k_max, 2 * self.k))
        self.k = k
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
    drafting greedily or sampling. Keeps each sequence's KV between passes: what the target
    rejected is rewound (``StageRunner.rewind``), what it accepted is fed on the next call. A
    runner whose head states its sampler's distribution (``graphs.sampler_form``) can also draft
    for the sampling rule (:meth:`draft_sampled`)."""

    def __init__(self, runner, name: str = "draft"):
        if not (runner.takes_token_ids and runner.emits_tokens):
            raise ValueError("a draft model must run whole in one stage (embedding to head)")
        self.runner = runner
        self.name = name
        self.fed: dict[str, list[int]] = {}  # per sequence: the ids whose KV the runner holds

    @property
    def states_distributions(self) -> bool:
        return bool(getattr(self.runner, "_sampler_outputs", ()))

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        """Greedy drafts, or (``params`` sampled) each sampled with the target's draw for its token."""
        return self._draft(seq, ids, k, params, step, None)

    def draft_sampled(self, seq: str, ids: list[int], k: int, params, step: int = 0) -> tuple[list[int], list[Distribution]]:
        """Drafts for the sampling rule: draft ``j`` is drawn at ``uniform_draw(params.seed, step + j)``
        from the draft model's sampler cut to its ``DRAFT_SUPPORT`` likeliest tokens, and that
        distribution (the rule's ``q``) comes with it."""
        if not self.states_distributions:
            raise ValueError("this draft runner does not state its sampler's distribution (graphs.sampler_form)")
        stated: list[Distribution] = []

        def choose(j: int, u: float) -> int:
            out = self.runner.last_sampler
            stated.append(Distribution(out.ids[0], out.probs[0].astype(np.float64)).head(DRAFT_SUPPORT))
            return stated[-1].draw(u)

        return self._draft(seq, ids, k, params, step, choose), stated

    def _draft(self, seq: str, ids: list[int], k: int, params, step: int, choose) -> list[int]:
        from .sequence import uniform_draw
        from .stage_runner import SamplingBatch

        def sampling(j: int) -> SamplingBatch:
            if params is None or params.greedy:
                return SamplingBatch.greedy(1)
            return SamplingBatch(True, np.array([params.temperature], np.float32), np.array([params.top_k], np.int64),
                                 np.array([params.top_p], np.float32), np.array([uniform_draw(params.seed, step + j)], np.float32),
                                 want_sampler=choose is not None, min_p=np.array([params.min_p], np.float32))

        if k <= 0 or not ids:
            return []
        held = self.fed.get(seq, [])
        common = common_prefix(held, ids)
        if common == len(ids):  # nothing new to feed: take back the last one so a step has input
            common -= 1
        self.runner.rewind(seq, common)
        fed = list(ids[:common])
        out: list[int] = []
        feed = ids[common:]
        try:
            for j in range(k):
                batch = sampling(j)
                token = int(self.runner.run(seq, np.array([feed], np.int64), batch)[0])
                if choose is not None:
                    token = choose(j, float(batch.uniform[0]))
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


TIMING_PROMPT = 32  # tokens a timing sequence starts from


def time_draft_steps(drafter: ModelDrafter, reps: int = 8) -> float:
    """Seconds per greedy draft step of ``drafter`` after a short prompt (as calibration times a
    stage: measured where it will run); the timing sequence is forgotten after."""
    import time

    seq, ids = "__timing__", [int(t) % max(drafter.runner.vocab or 1, 1) for t in range(10, 10 + TIMING_PROMPT)]
    try:
        drafter.prime(seq, ids)
        drafter.draft(seq, ids, 1)  # the first step after a prefill warms what a prefill did not
        t0 = time.perf_counter()
        drafter.draft(seq, ids, reps)
        return (time.perf_counter() - t0) / reps
    finally:
        drafter.forget(seq)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class LookupThenModel:
    """Prompt lookup first, the draft model where the lookup finds nothing: free drafts where the
    output copies its input (code editing), the model's everywhere else. A lookup draft is
    certain given the ids, so for the sampling rule its distribution is that one token
    (``q(d) = 1``: kept with probability ``p(d)``, as common draws would keep it)."""

    def __init__(self, lookup: NgramDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model
        self.name = f"{lookup.name}+{model.name}"

    @property
    def states_distributions(self) -> bool:
        return self.model.states_distributions

    def draft(self, seq: str, ids: list[int], k: int, params=None, step: int = 0) -> list[int]:
        return self.lookup.draft(seq, ids, k) or self.model.draft(seq, ids, k, params, step)

    def draft_sampled(self, seq: str, ids: list[int], k: int, params, step: int = 0) -> tuple[list[int], list[Distribution]]:
        found = self.lookup.draft(seq, ids, k)
        if found:
            return found, [Distribution.of([t], [1.0]) for t in found]
        return self.model.draft_sampled(seq, ids, k, params, step)

    def prime(self, seq: str, ids: list[int]) -> None:
        self.model.prime(seq, ids)

    def forget(self, seq: str) -> None:
        self.model.forget(seq)
