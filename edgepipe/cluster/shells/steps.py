"""One step on the wire (I/O): frames out to the first stage, tokens back from the last.

A step is one sequence's next token: the token ids go to the plan's first stage in a FORWARD
frame (decode steps of several sequences share a frame: lanes, see ``batching``), and its token
comes back from the last stage. On a plan with replicated stages a sequence's frames go through
its route (``replicas``: a replica per stage, chosen at its first step there). What is in flight
is state (``ClusterState.steps``, ``step_book``, the lanes included): a step is asked for, waits
for its lane, is settled by a TOKEN frame, failed by an ERROR frame or a lost plan, timed out
(blaming a stage that dropped it) or given up through the coordinator's core (``core.handle``,
``step_path``), whose commands the executor (``executor``) carries out, those about steps by
calling back here; this shell keeps only the futures the requests await and the frames of steps
waiting for their lane, by step id. It sends the DROP that frees a
finished sequence's KV once nothing of it is left in the pipeline. Failures come back as
:class:`PipelineBroken` (retry on the next plan) or :class:`RequestFailed` (one line, final).
It is lent ``ports.Ports`` and its collaborators by name (the prefix cache, the executor, lose),
never the coordinator.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from ...net.channel import ChannelClosed
from ...net.messages import Drop, Error, Forward, Token
from ...net.protocol import Message
from ...runtime import controls
from ...runtime.sequence import GenerationParams, uniform_draw
from ...runtime.speculative import rule_fields
from ..rules import core, replicas
from ..state import step_book as SB
from ..state.batching import LaneItem
from ..state.events import Routed
from ..state.placement import Deployment
from .ports import Ports


class PipelineBroken(RuntimeError):
    """The plan a step ran on lost a worker; the step must be retried on a new plan."""


class RequestFailed(RuntimeError):
    """A request cannot continue (the message says why, in one line)."""


def stop_if_cancelled() -> None:
    """Before Python 3.12, ``asyncio.wait_for`` returns its result instead of raising when the
    cancellation and the result arrive in the same instant, and the cancel is lost: a request
    whose client went would run on, holding its slot. A task that was asked to stop stops here."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


@dataclass
class StepRecord:
    """What the metrics and profiler learn from one token."""

    rid: str
    tokens_in: int
    wall_s: float
    timings: list  # [[worker_id, compute_s, positions, bytes/elem, batch], ...]: one per stage, shared by a batch
    coordinator_s: float
    first_in_batch: bool = True  # the batch's other sequences carry the same timings: count stage times once
    logprobs: dict | list | None = None  # the head's logprobs entry for this token, when asked (see runtime.controls); a verify: one per position
    prefix_reused: int = 0  # prompt positions taken from the prefix cache (no stage computed them)
    verified: list[int] | None = None  # a verify step: the token the target chose after each position fed
    tokens_out: int = 1  # tokens the step yielded (a verify pass: the drafts kept + 1)
    direct: bool = False  # its stage fed it itself (the direct token path): no frame went out, its wall time is no round trip


@dataclass
class _OutStep:
    """A step on its way out: what goes into the frame, and the future its token resolves."""

    dep: Deployment
    step_id: int  # in ``ClusterState.steps`` while in flight
    first: str  # the worker its frame goes to (its route's first stage)
    item: dict  # the frame's batch entry: seq, step, rid, sampling[, partial: a replay frame whose token is not wanted]
    feed: list[int]
    fut: asyncio.Future
    sent_at: float = 0.0


