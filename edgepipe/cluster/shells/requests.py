"""The token loop of every request (I/O): checks, wait for Up, one step per token, replay.

Per decode step the coordinator sends a sequence's token ids to the first stage and waits for
the sampled id that the last stage returns (``steps`` carries a step over the wire, in lanes).
Where a request's loop stands is state (``state.Progress``), and what comes next is decided
from it (``rules.progress``): resume or replay, and what a step's outcome makes of it. When the
plan changes under a sequence and its KV was not moved, it is rebuilt by replay (prompt as one
prefill, then each generated token as its own step; from a checkpoint on the spare, only what
came after it) under a new sequence id ``<rid>.<epoch>``, so no token is lost. ``Requests`` is lent ``ports.Ports``
and its collaborators by name, not the coordinator. With speculative decoding (the
``speculation`` it is lent) a decode step may carry drafted tokens: one verify pass through the
stages keeps the drafts the target agrees with plus its own next token, and the next frame tells
the stages to forget the rejected drafts' KV (``rewind``). Waits are bounded: a
request without progress for ``max_wait_s`` (or ``capacity_wait_s`` while the connected
workers cannot hold the model) fails with a one-line :class:`RequestFailed`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ...net.limits import KV_RESERVE_TOKENS
from ...runtime import controls
from ...runtime.sequence import GenerationParams, SequenceState, TextDelta
from ...runtime.speculative import accept_greedy
from ..state import measurements as M, state as S
from ..rules import deploy, direct, progress, scheduling
from ..state.placement import Deployment
from .ports import Ports
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from .steps import PipelineBroken, RequestFailed, StepRecord, Steps, stop_if_cancelled

__all__ = ["MAX_WIRE_INT", "PipelineBroken", "RequestFailed", "Requests", "StepRecord"]

MAX_WIRE_INT = (1 << 31) - 1


def _length(state: SequenceState) -> int:
    """Its positions so far (``len(state.all_ids)``, without building that list at every token)."""
    return len(state.prompt_ids) + len(state.generated)


class Requests:
    def __init__(self, ports: Ports, steps: Steps, checkpoints, speculation, up: asyncio.Event, gate: asyncio.Event,
                 stopped: Callable[[], str | None], on_step: Callable[[StepRecord], None], recent_steps: deque):
        self.ports = ports
        self.steps = steps  # one step on the wire
        self.checkpoints = checkpoints  # ``checkpointing.Checkpoints``: KV copied to the spare after steps
        self.speculation = speculation  # the drafter (None: no speculative decoding)
        self.up, self.gate = up, gate  # set while the phase is Up; while no plan is being swapped in
        self.stopped, self.on_step = stopped, on_step
        self.recent_steps = recent_steps  # (positions fed, wall seconds) of recent steps, kept by the coordinator
        self._ids = itertools.count(1)

    def new_sequence(self, prompt_ids: list[int], params: GenerationParams, decode_fn) -> SequenceState:
        """A sequence to ``stream``; ``ValueError`` (one line) when the request cannot run at all."""
        limit = self.ports.package.manifest.max_context
        if len(prompt_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds the context of {limit} tokens")
        if not 0 <= params.top_k <= MAX_WIRE_INT:
            raise ValueError(f"top_k = {params.top_k} is out of range [0, {MAX_WIRE_INT}]")
        if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
            raise ValueError("temperature and top_p must be finite numbers")
        if not -(1 << 63) <= params.seed < (1 << 64):
            raise ValueError(f"seed = {params.seed} does not fit 64 bits")
        vocab = self.ports.package.manifest.config.get("vocab_size") or MAX_WIRE_INT
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary of {vocab}")
        return SequenceState(list(prompt_ids), params, decode_fn, self.ports.package.manifest.eos_ids)

    def needs(self) -> tuple[int, int]:
        """What the model needs of the workers: (weight bytes, KV bytes of the tokens a plan reserves)."""
        p = self.ports
        manifest = p.package.manifest
        state = p.state()  # as the workers keep it: the gguf form's own blocks and fp16 cache, not the `native` figures
        form = deploy.budget_form(state, manifest, p.settings.precision, state.workers)
        try:
            weights = sum(manifest.variant(u.index, form).weight_bytes for u in manifest.units)
        except KeyError:  # a form still being built (a tab's): the cluster's own meanwhile
            form = p.settings.precision
            weights = sum(manifest.variant(u.index, form).weight_bytes for u in manifest.units)
        kv = deploy.kv_bytes_per_unit(manifest, form)
        return weights, sum(kv) * min(KV_RESERVE_TOKENS, manifest.max_context)

    def lacking(self) -> str | None:
        """Why the connected workers cannot hold the model (None: they may)."""
        return scheduling.shortfall(self.ports.state(), *self.needs(), RUNTIME_OVERHEAD_BYTES, self.ports.clock())

    def replay_estimate_s(self) -> float:
        """Rough time to rebuild every live sequence's KV of the active plan by replay: one frame
        per position, pipelined, each about a decode step's wall time over the stages."""
        p = self.ports
        dep = p.state().active
        positions = sum(q.kv_len for q in p.state().requests.values() if dep is not None and q.plan == dep.plan_id)
        steps = sorted(wall for fed, wall in self.recent_steps if fed == 1)
        return positions * (steps[len(steps) // 2] / len(dep.stages) if steps and dep else 0.01)

    async def stream(self, state: SequenceState, rid: str | None = None) -> AsyncIterator[TextDelta]:
        """Run one sequence to its end, yielding text as it is produced. Where its token loop
        stands is state (``state.Progress``): each step is planned from it (``progress.plan_step``:
        resume or replay) and each outcome becomes its events and the next command
        (``progress.after_step``: go on, retry after a backoff, or fail)."""
        p = self.ports
        rid = rid or f"r{next(self._ids)}"
        spec = self.speculation
        settings = progress.ProgressSettings(p.settings.max_wait_s)
        p.emit(S.RequestStarted(rid, len(state.prompt_ids) + state.params.max_tokens, p.clock()))
        now = p.state().requests[rid].progress
        try:
            while not state.finished:
                step = len(state.generated)
                dep = await self.wait_up(p.state().requests[rid].progress.last_progress)
                planned = progress.plan_step(p.state(), rid, dep.plan_id, state.prompt_ids, state.generated)
                if planned.drop is not None:  # the plan changed under it: the old id's KV goes first
                    await self.steps.drop(*planned.drop)
                p.emit(planned.event)
                now = p.state().requests[rid].progress
                nxt, seq, rewind = planned.step, now.seq, planned.rewind
                feed, replay_from, resume = nxt.feed, nxt.replay_from, nxt.resume
                if resume is not None:  # the spare holds its KV up to a checkpoint: replay only what came after
                    self.checkpoints.resumed(resume)
                    p.note(S.NoteKind.RESUME, request=rid, position=resume.position, replayed=len(state.all_ids) - resume.position)
                try:
                    head = controls.step_fields(state, self.ports.package.manifest.config.get("vocab_size") or 0, len(feed) > 1)
                except ValueError as exc:  # the token mask provider's answer cannot be used
                    raise RequestFailed(str(exc).splitlines()[0] if str(exc) else "bad token mask") from None
                kv_start = _length(state) - len(feed)
                proposal = None
                if spec is not None and not state.generated and spec.eligible(state, head):
                    spec.prime(rid, state)  # the drafter prefills beside the pipeline
                if spec is not None and replay_from is None and len(feed) == 1 and spec.eligible(state, head):
                    room = min(state.params.max_tokens - len(state.generated) - 1, p.package.manifest.max_context - _length(state) - 2)
                    proposal = await spec.propose(rid, state, room, rule=spec.by_rule(state, head))
                    proposal, head = spec.masked(state, head, proposal, self.ports.package.manifest.config.get("vocab_size") or 0)
                drafts = proposal.tokens if proposal else []
                ahead = self.direct_grant(state, dep, head) if len(feed) == 1 and replay_from is None and not drafts and not rewind else 0
                try:
                    token, record = await self.steps.step(dep, seq, step, feed + drafts, state.params, rid, replay_from, head,
                                                          kv_start=kv_start, verify=bool(drafts), rewind=rewind,
                                                          draft_q=proposal.q if drafts else None, ahead=ahead,
                                                          stop=direct.stop_ids(state.params.ignore_eos, state.eos_ids) if ahead else None)
                except PipelineBroken as exc:
                    events, commands = progress.after_step(p.state(), rid, progress.Broke(step, str(exc)), p.clock(), settings)
                    for event in events:
                        p.emit(event)
                    match commands:
                        case (progress.Fail(why),):
                            raise RequestFailed(why) from None
                        case (progress.Retry(after_s),):
                            # Always yield before retrying: a send to a closed channel fails without
                            # awaiting, and the task that takes the dead worker out must get to run.
                            await asyncio.sleep(after_s)
                            continue
                    raise AssertionError(f"a broken step's commands: {commands!r}")
                tokens, entries = [token], [record.logprobs]
                if drafts:
                    tokens = accept_greedy(drafts, record.verified)
                    entries = record.logprobs[:len(tokens)] if isinstance(record.logprobs, list) else [None] * len(tokens)
                    spec.learn(rid, len(drafts), len(tokens) - 1, by_rule=proposal.q is not None)
                    record.tokens_out = len(tokens)
                rejected = bool(drafts) and len(tokens) < len(drafts) + 1  # the stages hold rejected drafts
                events, _ = progress.after_step(p.state(), rid, progress.Yielded(dep.plan_id, _length(state) + len(tokens) - 1, rejected),
                                                p.clock(), settings)
                for event in events:  # ends a pause
                    p.emit(event)
                if seq not in p.state().steps.ahead:  # its stage runs ahead of the count: no checkpoint of it meanwhile
                    await self.checkpoints.after_step(rid, seq, dep, len(state.prompt_ids))
                if head.get("logprobs") and record.logprobs is None:
                    raise RequestFailed("the last stage returned no logprobs (a worker older than logprobs)")
                if "targets" in head:
                    state.prompt_logprobs = controls.prompt_from_wire(state.prompt_ids, record.logprobs, state.params.top_logprobs)
                elif state.params.prompt_logprobs and state.prompt_logprobs is None:
                    state.prompt_logprobs = [None] * len(state.prompt_ids[:1])  # a one-token prompt: nothing before it
                self._learn(dep, record)
                if spec is not None and replay_from is None and len(feed) == 1:
                    spec.stepped(len(feed) + len(drafts), record.wall_s)  # what a pass of this many positions costs (timed draft length)
                self.on_step(record)
                for token, entry in zip(tokens, entries):
                    yield state.push(token, controls.from_wire(token, entry, state.params.top_logprobs))
                    if state.finished:
                        break
        finally:
            if spec is not None:
                spec.forget(rid)
            info = p.state().requests.get(rid)
            now = info.progress if info is not None else now
            p.emit(S.RequestEnded(rid))
            self.checkpoints.sweep()  # its checkpoint on the spare goes
            self.steps.leave(rid)
            # Cancelled callers cannot await, so clean up in a task of its own.
            p.spawn(self.steps.finish(now.seq, now.sent_plan))

    def direct_grant(self, state: SequenceState, dep: Deployment, head: dict) -> int:
        """Steps after this decode step that its stage may feed itself (``cluster.direct``; 0: none)."""
        p = self.ports
        limit = p.settings.direct_steps
        if limit <= 0:
            return 0
        cluster = p.state()
        left = min(state.params.max_tokens - len(state.generated) - 1, p.package.manifest.max_context - _length(state) - 1)
        return direct.grant(direct.Ask(limit, frozenset(head), len(dep.stages), dep.replicated,
                                       self.speculation is not None, self.checkpoints.enabled and cluster.spare is not None,
                                       len(cluster.requests) - 1, left))

    async def wait_up(self, since: float) -> Deployment:
        """The active plan once Up; fails (one line) when the wait exceeds its bound."""
        p = self.ports
        waits = scheduling.WaitSettings(p.settings.capacity_wait_s, p.settings.max_wait_s)
        while True:
            why = self.stopped()  # why the coordinator halted (falsy: it did not)
            if why:
                raise RequestFailed(why)
            if not self.gate.is_set():
                await self.gate.wait()
            if p.state().active is not None and self.up.is_set() and self.gate.is_set():
                return p.state().active
            verdict = scheduling.wait_verdict(p.state(), p.clock() - since, self.lacking(), waits)
            if verdict is not None:
                raise RequestFailed(verdict)
            try:
                await asyncio.wait_for(self.up.wait(), timeout=1.0)
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
                self.ports.measure(M.StageStep(worker, *ranges[worker], compute, batch))
        if record.first_in_batch and record.tokens_in == 1 and not record.direct and len(self.ports.state().requests) == 1:  # what hops took (profiling)
            self.ports.measure(M.StepObserved(tuple((s.worker_id, s.start, s.end) for s in dep.stages), record.wall_s,
                                              tuple(map(tuple, record.timings))))
        self.recent_steps.append((record.tokens_in, record.wall_s))
