"""Speculative decoding in the coordinator: which requests draft, how many tokens, and the drafter's thread.

The arithmetic is ``runtime.speculative``'s (acceptance, draft length, the drafters); this shell
runs a model drafter on a thread of its own (its steps are compute, the event loop must keep
answering heartbeats; the model itself may run on a drafter worker, ``cluster.drafters``), keeps
a draft length per request, counts what was drafted and kept, and (timed lengths) measures what
a pass costs: the stages' time by positions fed (``stepped``) and the drafter's calls.
While a verify pass travels the stages, a model drafter whose drafts are mostly kept drafts on
(``AHEAD_RATE``) as if the pass kept them all: when it did and the target's own next token is the
drafter's first guess, the next pass's drafts are ready (the draft model and the stages then
compute at the same time instead of taking turns; where the draft length grew meanwhile, it drafts
on after them).

Which requests speculate: those whose head controls are the same at every position (``logprobs``
and ``top`` are), greedy or sampled. A sampled one's drafts from a model drafter whose head
states its distribution go with that distribution, and the last stage applies the
speculative-sampling rule (``Proposal.q``); n-gram drafts, and requests that want logprobs, are
kept where they equal the target's seeded sample (see ``runtime.speculative``). A request with a
response format (a token mask whose provider can look ahead, ``api.structured.TokenMask``)
speculates with a mask per verified position (``masked``: the drafts as far as the grammar allows
them). Lazy grammars (tool calls), logit bias, presence/frequency or repeat penalties decode one
token per step: their controls change with every token in ways not looked ahead. Verify passes
travel alone, beside the lanes of other sequences.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ...runtime import controls
from ...runtime.sequence import SequenceState
from ...runtime.speculative import DraftLength, Drafter, Distribution, NgramDrafter, PassCosts, pass_costs

PER_POSITION_CONTROLS = ("adjust_ids", "repeat_ids", "targets")
AHEAD_RATE = 0.8  # draft the next pass during this one once this share of drafts is kept
TIMED_SAMPLES = 128  # recent passes and draft waits the pass costs are measured from
TIMED_RETRY_AFTER = 32  # timed: plain steps before a paused request tries one draft again (a probe costs a draft step)
PRIOR_AFTER = 8  # timed: passes after which a new request starts from the drafter's overall acceptance rate
CATCH_UP_WAIT_S = 0.05  # timed, before a plain step is measured: how long a pass waits for the drafter to take in a request's ids


@dataclass(frozen=True)
class Proposal:
    """Drafts for one verify pass; ``q``: the distribution each was drawn from, when the last
    stage is to apply the sampling rule (None: keep drafts equal to the target's own choice)."""

    tokens: list[int]
    q: tuple[Distribution, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def after(self, n: int, k: int) -> "Proposal":
        """Drafts ``n .. n + k`` of this one."""
        return Proposal(self.tokens[n:n + k], None if self.q is None else self.q[n:n + k])

    def then(self, more: "Proposal") -> "Proposal":
        """These drafts, then ``more`` (drafted after them)."""
        return Proposal(self.tokens + more.tokens, None if self.q is None or more.q is None else self.q + more.q)


@dataclass
class SpeculationStats:
    passes: int = 0  # verify passes
    by_rule: int = 0  # of them, passes the last stage decided by the sampling rule (sampled drafts with their distribution)
    drafted: int = 0  # tokens drafted into them
    kept: int = 0  # drafted tokens the target kept

    @property
    def acceptance(self) -> float:
        return self.kept / self.drafted if self.drafted else 0.0


class Speculation:
    """A drafter for the coordinator's requests. ``k_max``: most drafts per pass; ``worth``: see
    ``DraftLength`` (a free n-gram draft is worth trying further than a model's); ``timed``: each
    request's draft length weighs the measured costs of a pass (``runtime.speculative.PassCosts``:
    the drafter's calls, and the stages' time by positions fed, ``stepped``) against the drafts
    it expects kept, and drafts nothing where plain decoding is faster. Timed lengths follow the
    machine's speed, so a sampled request decided by the rule gives other (equally distributed)
    tokens run to run; acceptance-only lengths (``timed=False``) repeat a seed's tokens."""

    def __init__(self, drafter: Drafter, k_max: int = 8, worth: float | None = None, timed: bool = False):
        self.drafter = drafter
        self.k_max = k_max
        self.timed = timed
        self.step_samples: deque[tuple[int, float]] = deque(maxlen=TIMED_SAMPLES)  # (positions, seconds) of passes
        self.draft_samples: deque[tuple[int, float]] = deque(maxlen=TIMED_SAMPLES)  # (k, seconds of a drafter call for k drafts)
        # a model's draft costs a step of the draft model: each must be likelier to be kept
        self.worth = worth if worth is not None else (0.15 if isinstance(drafter, NgramDrafter) else 0.5)
        self.lengths: dict[str, DraftLength] = {}
        self.stats = SpeculationStats()
        self.pool = None if isinstance(drafter, NgramDrafter) else ThreadPoolExecutor(1, thread_name_prefix="draft")
        self._ahead: dict[str, tuple[list[int], Future]] = {}  # rid -> (ids it assumed, drafts after them)
        self.ahead_used = 0  # passes whose drafts were drafted during the pass before
        self._drafting: set[str] = set()  # requests whose last step was a drafted pass (the drafter is up to date with them)
        self._catching: dict[str, Future] = {}  # timed: a model drafter taking in a request's ids before it drafts (_caught_up)

    @staticmethod
    def eligible(state: SequenceState, head: dict) -> bool:
        masked = state.token_mask is not None
        return (not masked or hasattr(state.token_mask, "lookahead")) and not any(key in head for key in PER_POSITION_CONTROLS)

    @staticmethod
    def masked(state: SequenceState, head: dict, proposal: Proposal, vocab: int) -> tuple[Proposal, dict]:
        """A request with a response format: its drafts as far as the grammar allows them, and the
        head's fields with a mask per verified position (``masks``: the step's mask, then the one
        after each draft) in place of the step's one ``mask``."""
        if state.token_mask is None or not proposal or "mask" not in head:
            return proposal, head
        after = state.token_mask.lookahead(list(state.generated), proposal.tokens)
        proposal = proposal.after(0, len(after))
        if not proposal:
            return proposal, head
        fields = {key: value for key, value in head.items() if key != "mask"}
        return proposal, {**fields, "masks": [head["mask"]] + [controls.packed_mask(m, vocab) for m in after]}

    def by_rule(self, state: SequenceState, head: dict) -> bool:
        """Whether a sampled request's drafts go with their distribution (the sampling rule): a
        drafter that states it, and no logprobs (the head's are of its own sample, not the rule's)."""
        return not state.params.greedy and "logprobs" not in head and getattr(self.drafter, "states_distributions", False)

    def _draft(self, rid: str, ids: list[int], k: int, params, step: int, rule: bool) -> Proposal:
        t0 = time.perf_counter()
        if rule:
            tokens, q = self.drafter.draft_sampled(rid, ids, k, params, step)
            out = Proposal(tokens, tuple(q))
        else:
            out = Proposal(self.drafter.draft(rid, ids, k, params, step))
        if self.timed and rid in self._drafting:  # the drafter held the ids but the last few: a steady-state call
            self.draft_samples.append((k, time.perf_counter() - t0))
        return out

    def view(self, drafting=None) -> dict:
        """The status entry: what was drafted and kept, the measured pass costs and the draft
        length they give, and where the draft runs (``drafting``: ``cluster.drafting.Drafting``)."""
        costs = self.costs()
        out = {"drafter": self.drafter.name, "passes": self.stats.passes, "drafted": self.stats.drafted, "kept": self.stats.kept,
               "acceptance": round(self.stats.acceptance, 4), "drafted_ahead": self.ahead_used, "by_rule": self.stats.by_rule,
               "draft_length": "timed" if self.timed else "acceptance",
               "site": drafting.placed.site if drafting is not None else "coordinator",
               "k_now": {rid: length.k for rid, length in sorted(self.lengths.items())}}
        if costs is not None:
            out["costs_ms"] = {"step": round(costs.step_s * 1e3, 2), "position": round(costs.position_s * 1e3, 2),
                               "draft_step": round(costs.draft_step_s * 1e3, 2), "draft_call": round(costs.draft_call_s * 1e3, 2)}
        if drafting is not None:
            out["placement"] = drafting.view()
        return out

    @property
    def placed(self):
        """The model drafter that may run on a drafter worker (``cluster.draft_placement.PlacedDrafter``), or None."""
        from .draft_placement import PlacedDrafter

        for drafter in (self.drafter, getattr(self.drafter, "model", None)):
            if isinstance(drafter, PlacedDrafter):
                return drafter
        return None

    def costs(self) -> PassCosts | None:
        """The pass costs measured so far (None: not timed, or not measured yet)."""
        if not self.timed:
            return None
        return pass_costs(self.step_samples, self.draft_samples, AHEAD_RATE if self.pool is not None else None)

    def drafter_moved(self) -> None:
        """The draft now runs elsewhere: what drafts cost there is measured afresh."""
        self.draft_samples.clear()

    def stepped(self, positions: int, wall_s: float) -> None:
        """A decode step (1 position) or verify pass (``positions``) of a speculating request took ``wall_s`` through the stages."""
        if self.timed and positions >= 1 and wall_s > 0:
            self.step_samples.append((positions, wall_s))

    def _length(self, rid: str) -> DraftLength:
        length = self.lengths.get(rid)
        if length is None:
            # Timed, a new request starts from what drafts got so far. Acceptance-only lengths start
            # every request from the same rate: a sampled request decided by the rule draws its
            # tokens pass by pass, so a start that followed the server's history would give a seed
            # other tokens after other requests (what the length becomes is then its own drafts' doing).
            rate = self.stats.acceptance if self.timed and self.stats.passes >= PRIOR_AFTER else 0.6
            length = self.lengths[rid] = DraftLength(k_max=self.k_max, worth=self.worth, rate=rate, costs=self.costs(),
                                                     retry_after=TIMED_RETRY_AFTER if self.timed else 16)
        return length

    async def propose(self, rid: str, state: SequenceState, room: int, rule: bool = False) -> Proposal:
        """Up to ``room`` drafted tokens to follow ``state``'s ids (none: decode one token);
        ``rule`` (see ``by_rule``): with the distribution each was drawn from."""
        length = self._length(rid)
        k = min(length.k, room)
        if k <= 0:
            length.update(0, 0, self.costs())  # a step without drafts (drafting paused, or no room)
            self._drafting.discard(rid)
            return Proposal([])
        if self.timed and self.pool is not None and rid not in self._drafting and not await self._caught_up(rid, state):
            return Proposal([])  # a plain step while the drafter takes in the tokens since it last drafted
        drafts = await self._propose(rid, state, k, length, rule)
        self._drafting.add(rid)  # from now on the drafter holds its ids: its calls are timed (_draft)
        return drafts

    async def _caught_up(self, rid: str, state: SequenceState) -> bool:
        """Whether a model drafter holds ``rid``'s ids (all but the last few) so a pass need not
        wait for it to take them in: after the prompt, or a pause of many steps, that is a prefill
        of the draft model, which would stall the pipeline for as long. Timed lengths start the
        prefill on the drafting thread and decode plain steps until it is done (waiting up to a
        plain step for it)."""
        future = self._catching.get(rid)
        if future is None:
            model = getattr(self.drafter, "model", self.drafter)  # a lookup drafter's model: the lookup needs no prefill
            future = self._catching[rid] = self.pool.submit(model.draft, rid, list(state.all_ids), 1)
        costs = self.costs()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), CATCH_UP_WAIT_S if costs is None else costs.step_s)
        except asyncio.TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - a failed prefill: the pass's own draft call reports or falls back
            pass
        self._catching.pop(rid, None)
        return True

    async def _propose(self, rid: str, state: SequenceState, k: int, length: DraftLength, rule: bool) -> Proposal:
        ids, params, step = list(state.all_ids), state.params, len(state.generated)
        if self.pool is None:
            return self._draft(rid, ids, k, params, step, rule)
        drafts = Proposal([])
        ahead = self._ahead.pop(rid, None)
        if ahead is not None:
            assumed, future = ahead
            guess = await asyncio.wrap_future(future)
            # every draft kept, and the target's next token guessed (a guess drafted for the other way of keeping is not used)
            if guess.tokens and ids == assumed + guess.tokens[:1] and (guess.q is not None) == rule:
                drafts = guess.after(1, k)
                self.ahead_used += 1
                if 0 < len(drafts) < k:  # the draft length grew since (every draft kept): draft on after the guess
                    more = await asyncio.get_running_loop().run_in_executor(
                        self.pool, self._draft, rid, ids + drafts.tokens, k - len(drafts), params, step + len(drafts), rule)
                    drafts = drafts.then(more)
        if not drafts:
            drafts = await asyncio.get_running_loop().run_in_executor(self.pool, self._draft, rid, ids, k, params, step, rule)
        if drafts and length.rate >= AHEAD_RATE:
            assumed = ids + drafts.tokens
            self._ahead[rid] = assumed, self.pool.submit(self._draft, rid, assumed, k + 1, params, step + len(drafts), rule)
        return drafts

    def prime(self, rid: str, state: SequenceState) -> None:
        """Let a model drafter take in the prompt on its thread while the pipeline prefills it
        (its first draft would otherwise begin with that prefill)."""
        if self.pool is not None and self._length(rid).k > 0:  # a request that starts paused takes it in when it first tries
            self.pool.submit(self.drafter.prime, rid, list(state.prompt_ids))

    def learn(self, rid: str, drafted: int, kept: int, by_rule: bool = False) -> None:
        self.stats.passes += 1
        self.stats.by_rule += by_rule
        self.stats.drafted += drafted
        self.stats.kept += kept
        if rid in self.lengths:
            self.lengths[rid].update(drafted, kept, self.costs())

    def forget(self, rid: str) -> None:
        self.lengths.pop(rid, None)
        self._drafting.discard(rid)
        self._catching.pop(rid, None)
        self._ahead.pop(rid, None)
        if self.pool is None:
            self.drafter.forget(rid)
        else:
            self.pool.submit(self.drafter.forget, rid)