class Steps:
    def __init__(self, ports: Ports, prefix, executor, lose: Callable[[str, str], Awaitable[None]]):
        self.ports = ports
        self.prefix = prefix  # ``prefix_cache.PrefixCaching``: the decision a prompt prefill carries
        self.executor = executor  # ``executor.Executor``: asks the core and carries out its commands (those of steps come back here)
        self.lose = lose  # takes out a worker whose channel closed
        self.waiters: dict[int, asyncio.Future] = {}  # step id -> the future its token resolves (the steps: ``ClusterState.steps``)
        self.outgoing: dict[int, _OutStep] = {}  # step id -> the frame of a decode step waiting for its lane

    # -- the core's step commands, as the executor carries them out --------------------------------
    def settle(self, step_id: int, result: core.StepResult) -> None:
        fut = self.waiters.pop(step_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    def fail(self, step_id: int, why: str, final: bool) -> None:
        fut = self.waiters.pop(step_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(RequestFailed(why) if final else PipelineBroken(why))

    def forget(self, step_id: int) -> None:
        """The step ended (timed out, given up): nobody waits for it any more."""
        self.waiters.pop(step_id, None)

    def send_batch(self, step_ids: tuple[int, ...]) -> None:
        """Send the decode steps a lane let go as one frame."""
        self.ports.spawn(self._send_forward([self.outgoing.pop(i) for i in step_ids if i in self.outgoing]))

    def _handle(self, given: core.Input) -> None:
        self.executor.handle(given)

    async def step(self, dep: Deployment, seq: str, step: int, feed: list[int], params: GenerationParams, rid: str,
                   replay_from: int | None = None, head: dict | None = None, kv_start: int | None = None,
                   verify: bool = False, rewind: bool = False, draft_q: tuple | None = None, ahead: int = 0, stop: list | None = None):
        """One step of one sequence: a decode step goes out with its lane, a prefill alone.

        ``head``: the step's logit controls and logprob requests (``controls.step_fields``).
        ``kv_start``: positions the stages must already hold for this sequence; each frame says
        where it starts (``pos``), so a stage that missed a frame refuses the next instead of
        computing on a cache with a hole in it. ``verify``: ``feed`` is the last token and drafts,
        and the head returns a token per position (``StepRecord.verified``); ``draft_q``: the
        distribution each draft was drawn from (a sampled request's model drafts): the head then
        applies the sampling rule and returns its tokens up to the first it rejected
        (``runtime.speculative.head_verdict``); ``rewind``: stages holding more than ``kv_start``
        positions (drafts the last verify rejected) forget them. ``ahead``: the stage may feed
        this decode step's next ``ahead`` steps itself (``cluster.direct``), stopping at the ids
        ``stop``, a sampled one with the draws of those steps (``uniforms``); a step it feeds is asked
        for here all the same, and no frame goes out for it."""
        p = self.ports
        t0 = p.clock()
        route = self.route(dep, rid)
        book = p.state().steps
        replaced = SB.of_seq(book, seq)
        if replaced is not None:  # a sequence has one step in flight: the older one is no longer awaited
            self.waiters.pop(replaced.step_id, None)
        fed = len(feed) == 1 and replay_from is None and not verify and SB.fed_by_stage(book, seq, step, dep.plan_id)
        step_id = book.next_id
        fut = self.waiters[step_id] = asyncio.get_running_loop().create_future()  # first: a token that came early settles it at once
        self._handle(core.StepAsked(seq, step, dep.plan_id, rid, tuple(route or dep.workers), t0))
        if fed:
            return await self._fed_step(dep, seq, step, rid, step_id, fut, t0)
        sampling = {**controls.wire_sampling(params, step), **(head or {})}
        if verify and not params.greedy:  # position i samples token step + i: its own seeded draw, as one step each would
            sampling["uniform"] = [uniform_draw(params.seed, step + i) for i in range(len(feed))]
            if draft_q is not None:
                sampling.update(rule_fields(feed[1:], list(draft_q), params.seed, step))
        item = {"seq": seq, "step": step, "rid": rid, "sampling": sampling, **({"verify": True} if verify else {}),
                **({"rewind": True} if rewind and kv_start is not None else {}),
                **({"ahead": ahead, "stop": list(stop or ())} if ahead > 0 and len(feed) == 1 and not verify and kv_start is not None else {}),
                **({"uniforms": controls.fed_uniforms(params, step, ahead)} if ahead > 0 and not params.greedy and len(feed) == 1
                   and not verify and kv_start is not None else {}),
                **({"route": list(route)} if route else {})}
        # A replay rebuilds KV exactly as first computed: the prompt as one prefill, then each later
        # token as its own decode step (one prefill over everything takes other kernel paths and
        # can flip a near-tie). Sent as separate frames, the stages work on them as a pipeline;
        # only the last frame's token comes back. In the verify form every position of a chunk
        # has a decode step's bits (graphs.verify_form), so the whole replay is one prefill.
        one_by_one = replay_from and not (p.settings.speculative and p.settings.replay_in_one_prefill)
        chunks = [feed[:replay_from]] + [[t] for t in feed[replay_from:]] if one_by_one else [feed]
        # A prompt prefill from position 0 may start from cached blocks (cluster.prefix). Prompt
        # logprobs need every position's logits: such a prefill saves blocks but reuses none.
        # Not on a plan with replicated stages: the cache knows the plan's blocks, not each replica's.
        decision = self.prefix.decide(dep, rid, chunks[0], reuse="targets" not in (head or {})) \
            if kv_start == 0 and len(feed) > 1 and not dep.replicated else None
        reused = decision.reused_positions if decision else 0
        if reused:
            chunks[0], kv_start = chunks[0][reused:], reused
        starts = [] if kv_start is None else [kv_start + sum(map(len, chunks[:i])) for i in range(len(chunks))]

        def at(i: int) -> dict:
            return {**({"pos": starts[i]} if starts else {}), **({"prefix": decision.wire()} if decision and i == 0 else {})}

        first = route[0] if route else dep.stages[0].worker_id
        out = _OutStep(dep, step_id, first, {**item, **at(len(chunks) - 1)}, chunks[-1], fut)
        reply = None
        try:
            if len(feed) == 1:
                # a micro-batch in flight per worker (replicas included: they compute side by side)
                self.outgoing[step_id] = out
                self._handle(SB.LaneAsked(LaneItem(rid, dep.plan_id, step_id, route), len(dep.stages)))
            else:
                self._handle(SB.LaneLeft(rid))  # a prefill travels alone; the sequence re-joins a lane after it
                for i, chunk in enumerate(chunks[:-1]):
                    await self._send_forward([_OutStep(dep, step_id, first, {**item, "partial": True, **at(i)}, chunk, fut)])
                await self._send_forward([out])
            # shield: a cancelled caller must leave the future for _finish to wait on
            reply: core.StepResult = await asyncio.wait_for(asyncio.shield(fut), timeout=p.settings.step_timeout_s)
        except BaseException as exc:
            if decision:  # some stages may have applied it and others not
                self.prefix.done(rid, ok=False)
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            self._handle(core.StepTimedOut(step_id, p.settings.step_timeout_s, p.clock()))  # it may blame a stage
            raise PipelineBroken(f"no token for {seq} step {step} within {p.settings.step_timeout_s} s") from None
        finally:
            if reply is None or not reply.fed:  # its stage feeds its next step: the lane is still out (re-formed when it comes back)
                self._handle(SB.LaneReturned(rid))
            self.outgoing.pop(step_id, None)  # still waiting for its lane: it will not go
        if decision:
            self.prefix.done(rid, ok=True)
        stop_if_cancelled()  # the token was taken, but its client is gone: the caller's finally drops the KV
        record = StepRecord(rid, len(feed), p.clock() - t0, reply.timings, coordinator_s=out.sent_at - t0 if out.sent_at else 0.0,
                            first_in_batch=reply.first, logprobs=reply.logprobs, prefix_reused=reused, verified=reply.verified)
        if verify and (record.verified is None or not 1 <= len(record.verified) <= len(feed)
                       or (draft_q is None and len(record.verified) != len(feed))):
            raise RequestFailed("the last stage did not verify the drafted tokens (a worker without speculative decoding)")
        return reply.token, record

    async def _fed_step(self, dep: Deployment, seq: str, step: int, rid: str, step_id: int, fut: asyncio.Future, t0: float):
        """A step its stage feeds itself: await its token (it may have come already), as a sent one's."""
        p = self.ports
        reply = None
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout=p.settings.step_timeout_s)
        except asyncio.TimeoutError:
            self._handle(core.StepTimedOut(step_id, p.settings.step_timeout_s, p.clock()))
            raise PipelineBroken(f"no token for {seq} step {step} within {p.settings.step_timeout_s} s") from None
        finally:
            if reply is None or not reply.fed:  # the run ended: its lane is back
                self._handle(SB.LaneReturned(rid))
        stop_if_cancelled()
        return reply.token, StepRecord(rid, 1, p.clock() - t0, reply.timings, 0.0, first_in_batch=reply.first, logprobs=reply.logprobs,
                                       direct=True)

    def route(self, dep: Deployment, rid: str) -> replicas.Route:
        """``rid``'s route on a plan with replicated stages, chosen (and recorded) at its first
        step there; () on a plan without replicas (its frames carry no route)."""
        if not dep.replicated:
            return ()
        p = self.ports
        route = replicas.routed(p.state().requests, dep, rid)
        if route is None:
            route = replicas.choose_route(dep, p.state().requests, rid)
            p.emit(Routed(rid, dep.plan_id, route))
        return route

    # -- replies (the core decides which step a frame settles or fails) ----------------------------------
    def tokens(self, worker_id: str, msg: Token) -> None:
        self._handle(core.TokenHeard(worker_id, msg, self.ports.clock()))

    def worker_error(self, worker_id: str, err: Error) -> None:
        self._handle(core.ErrorHeard(worker_id, err, self.ports.clock()))

    def lost(self, plan: int | None, why: str, final: bool = False) -> None:
        """Fail every step in flight on ``plan`` (None: on every plan): ``PipelineBroken(why)``, or
        ``RequestFailed(why)`` when ``final``."""
        self._handle(core.StepsLost(plan, why, self.ports.clock(), final))

    async def relay(self, target_id: str, link, msg: Message) -> None:
        try:
            await link.send(msg)
        except ChannelClosed:
            self.lost(None, f"relay to {target_id} failed")

    # -- sending ----------------------------------------------------------------------------------
    def leave(self, rid: str) -> None:
        """The sequence steps out of its lane (a prefill travels alone; a finished one is gone)."""
        self._handle(SB.LaneLeft(rid))

    async def _send_forward(self, steps: list[_OutStep]) -> None:
        """Send steps of one plan to its first stage as one frame (one batch at every stage)."""
        steps = [s for s in steps if not s.fut.done()]  # failed while waiting for its lane
        if not steps:
            return
        p, dep, first = self.ports, steps[0].dep, steps[0].first
        link = p.links().get(first)
        now = p.clock()
        for s in steps:
            s.sent_at = now
        try:
            msg = Forward(dep.plan_id, [s.item for s in steps]).to_message({"x": np.array([s.feed for s in steps], np.int64)})
            if link is None:
                raise ChannelClosed(f"worker {first} is gone")
            await link.send(msg)
        except ChannelClosed:
            if link is not None:
                p.spawn(self.lose(first, "disconnected"))
            self._fail_steps(steps, f"worker {first} is gone", final=False)
        except (ValueError, TypeError, OverflowError) as exc:  # a value the wire cannot carry: the request fails
            self._fail_steps(steps, f"cannot send the step: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", final=True)

    def _fail_steps(self, steps: list[_OutStep], why: str, final: bool) -> None:
        self._handle(core.StepsLost(None, why, self.ports.clock(), final, tuple(s.step_id for s in steps)))
        for s in steps:  # no longer in flight (timed out while its frame was on its way): nobody awaits it
            if not s.fut.done():
                s.fut.set_exception(RequestFailed(why) if final else PipelineBroken(why))

    async def finish(self, seq: str, plan: int | None) -> None:
        """Free a sequence's KV once no step of it is still in the pipeline."""
        p = self.ports
        flight = SB.of_seq(p.state().steps, seq)
        if flight is not None:  # a step in flight would re-create the KV after an early DROP
            fut = self.waiters.get(flight.step_id)
            try:
                if fut is not None:
                    await asyncio.wait_for(asyncio.shield(fut), timeout=p.settings.step_timeout_s)
            except (Exception, asyncio.CancelledError):
                pass
            self._handle(core.StepGivenUp(flight.step_id, p.clock()))  # nothing, if it ended meanwhile
            plan = flight.plan
        if plan is not None:
            await self.drop(seq, plan)

    async def drop(self, seq: str, plan: int) -> None:
        self._handle(core.DirectForgotten(seq))  # what its stage computed ahead of it goes with its KV
        active = self.ports.state().active
        dep = active if active and active.plan_id == plan else None
        links = self.ports.links()
        for wid in sorted(dep.workers if dep else links):
            link = links.get(wid)
            if link:
                try:
                    await link.send(Drop(seq).to_message())
                except ChannelClosed:
                    pass
