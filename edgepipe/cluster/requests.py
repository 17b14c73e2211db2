"""The token loop of every request (I/O): checks, wait for Up, one step per token, replay.

Per decode step the coordinator sends a sequence's token ids to the first stage and waits for
the sampled id that the last stage returns (``steps`` carries a step over the wire, in lanes). When the plan changes under a sequence and its KV was not
moved, it is rebuilt by replay (prompt as one prefill, then each generated token as its own
step) under a new sequence id ``<rid>.<epoch>``, so no token is lost. With speculative decoding
(``coord.speculation``) a decode step may carry drafted tokens: one verify pass through the
stages keeps the drafts the target agrees with plus its own next token, and the next frame tells
the stages to forget the rejected drafts' KV (``rewind``). Waits are bounded: a
request without progress for ``max_wait_s`` (or ``capacity_wait_s`` while the connected
workers cannot hold the model) fails with a one-line :class:`RequestFailed`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import AsyncIterator

from ..net.limits import KV_RESERVE_TOKENS
from ..runtime import controls
from ..runtime.sequence import GenerationParams, SequenceState, TextDelta
from ..runtime.speculative import accept_greedy
from . import checkpoints, measurements as M, scheduling, state as S
from .placement import Deployment
from .profiling import RUNTIME_OVERHEAD_BYTES
from .steps import PipelineBroken, RequestFailed, StepRecord, Steps, stop_if_cancelled

__all__ = ["MAX_WIRE_INT", "PipelineBroken", "RequestFailed", "Requests", "StepRecord"]

MAX_WIRE_INT = (1 << 31) - 1


class Requests:
    def __init__(self, coord, steps: Steps):
        self.coord = coord
        self.steps = steps
        self._ids = itertools.count(1)

    def new_sequence(self, prompt_ids: list[int], params: GenerationParams, decode_fn) -> SequenceState:
        """A sequence to ``stream``; ``ValueError`` (one line) when the request cannot run at all."""
        limit = self.coord.manifest.max_context
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the context of {limit} tokens")
        if not 0 <= params.top_k <= MAX_WIRE_INT:
            raise ValueError(f"top_k = {params.top_k} is out of range [0, {MAX_WIRE_INT}]")
        if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
            raise ValueError("temperature and top_p must be finite numbers")
        if not -(1 << 63) <= params.seed < (1 << 64):
            raise ValueError(f"seed = {params.seed} does not fit 64 bits")
        vocab = self.coord.manifest.config.get("vocab_size") or MAX_WIRE_INT
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary of {vocab}")
        return SequenceState(list(prompt_ids), params, decode_fn, self.coord.manifest.eos_ids)

    def lacking(self) -> str | None:
        """Why the connected workers cannot hold the model (None: they may)."""
        c = self.coord
        weights = sum(c.manifest.variant(u.index, c.settings.precision).weight_bytes for u in c.manifest.units)
        kv = sum(u.kv_bytes_per_token for u in c.manifest.units) * min(KV_RESERVE_TOKENS, c.manifest.max_context)
        return scheduling.shortfall(c.cluster, weights, kv, RUNTIME_OVERHEAD_BYTES, c.clock())

    def replay_estimate_s(self) -> float:
        """Rough time to rebuild every live sequence's KV of the active plan by replay: one frame
        per position, pipelined, each about a decode step's wall time over the stages."""
        c = self.coord
        dep = c.cluster.active
        positions = sum(q.kv_len for q in c.cluster.requests.values() if dep is not None and q.plan == dep.plan_id)
        steps = sorted(wall for fed, wall in c.recent_steps if fed == 1)
        return positions * (steps[len(steps) // 2] / len(dep.stages) if steps and dep else 0.01)

    async def stream(self, state: SequenceState, rid: str | None = None) -> AsyncIterator[TextDelta]:
        """Run one sequence to its end, yielding text as it is produced."""
        c = self.coord
        rid = rid or f"r{next(self._ids)}"
        epoch, fed_plan = 0, None  # fed_plan: plan whose workers hold this sequence's KV
        sent_plan = None  # plan the current seq's latest step went to (its KV is there, token or not)
        seq = f"{rid}.{epoch}"
        spec = getattr(c, "speculation", None)
        rewind = False  # the stages hold drafts the last verify rejected
        c.emit(S.RequestStarted(rid, len(state.prompt_ids) + state.params.max_tokens))
        try:
            paused_at, broken, last_progress, why = None, 0, c.clock(), ""
            while not state.finished:
                step = len(state.generated)
                dep = await self.wait_up(last_progress)
                moved_to = c.cluster.requests[rid].migrated_to if rid in c.cluster.requests else None
                nxt = scheduling.next_feed(fed_plan, dep.plan_id, moved_to, state.prompt_ids, state.generated)
                info = c.cluster.requests.get(rid)
                resume = checkpoints.resume_point(info.resume if info else None, dep.plan_id, len(state.prompt_ids),
                                                  len(state.all_ids)) if nxt.fed_plan != dep.plan_id else None
                if nxt.new_epoch or resume is not None:  # the plan changed under us: rebuild KV by replay
                    if fed_plan is not None:
                        await self.steps.drop(seq, fed_plan)
                    epoch += 1
                    seq, sent_plan = resume.seq if resume else f"{rid}.{epoch}", None
                fed_plan, feed, replay_from = nxt.fed_plan, nxt.feed, nxt.replay_from
                if resume is not None:  # the spare holds its KV up to a checkpoint: replay only what came after
                    c.checkpoints.resumed(resume)
                    c.event("resume", request=rid, position=resume.position, replayed=len(state.all_ids) - resume.position)
                    fed_plan, feed = dep.plan_id, state.all_ids[resume.position:]
                    replay_from = 1 if len(feed) > 1 else None  # every token after it as its own decode step
                if len(feed) > 1:  # a prefill or a replay: a sequence whose stages hold no rejected drafts
                    rewind = False
                if resume is not None:  # a holder may hold more of it (a round of copies was under way): forget the rest
                    rewind = True
                try:
                    head = controls.step_fields(state, self.coord.manifest.config.get("vocab_size") or 0, len(feed) > 1)
                except ValueError as exc:  # the token mask provider's answer cannot be used
                    raise RequestFailed(str(exc).splitlines()[0] if str(exc) else "bad token mask") from None
                kv_start = len(state.all_ids) - len(feed)
                proposal = None
                if spec is not None and not state.generated and spec.eligible(state, head):
                    spec.prime(rid, state)  # the drafter prefills beside the pipeline
                if spec is not None and replay_from is None and len(feed) == 1 and spec.eligible(state, head):
                    room = min(state.params.max_tokens - len(state.generated) - 1, c.manifest.max_context - len(state.all_ids) - 2)
                    proposal = await spec.propose(rid, state, room, rule=spec.by_rule(state, head))
                    proposal, head = spec.masked(state, head, proposal, self.coord.manifest.config.get("vocab_size") or 0)
                drafts = proposal.tokens if proposal else []
                sent_plan = dep.plan_id
                try:
                    token, record = await self.steps.step(dep, seq, step, feed + drafts, state.params, rid, replay_from, head,
                                                          kv_start=kv_start, verify=bool(drafts), rewind=rewind,
                                                          draft_q=proposal.q if drafts else None)
                except PipelineBroken as exc:
                    why = str(exc)
                    if c.clock() - last_progress >= c.settings.max_wait_s:
                        raise RequestFailed(f"no token for {c.clock() - last_progress:.0f} s: {why}") from None
                    if paused_at is None:
                        paused_at = c.clock()
                        c.event("pause", request=rid, step=step, why=why)
                    fed_plan, broken = -1, broken + 1
                    # Stages before the failure may have taken the step: its KV there is no longer
                    # known to be whole, so a move that brought it is void and the retry replays.
                    c.emit(S.KvMoved(rid, None))
                    if resume is not None:  # nor is the checkpoint it resumed from
                        c.emit(S.CheckpointVoid(rid, why))
                    # Always yield before retrying: a send to a closed channel fails without
                    # awaiting, and the task that takes the dead worker out must get to run.
                    await asyncio.sleep(min(0.01 * broken, 0.25))
                    continue
                broken, last_progress = 0, c.clock()
                if paused_at is not None:
                    c.event("recovered", request=rid, step=step, seconds=round(c.clock() - paused_at, 3), plan=dep.plan_id)
                    paused_at = None
                fed_plan = dep.plan_id
                tokens, entries = [token], [record.logprobs]
                if drafts:
                    tokens = accept_greedy(drafts, record.verified)
                    entries = record.logprobs[:len(tokens)] if isinstance(record.logprobs, list) else [None] * len(tokens)
                    spec.learn(rid, len(drafts), len(tokens) - 1, by_rule=proposal.q is not None)
                    record.tokens_out = len(tokens)
                rewind = bool(drafts) and len(tokens) < len(drafts) + 1  # the stages hold rejected drafts
                c.emit(S.RequestFed(rid, seq, dep.plan_id, len(state.all_ids) + len(tokens) - 1))
                await c.checkpoints.after_step(rid, seq, dep, len(state.prompt_ids))
                if head.get("logprobs") and record.logprobs is None:
                    raise RequestFailed("the last stage returned no logprobs (a worker older than logprobs)")
                if "targets" in head:
                    state.prompt_logprobs = controls.prompt_from_wire(state.prompt_ids, record.logprobs, state.params.top_logprobs)
                elif state.params.prompt_logprobs and state.prompt_logprobs is None:
                    state.prompt_logprobs = [None] * len(state.prompt_ids[:1])  # a one-token prompt: nothing before it
                self._learn(dep, record)
                if spec is not None and replay_from is None and len(feed) == 1:
                    spec.stepped(len(feed) + len(drafts), record.wall_s)  # what a pass of this many positions costs (timed draft length)
                c.on_step(record)
                for token, entry in zip(tokens, entries):
                    yield state.push(token, controls.from_wire(token, entry, state.params.top_logprobs))
                    if state.finished:
                        break
        finally:
            if spec is not None:
                spec.forget(rid)
            c.emit(S.RequestEnded(rid))
            c.checkpoints.sweep()  # its checkpoint on the spare goes
            self.steps.leave(rid)
            # Cancelled callers cannot await, so clean up in a task of its own.
            c.spawn(self.steps.finish(seq, sent_plan))

    async def wait_up(self, since: float) -> Deployment:
        """The active plan once Up; fails (one line) when the wait exceeds its bound."""
        c = self.coord
        waits = scheduling.WaitSettings(c.settings.capacity_wait_s, c.settings.max_wait_s)
        while True:
            if c.stopped:
                raise RequestFailed("the coordinator stopped")
            if not c.deployer.gate.is_set():
                await c.deployer.gate.wait()
            if c.cluster.active is not None and c.up.is_set() and c.deployer.gate.is_set():
                return c.cluster.active
            verdict = scheduling.wait_verdict(c.cluster, c.clock() - since, self.lacking(), waits)
            if verdict is not None:
                raise RequestFailed(verdict)
            try:
                await asyncio.wait_for(c.up.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            stop_if_cancelled()

    def _learn(self, dep: Deployment, record: StepRecord) -> None:
        """Decode steps (one position) refine each worker's measured speed."""
        ranges = {s.worker_id: (s.start, s.end) for s in dep.stages}
        for entry in record.timings if record.first_in_batch else ():
            worker, compute, positions = entry[0], entry[1], entry[2]
            batch = entry[4] if len(entry) > 4 else 1
            if positions == 1 and worker in ranges:
                self.coord.measure(M.StageStep(worker, *ranges[worker], compute, batch))
        if record.first_in_batch and record.tokens_in == 1 and self.coord.requests_in_flight == 1:  # what hops took (profiling)
            self.coord.measure(M.StepObserved(tuple((s.worker_id, s.start, s.end) for s in dep.stages), record.wall_s,
                                              tuple(map(tuple, record.timings))))
        self.coord.recent_steps.append((record.tokens_in, record.wall_s))