def build_speculation(draft: str, target, k_max: int = 8, threads: int | None = None, home=None, timed: bool = True) -> Speculation:
    """``draft``: ``"ngram"`` (prompt lookup), a model (package name, directory or GGUF path) whose
    tokenizer is the target package's, run whole in this process, or ``"ngram+MODEL"`` (prompt
    lookup where it finds a match, the model elsewhere); ``timed``: see ``Speculation``.
    ``ValueError`` (one line) when the pair cannot work."""
    from ...runtime.speculative import LookupThenModel

    if draft == "ngram":
        return Speculation(NgramDrafter(), k_max, timed=timed)
    if draft.startswith("ngram+"):
        return Speculation(LookupThenModel(NgramDrafter(), _model_drafter(draft.removeprefix("ngram+"), target, threads, home)), k_max,
                           timed=timed)
    return Speculation(_model_drafter(draft, target, threads, home), k_max, timed=timed)


def _model_drafter(draft: str, target, threads: int | None, home):
    """The draft model, whole in this process, placeable on a drafter worker (``cluster.draft_placement``)."""
    from ...model.store import resolve
    from ...runtime.speculative import ModelDrafter
    from .draft_placement import PlacedDrafter

    package = resolve(draft, home=home) if home is not None else resolve(draft)
    if package.manifest.tokenizer != target.manifest.tokenizer:
        raise ValueError(f"draft model {package.name} has another tokenizer than {target.name}: drafts would be other tokens")
    runner = package.runner(0, len(package.manifest.units), threads=threads, sampler=True)  # its distribution: the rule's q
    return PlacedDrafter(ModelDrafter(runner, package.name), package)
