"""One step on the wire (I/O): frames out to the first stage, tokens back from the last.

A step is one sequence's next token: the token ids go to the plan's first stage in a FORWARD
frame (decode steps of several sequences share a frame: lanes, see ``batching``), and its token
comes back from the last stage. On a plan with replicated stages a sequence's frames go through
its route (``replicas``: a replica per stage, chosen at its first step there). ``Steps`` owns what is in flight: the future of every pending
step, the lanes, the step timeout (and who to blame when it passes), and the DROP that frees a
finished sequence's KV once nothing of it is left in the pipeline. Failures come back as
:class:`PipelineBroken` (retry on the next plan) or :class:`RequestFailed` (one line, final).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from ..net.channel import ChannelClosed
from ..net.messages import Drop, Error, ErrorCode, Forward, Token
from ..net.protocol import Message
from ..runtime import controls
from ..runtime.sequence import GenerationParams, uniform_draw
from ..runtime.speculative import rule_fields
from . import membership, replicas
from .batching import LaneItem, Lanes
from .events import Routed
from .placement import Deployment


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


@dataclass
class _OutStep:
    """A step on its way out: what goes into the frame, and the future its token resolves."""

    dep: Deployment
    item: dict  # seq, step, rid, sampling[, partial: a replay frame whose token is not wanted]
    feed: list[int]
    fut: asyncio.Future
    sent_at: float = 0.0


class Steps:
    def __init__(self, coord):
        self.coord = coord
        self.pending: dict[str, tuple[int, int, asyncio.Future]] = {}  # seq -> (step, plan, future of its token)
        self.sent_on: dict[int, int] = {}  # plan -> steps sent on it (was a timed-out step alone on its plan?)
        self.lanes = Lanes(arm=self._arm_lane)

    async def step(self, dep: Deployment, seq: str, step: int, feed: list[int], params: GenerationParams, rid: str,
                   replay_from: int | None = None, head: dict | None = None, kv_start: int | None = None,
                   verify: bool = False, rewind: bool = False, draft_q: tuple | None = None):
        """One step of one sequence: a decode step goes out with its lane, a prefill alone.

        ``head``: the step's logit controls and logprob requests (``controls.step_fields``).
        ``kv_start``: positions the stages must already hold for this sequence; each frame says
        where it starts (``pos``), so a stage that missed a frame refuses the next instead of
        computing on a cache with a hole in it. ``verify``: ``feed`` is the last token and drafts,
        and the head returns a token per position (``StepRecord.verified``); ``draft_q``: the
        distribution each draft was drawn from (a sampled request's model drafts): the head then
        applies the sampling rule and returns its tokens up to the first it rejected
        (``runtime.speculative.head_verdict``); ``rewind``: stages holding more than ``kv_start``
        positions (drafts the last verify rejected) forget them."""
        c = self.coord
        t0 = c.clock()
        route = self.route(dep, rid)
        on_path = route or dep.workers
        computed_before = membership.computed_counts(c.cluster, on_path)
        others_in_flight = any(p[1] == dep.plan_id for other, p in self.pending.items() if other != seq)
        self.sent_on[dep.plan_id] = sent_before = self.sent_on.get(dep.plan_id, 0) + 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[seq] = (step, dep.plan_id, fut)
        sampling = {**controls.wire_sampling(params, step), **(head or {})}
        if verify and not params.greedy:  # position i samples token step + i: its own seeded draw, as one step each would
            sampling["uniform"] = [uniform_draw(params.seed, step + i) for i in range(len(feed))]
            if draft_q is not None:
                sampling.update(rule_fields(feed[1:], list(draft_q), params.seed, step))
        item = {"seq": seq, "step": step, "rid": rid, "sampling": sampling, **({"verify": True} if verify else {}),
                **({"rewind": True} if rewind and kv_start is not None else {}),
                **({"route": list(route)} if route else {})}
        # A replay rebuilds KV exactly as first computed: the prompt as one prefill, then each later
        # token as its own decode step (one prefill over everything takes other kernel paths and
        # can flip a near-tie). Sent as separate frames, the stages work on them as a pipeline;
        # only the last frame's token comes back. In the verify form every position of a chunk
        # has a decode step's bits (graphs.verify_form), so the whole replay is one prefill.
        one_by_one = replay_from and not (c.settings.speculative and c.settings.replay_in_one_prefill)
        chunks = [feed[:replay_from]] + [[t] for t in feed[replay_from:]] if one_by_one else [feed]
        # A prompt prefill from position 0 may start from cached blocks (cluster.prefix). Prompt
        # logprobs need every position's logits: such a prefill saves blocks but reuses none.
        # Not on a plan with replicated stages: the cache knows the plan's blocks, not each replica's.
        decision = c.prefix.decide(dep, rid, chunks[0], reuse="targets" not in (head or {})) \
            if kv_start == 0 and len(feed) > 1 and not dep.replicated else None
        reused = decision.reused_positions if decision else 0
        if reused:
            chunks[0], kv_start = chunks[0][reused:], reused
        starts = [] if kv_start is None else [kv_start + sum(map(len, chunks[:i])) for i in range(len(chunks))]

        def at(i: int) -> dict:
            return {**({"pos": starts[i]} if starts else {}), **({"prefix": decision.wire()} if decision and i == 0 else {})}

        out = _OutStep(dep, {**item, **at(len(chunks) - 1)}, chunks[-1], fut)
        try:
            if len(feed) == 1:
                # a micro-batch in flight per worker (replicas included: they compute side by side)
                self._go(self.lanes.submit(LaneItem(rid, dep.plan_id, out, route), len(dep.stages)))
            else:
                self._go(self.lanes.leave(rid))  # a prefill travels alone; the sequence re-joins a lane after it
                for i, chunk in enumerate(chunks[:-1]):
                    await self._send_forward([_OutStep(dep, {**item, "partial": True, **at(i)}, chunk, fut)])
                await self._send_forward([out])
            # shield: a cancelled caller must leave the future for _finish to wait on
            reply = await asyncio.wait_for(asyncio.shield(fut), timeout=c.settings.step_timeout_s)
        except BaseException as exc:
            if decision:  # some stages may have applied it and others not
                c.prefix.done(rid, ok=False)
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            if self.pending.get(seq, (0, 0, None))[2] is fut:
                del self.pending[seq]
            alone = not others_in_flight and self.sent_on.get(dep.plan_id) == sent_before
            idle = membership.idle_stage(c.cluster, on_path, computed_before, t0, alone)
            if idle is not None:
                c.spawn(c.quarantine(idle, f"computed nothing for {seq} step {step} in {c.settings.step_timeout_s} s "
                                           f"while answering pings"))
            raise PipelineBroken(f"no token for {seq} step {step} within {c.settings.step_timeout_s} s") from None
        finally:
            self._go(self.lanes.returned(rid))
        if decision:
            c.prefix.done(rid, ok=True)
        stop_if_cancelled()  # the token was taken, but its client is gone: the caller's finally drops the KV
        record = StepRecord(rid, len(feed), c.clock() - t0, reply.get("timings", []),
                            coordinator_s=out.sent_at - t0 if out.sent_at else 0.0, first_in_batch=reply.get("first", True),
                            logprobs=reply.get("logprobs"), prefix_reused=reused, verified=reply.get("verified"))
        if verify and (record.verified is None or not 1 <= len(record.verified) <= len(feed)
                       or (draft_q is None and len(record.verified) != len(feed))):
            raise RequestFailed("the last stage did not verify the drafted tokens (a worker without speculative decoding)")
        return int(reply["token"]), record

    def route(self, dep: Deployment, rid: str) -> replicas.Route:
        """``rid``'s route on a plan with replicated stages, chosen (and recorded) at its first
        step there; () on a plan without replicas (its frames carry no route)."""
        if not dep.replicated:
            return ()
        c = self.coord
        route = replicas.routed(c.cluster.requests, dep, rid)
        if route is None:
            route = replicas.choose_route(dep, c.cluster.requests, rid)
            c.emit(Routed(rid, dep.plan_id, route))
        return route

    # -- replies ----------------------------------------------------------------------------------
    def tokens(self, worker_id: str, msg: Token) -> None:
        dep = self.coord.cluster.active
        if dep is not None and dep.plan_id == msg.plan and not replicas.last_stage(dep, worker_id):
            self.coord.event("ignored", worker=worker_id, why=f"token frame for plan {msg.plan} from a stage that is not its last")
            return
        logprobs = msg.logprobs or [None] * len(msg.tokens)
        verified = msg.verified or [None] * len(msg.tokens)
        for i, (item, token) in enumerate(zip(msg.batch, msg.tokens)):
            self._resolve(item["seq"], item["step"], msg.plan,
                          {"token": token, "timings": msg.timings, "first": i == 0, "logprobs": logprobs[i], "verified": verified[i]})

    def worker_error(self, worker_id: str, err: Error) -> None:
        entry = self.pending.get(err.seq) if err.seq else None
        if entry is None or (err.step is not None and err.step != entry[0]):
            return
        del self.pending[err.seq]
        if err.code is ErrorCode.CORRUPT_INPUT:  # the previous stage sent garbage: never served, retried on a new plan
            self.coord.event("invalid_frame", worker=worker_id, why=err.message)
        exc = PipelineBroken(err.message) if err.retryable else RequestFailed(f"worker {worker_id}: {err.message}")
        if not entry[2].done():
            entry[2].set_exception(exc)

    def _resolve(self, seq: str, step: int, plan: int, reply: dict) -> None:
        entry = self.pending.get(seq)
        if entry and entry[0] == step and entry[1] == plan and not entry[2].done():
            del self.pending[seq]
            entry[2].set_result(reply)

    def fail_plan(self, plan: int, exc: Exception) -> None:
        self._fail(lambda p: p == plan, exc)

    def fail_all(self, exc: Exception) -> None:
        self._fail(lambda p: True, exc)

    def _fail(self, which, exc: Exception) -> None:
        for seq, (step, plan, fut) in list(self.pending.items()):
            if which(plan):
                del self.pending[seq]
                if not fut.done():
                    fut.set_exception(exc)

    async def relay(self, target_id: str, link, msg: Message) -> None:
        try:
            await link.send(msg)
        except ChannelClosed:
            self.fail_all(PipelineBroken(f"relay to {target_id} failed"))

    # -- sending ----------------------------------------------------------------------------------
    def leave(self, rid: str) -> None:
        """The sequence steps out of its lane (a prefill travels alone; a finished one is gone)."""
        self._go(self.lanes.leave(rid))

    def _go(self, batches: list[list[LaneItem]]) -> None:
        for batch in batches:
            self.coord.spawn(self._send_forward([item.payload for item in batch]))

    def _arm_lane(self, index: int, departure: int) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.coord.settings.lane_wait_s, lambda: self._go(self.lanes.expire(index, departure)))

    async def _send_forward(self, steps: list[_OutStep]) -> None:
        """Send steps of one plan to its first stage as one frame (one batch at every stage)."""
        steps = [s for s in steps if not s.fut.done()]  # failed while waiting for its lane
        if not steps:
            return
        c, dep = self.coord, steps[0].dep
        first = steps[0].item["route"][0] if "route" in steps[0].item else dep.stages[0].worker_id
        link = c.links.get(first)
        now = c.clock()
        for s in steps:
            s.sent_at = now
        try:
            msg = Forward(dep.plan_id, [s.item for s in steps]).to_message({"x": np.array([s.feed for s in steps], np.int64)})
            if link is None:
                raise ChannelClosed(f"worker {first} is gone")
            await link.send(msg)
        except ChannelClosed:
            if link is not None:
                c.spawn(c.lose(first, "disconnected"))
            self._fail_steps(steps, PipelineBroken(f"worker {first} is gone"))
        except (ValueError, TypeError, OverflowError) as exc:  # a value the wire cannot carry: the request fails
            self._fail_steps(steps, RequestFailed(f"cannot send the step: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"))

    def _fail_steps(self, steps: list[_OutStep], exc: Exception) -> None:
        for s in steps:
            if self.pending.get(s.item["seq"], (None, None, None))[2] is s.fut:
                del self.pending[s.item["seq"]]
            if not s.fut.done():
                s.fut.set_exception(exc)

    async def finish(self, seq: str, plan: int | None) -> None:
        """Free a sequence's KV once no step of it is still in the pipeline."""
        entry = self.pending.get(seq)
        if entry is not None:  # a step in flight would re-create the KV after an early DROP
            try:
                await asyncio.wait_for(asyncio.shield(entry[2]), timeout=self.coord.settings.step_timeout_s)
            except (Exception, asyncio.CancelledError):
                pass
            if self.pending.get(seq) is entry:
                self.pending.pop(seq, None)
            plan = entry[1]
        if plan is not None:
            await self.drop(seq, plan)

    async def drop(self, seq: str, plan: int) -> None:
        c = self.coord
        dep = c.cluster.active if c.cluster.active and c.cluster.active.plan_id == plan else None
        for wid in sorted(dep.workers if dep else c.links):
            link = c.links.get(wid)
            if link:
                try:
                    await link.send(Drop(seq).to_message())
                except ChannelClosed:
                    pass
