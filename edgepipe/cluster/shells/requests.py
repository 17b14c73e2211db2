"""The scheduler of every request's steps (I/O): checks, wait for Up, one step per token, replay.

One scheduler task decides for every sequence between steps at once (``progress.schedule``:
its next step on the usable plan, a wait, or a failure), starts each step as a task (``steps``
carries a step over the wire; decode steps of several sequences share a frame, in lanes), and
turns each step's outcome into events and what follows (``progress.after_step``: its tokens to
the caller, a retry after a backoff, or the end): schedule, output, update. A request's
``stream`` only hands on the text the scheduler produced. Where a request stands is state
(``state.Progress``), and what comes next is decided from it: resume or replay. When the
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


_END = object()  # a sequence's queue: its text is over


@dataclass
class _Live:
    """A running request as the scheduler keeps it: its sequence, the text it owes its caller,
    its step in flight (at most one), whether a retry's backoff runs and its progress as last read."""

    rid: str
    state: SequenceState
    out: asyncio.Queue  # TextDelta, then _END or the exception it failed with
    progress: S.Progress
    task: asyncio.Task | None = None
    resting: bool = False  # a retry's backoff is not over
    ended: bool = False


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
        self._live: dict[str, _Live] = {}  # the running requests, in arrival order
        self._returned: list[tuple[_Live, asyncio.Task]] = []  # steps that came back since the last decision
        self._wake = asyncio.Event()  # set: the scheduler looks again
        self._loop: asyncio.Task | None = None  # the scheduler (started by the first request)
        self.blocked = False  # the last decision found no usable plan

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

    # -- the scheduler: one decision for every sequence between steps ------------------------------
    async def stream(self, state: SequenceState, rid: str | None = None) -> AsyncIterator[TextDelta]:
        """Run one sequence to its end, yielding text as it is produced. The sequence joins the
        scheduler, which decides the next step of every sequence between steps at once
        (``progress.schedule``), carries each out as a task and turns its outcome into events and
        the next decision (``progress.after_step``); this generator only hands its text on. When
        the caller goes (cancelled, or the generator closed), the sequence ends at once: its
        step in flight is cancelled and its KV dropped once nothing of it is left in the pipeline."""
        live = self._join(state, rid or f"r{next(self._ids)}")
        try:
            while True:
                item = await live.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._end(live, None)  # a no-op once it ended; else its caller went

    def _join(self, state: SequenceState, rid: str) -> _Live:
        p = self.ports
        p.emit(S.RequestStarted(rid, len(state.prompt_ids) + state.params.max_tokens, p.clock()))
        live = self._live[rid] = _Live(rid, state, asyncio.Queue(), p.state().requests[rid].progress)
        if self._loop is None or self._loop.done():
            self._loop = p.spawn(self._run())
        self._wake.set()
        return live

    def usable_plan(self) -> Deployment | None:
        """The plan sequences step on now: the active one while it is Up and no plan is being
        swapped in (None: there is none)."""
        active = self.ports.state().active
        return active if active is not None and self.up.is_set() and self.gate.is_set() else None

    async def _run(self) -> None:
        """The scheduler: take the steps that came back, decide for every sequence between steps,
        start those steps; sleep until a step comes back, a sequence joins, a retry is due or
        (while sequences wait for a plan) the plan is usable or a second has passed."""
        failure: BaseException | None = None
        try:
            while True:
                self._wake.clear()
                self._tick()
                await self._sleep()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in the scheduler: every open request learns of it
            failure = exc
            raise
        finally:
            for live in list(self._live.values()):
                self._end(live, failure or RequestFailed(self.stopped() or "the coordinator stopped"))

    def _tick(self) -> None:
        p = self.ports
        settings = progress.ProgressSettings(p.settings.max_wait_s)
        returned, self._returned = self._returned, []
        for live, task in returned:  # update: each step's outcome, its events and what follows
            if live.task is task:
                live.task = None
            if not live.ended:
                self._settle(live, task, settings)
        now = p.clock()
        waiting = [live for live in self._live.values() if live.task is None and not live.ended and not live.resting]
        if not waiting:
            return
        dep, stopped = self.usable_plan(), self.stopped()
        lacking = self.lacking() if dep is None and not stopped else None
        self.blocked = dep is None
        decisions = progress.schedule(p.state(), tuple(progress.Waiting(w.rid, w.state.prompt_ids, w.state.generated) for w in waiting),
                                      dep.plan_id if dep is not None else None, stopped, lacking, now,
                                      scheduling.WaitSettings(p.settings.capacity_wait_s, p.settings.max_wait_s))
        for decision in decisions:  # carry out: a task per step
            live = self._live[decision.rid]
            match decision:
                case progress.StartStep(_, planned):
                    task = live.task = p.spawn(self._step(live, planned, dep))
                    task.add_done_callback(lambda t, live=live: self._came_back(live, t))
                case progress.FailRequest(_, why):
                    self._end(live, RequestFailed(why))
                case _:
                    raise AssertionError(f"not a scheduling decision: {decision!r}")

    def _rested(self, live: _Live) -> None:
        live.resting = False
        self._wake.set()

    def _came_back(self, live: _Live, task: asyncio.Task) -> None:
        self._returned.append((live, task))
        self._wake.set()

    def _settle(self, live: _Live, task: asyncio.Task, settings: progress.ProgressSettings) -> None:
        """A step's outcome: its tokens to the caller, or a retry after a backoff, or the end."""
        p = self.ports
        if task.cancelled():
            self._end(live, RequestFailed(self.stopped() or "its step was cancelled"))
            return
        if (exc := task.exception()) is not None:
            self._end(live, exc)
            return
        outcome = task.result()
        if isinstance(outcome, progress.Broke):
            events, commands = progress.after_step(p.state(), live.rid, outcome, p.clock(), settings)
            for event in events:
                p.emit(event)
            match commands:
                case (progress.Fail(why),):
                    self._end(live, RequestFailed(why))
                case (progress.Retry(after_s),):
                    # Always a wait before the retry: the task that takes the dead worker out must get to run.
                    live.resting = True
                    asyncio.get_running_loop().call_later(after_s, self._rested, live)
                case _:
                    raise AssertionError(f"a broken step's commands: {commands!r}")
            return
        state = live.state
        for token, entry in outcome:
            live.out.put_nowait(state.push(token, controls.from_wire(token, entry, state.params.top_logprobs)))
            if state.finished:
                break
        if state.finished:
            self._end(live, None)

    async def _sleep(self) -> None:
        if not self.blocked or not any(live.task is None and not live.resting for live in self._live.values()):
            await self._wake.wait()
            return
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._plan_usable())]
        try:
            await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        self.blocked = False

    async def _plan_usable(self) -> None:
        while not (self.up.is_set() and self.gate.is_set()):
            await (self.gate.wait() if self.up.is_set() else self.up.wait())

    def _end(self, live: _Live, outcome: BaseException | None) -> None:
        """The sequence ends (finished: ``outcome`` None; failed; or its caller went): its step in
        flight is cancelled, the request leaves the state, its KV goes once no step of it is left."""
        if live.ended:
            return
        live.ended = True
        self._live.pop(live.rid, None)
        if live.task is not None and not live.task.done():
            live.task.cancel()
        p, rid = self.ports, live.rid
        if self.speculation is not None:
            self.speculation.forget(rid)
        info = p.state().requests.get(rid)
        now = info.progress if info is not None and info.progress is not None else live.progress
        p.emit(S.RequestEnded(rid))
        self.checkpoints.sweep()  # its checkpoint on the spare goes
        self.steps.leave(rid)
        p.spawn(self.steps.finish(now.seq, now.sent_plan))
        live.out.put_nowait(outcome if outcome is not None else _END)

    async def _step(self, live: _Live, planned: progress.Planned, dep: Deployment):
        """Carry out one sequence's planned step (resume or replay, drafts, the direct path): the
        tokens it yielded with their logprobs entries, or ``progress.Broke``; ``RequestFailed``
        when the request cannot go on."""
        p, state, rid, spec = self.ports, live.state, live.rid, self.speculation
        step = len(state.generated)
        if planned.drop is not None:  # the plan changed under it: the old id's KV goes first
            await self.steps.drop(*planned.drop)
        p.emit(planned.event)
        now = live.progress = p.state().requests[rid].progress
        nxt, seq, rewind = planned.step, now.seq, planned.rewind
        feed, replay_from, resume = nxt.feed, nxt.replay_from, nxt.resume
        if resume is not None:  # the spare holds its KV up to a checkpoint: replay only what came after
            self.checkpoints.resumed(resume)
            p.note(S.NoteKind.RESUME, request=rid, position=resume.position, replayed=len(state.all_ids) - resume.position)
        vocab = p.package.manifest.config.get("vocab_size") or 0
        try:
            head = controls.step_fields(state, vocab, len(feed) > 1)
        except ValueError as exc:  # the token mask provider's answer cannot be used
            raise RequestFailed(str(exc).splitlines()[0] if str(exc) else "bad token mask") from None
        kv_start = _length(state) - len(feed)
        proposal = None
        if spec is not None and not state.generated and spec.eligible(state, head):
            spec.prime(rid, state)  # the drafter prefills beside the pipeline
        if spec is not None and replay_from is None and len(feed) == 1 and spec.eligible(state, head):
            room = min(state.params.max_tokens - len(state.generated) - 1, p.package.manifest.max_context - _length(state) - 2)
            proposal = await spec.propose(rid, state, room, rule=spec.by_rule(state, head))
            proposal, head = spec.masked(state, head, proposal, vocab)
        drafts = proposal.tokens if proposal else []
        ahead = self.direct_grant(state, dep, head) if len(feed) == 1 and replay_from is None and not drafts and not rewind else 0
        try:
            token, record = await self.steps.step(dep, seq, step, feed + drafts, state.params, rid, replay_from, head,
                                                  kv_start=kv_start, verify=bool(drafts), rewind=rewind,
                                                  draft_q=proposal.q if drafts else None, ahead=ahead,
                                                  stop=direct.stop_ids(state.params.ignore_eos, state.eos_ids) if ahead else None)
        except PipelineBroken as exc:
            return progress.Broke(step, str(exc))
        tokens, entries = [token], [record.logprobs]
        if drafts:
            tokens = accept_greedy(drafts, record.verified)
            entries = record.logprobs[:len(tokens)] if isinstance(record.logprobs, list) else [None] * len(tokens)
            spec.learn(rid, len(drafts), len(tokens) - 1, by_rule=proposal.q is not None)
            record.tokens_out = len(tokens)
        rejected = bool(drafts) and len(tokens) < len(drafts) + 1  # the stages hold rejected drafts
        events, _ = progress.after_step(p.state(), rid, progress.Yielded(dep.plan_id, _length(state) + len(tokens) - 1, rejected),
                                        p.clock(), progress.ProgressSettings(p.settings.max_wait_s))
        for event in events:  # ends a pause
            p.emit(event)
        live.progress = p.state().requests[rid].progress
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
        return list(zip(tokens, entries))

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
