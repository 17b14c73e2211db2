"""The coordinator's end of every worker's control channel (I/O): hello, frames in, heartbeats out.

A worker connects with HELLO and is refused (one line, ``ErrorCode.REFUSED``) or welcomed and
read until its channel closes. Every frame it sends is checked (``net.messages.parse``,
``net.validate``) before anything uses it: a bad one closes the channel, never the coordinator.
Frames are routed to their owner (tokens and errors to ``steps``; LOADED where the core says,
``core.LoadAnswered``: a LOAD's waiter, the KV migration, the checkpoints; pongs into the state).
Every ``heartbeat_s`` the core gets a ``HeartbeatDue`` (``membership.beat``: suspect, lose,
abandon a plan whose stage went silent; then ``PingAll``). Heartbeats, frames heard, pongs and
LOADED are inputs of the coordinator's core, handed to the one executor (``executor``), which
carries out the commands; the two that touch the channels come back here (``answer_load``,
``ping_all``). It is lent ``ports.Ports`` and the few collaborators it hands frames to, by
name; never the coordinator.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Awaitable, Callable

from ...net import auth, validate
from ...net.channel import Channel, ChannelClosed
from ...net.messages import ErrorCode, Hello, Ping, Welcome, parse
from ...net.protocol import Message, MessageType as T, ProtocolError, decode, error_frame
from ..rules import core, deploy
from ..state import measurements as M, state as S
from .ports import Ports
from .views import Link


class Connections:
    def __init__(self, ports: Ports, executor, calibrator, steps, requests, lose: Callable[..., Awaitable[None]],
                 stopped: Callable[[], bool], drafting=None):
        self.ports = ports
        self.drafting = drafting  # drafter workers (``cluster.drafting``; None: no draft model here)
        self.calibrator = calibrator  # told of each join
        self.variants = calibrator.variants  # builds the form of the file's own model a newcomer runs
        self.executor = executor  # ``executor.Executor``: heartbeats, frames heard, pongs and LOADED go to the core through it
        self.steps = steps  # tokens, errors and relays
        self.requests = requests  # capacity (``lacking``) and the replay estimate an abandon weighs
        self.lose, self.stopped = lose, stopped  # takes a worker out (``Coordinator.lose``); the coordinator is stopping

    def answer_load(self, worker_id: str, reply) -> None:
        """Hand a LOADED to whoever awaits ``worker_id``'s LOAD of its plan (``core.AnswerLoad``; none: a late answer, dropped)."""
        link = self.ports.links().get(worker_id)
        fut = link.loads.pop(reply.plan, None) if link is not None else None
        if fut and not fut.done():
            fut.set_result(reply)

    async def ping_all(self, now: float) -> None:
        """Ping every connected worker (``core.PingAll``); one whose channel closed is taken out."""
        p = self.ports
        for wid, link in list(p.links().items()):
            try:
                await link.send(Ping(now).to_message())
            except ChannelClosed:
                p.spawn(self.lose(wid, "disconnected"))

    async def attach(self, channel: Channel) -> None:
        """Serve one worker's control channel until it closes (called by the API endpoint)."""
        p = self.ports
        try:
            hello = decode(await asyncio.wait_for(channel.recv(), timeout=10))
            if hello.type is not T.HELLO:
                raise ProtocolError(f"expected hello, got {hello.type.value}")
        except (ProtocolError, asyncio.TimeoutError) as exc:
            await self._refuse(channel, str(exc) or "no hello within 10 s")
            return
        except ChannelClosed:
            return
        if self.stopped():
            await self._refuse(channel, "the coordinator is stopping")
            return
        try:
            declared: Hello = parse(hello)
        except ProtocolError as exc:
            await self._refuse(channel, str(exc))
            return
        if p.settings.join_token and not auth.same_secret(declared.token, p.settings.join_token):
            await self._refuse(channel, "wrong or missing join token" if declared.token else "missing join token")
            return
        wanted, manifest = declared.precision, p.package.manifest  # read now: a variant added at another join reloads it
        if wanted:  # built unit by unit as its LOADs need them (``variants``): refused here only if even its calibration cannot be
            from ...model.weights import PRECISIONS

            problem = (f"unknown precision {wanted!r}" if wanted not in PRECISIONS else
                       self.variants.refusal(wanted, *self.calibrator.span(manifest)) if p.settings.calibrate else None)
            if problem:
                await self._refuse(channel, f"cannot provide the {wanted} variant: {problem}")
                return
        elif form := deploy.form_to_add(declared, manifest, p.settings.precision):
            try:  # the file's own model in the form this worker runs (`gguf` with the kernel library, else `native`)
                await self.variants.add_form(form)
            except Exception as exc:  # an import that fails for any reason: the worker is refused or runs the other form
                if form == deploy.FALLBACK_FORM:  # nothing else it could run
                    await self._refuse(channel, f"cannot provide the {form} variant: {exc}")
                    return
                p.note(S.NoteKind.VARIANT, precision=form, status="skipped", reason=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if declared.drafter and self.drafting is None:
            await self._refuse(channel, "this coordinator runs no draft model to hand out (serve --speculative MODEL)")
            return
        name = declared.name[:32]
        wid = f"w{p.state().joins + 1}-{name}"[:40]
        link = p.links()[wid] = Link(channel)
        # the join token was for admission only: the declaration kept in the state (and its event log) goes without it
        p.emit(S.WorkerJoined(wid, name, dataclasses.replace(declared, token=None), p.clock()))  # its dashboard line: narrate.entry
        try:
            try:
                await link.send(Welcome(wid).to_message())
            except ChannelClosed:  # it left before its welcome: the one line is its leave
                return
            p.measure(M.DeviceJoined(name, p.clock()))
            if declared.drafter:  # no stage for it: it gets the draft model instead (cluster.drafting)
                p.spawn(self.drafting.attach(wid, link))
            else:
                self.calibrator.joined(wid)
                p.replan_wanted.set()
            await self._read_worker(wid, link)
        finally:
            await self.lose(wid, "disconnected")

    async def _refuse(self, channel: Channel, reason: str) -> None:
        self.ports.note(S.NoteKind.REFUSED, peer=channel.peer, reason=reason)
        try:
            await channel.send(error_frame(reason, code=ErrorCode.REFUSED.value))
            await channel.close(reason)
        except ChannelClosed:
            pass

    async def _read_worker(self, wid: str, link: Link) -> None:
        p = self.ports
        vocab = getattr(p.package.manifest, "vocab_size", None) or (1 << 31)
        while p.links().get(wid) is link:
            try:
                raw = await link.channel.recv()
            except ChannelClosed:
                return
            try:
                msg = decode(raw)
                typed = parse(msg, vocab)
                if msg.type is T.PONG:
                    validate.pong_stats(dataclasses.asdict(typed))
            except (ProtocolError, validate.InvalidWorkerFrame) as exc:
                await self._refuse(link.channel, f"bad frame from {wid}: {exc}")
                return
            self.executor.handle(core.FrameHeard(wid, p.clock()))
            self._dispatch(wid, link, msg, typed)

    def _dispatch(self, wid: str, link: Link, msg: Message, typed) -> None:
        p = self.ports
        if msg.type is T.TOKEN:
            self.steps.tokens(wid, typed)
        elif msg.type is T.PONG:
            stats = {"kv_bytes": typed.kv_bytes, "queue": typed.queue, "busy_s": typed.busy_s, "computed": typed.computed,
                     "prefix_bytes": typed.prefix_bytes}
            self.executor.handle(core.PongHeard(wid, typed.t, stats, p.clock()))
        elif msg.type is T.LOADED:
            self.executor.handle(core.LoadAnswered(wid, typed))
        elif msg.type is T.PROBED:
            fut = link.probes.pop(typed.probe, None)
            if fut and not fut.done():
                fut.set_result(typed)
        elif msg.type is T.FORWARD and typed.relay_to:
            dep = p.state().active
            try:  # only a stage of the active plan may relay, and only to the stage after it
                validate.relay_frame({"plan": typed.plan, "relay_to": typed.relay_to}, sender=wid, stages=dep.workers if dep else (),
                                     plan_id=dep.plan_id if dep else -1)
            except validate.InvalidWorkerFrame as exc:
                p.note(S.NoteKind.IGNORED, worker=wid, why=str(exc))
                return
            target = p.links().get(typed.relay_to)
            if target:
                p.spawn(self.steps.relay(typed.relay_to, target, dataclasses.replace(typed, relay_to=None).to_message()))
        elif msg.type in (T.DRAFTED, T.DRAFT_READY):
            if self.drafting is not None:
                self.drafting.answered(wid, typed)
        elif msg.type is T.ERROR:
            self.steps.worker_error(wid, typed)
        elif msg.type is T.BYE:  # it is leaving: drop it now, not after the suspect / lose timeouts
            final = bool(typed.final)
            p.spawn(self.lose(wid, "shut down (final bye)" if final else "said bye", failure=not final))

    async def heartbeats(self) -> None:
        """Every ``heartbeat_s``: the core's verdicts (``membership.beat``), and its ``PingAll``."""
        p = self.ports
        last = p.clock()
        while True:
            await asyncio.sleep(p.settings.heartbeat_s)
            now = p.clock()
            due = core.HeartbeatDue(last, now, self.requests.replay_estimate_s(), *self.requests.needs())
            last = now
            self.executor.handle(due)
