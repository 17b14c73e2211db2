"""The coordinator's end of every worker's control channel (I/O): hello, frames in, heartbeats out.

A worker connects with HELLO and is refused (one line, ``ErrorCode.REFUSED``) or welcomed and
read until its channel closes. Every frame it sends is checked (``net.messages.parse``,
``net.validate``) before anything uses it: a bad one closes the channel, never the coordinator.
Frames are routed to their owner (tokens and errors to ``steps``, LOADED to ``deployer``, pongs
into the state). The heartbeat loop pings every worker and turns ``membership``'s verdicts
(suspect, lose, abandon a plan whose stage went silent) into events.
"""

from __future__ import annotations

import asyncio
import dataclasses

from ..net import auth, validate
from ..net.channel import Channel, ChannelClosed
from ..net.messages import ErrorCode, Hello, Ping, Welcome, parse
from ..net.protocol import Message, MessageType as T, ProtocolError, decode, error_frame
from . import deploy, measurements as M, membership, state as S
from .steps import PipelineBroken
from .views import Link


class Connections:
    def __init__(self, coord):
        self.coord = coord

    async def attach(self, channel: Channel) -> None:
        """Serve one worker's control channel until it closes (called by the API endpoint)."""
        c = self.coord
        try:
            hello = decode(await asyncio.wait_for(channel.recv(), timeout=10))
            if hello.type is not T.HELLO:
                raise ProtocolError(f"expected hello, got {hello.type.value}")
        except (ProtocolError, asyncio.TimeoutError) as exc:
            await self._refuse(channel, str(exc) or "no hello within 10 s")
            return
        except ChannelClosed:
            return
        if c.stopped:
            await self._refuse(channel, "the coordinator is stopping")
            return
        if c.settings.join_token and not auth.same_secret(hello.get("token"), c.settings.join_token):
            await self._refuse(channel, "wrong or missing join token" if hello.get("token") else "missing join token")
            return
        try:
            declared = Hello.from_fields(hello.fields)
        except ProtocolError as exc:
            await self._refuse(channel, str(exc))
            return
        wanted = declared.precision
        if wanted and any(wanted not in u.variants for u in c.manifest.units):
            try:
                await c.calibrator.add_variant(wanted)
            except (ValueError, OSError) as exc:
                await self._refuse(channel, f"cannot provide the {wanted} variant: {exc}")
                return
        elif form := deploy.form_to_add(declared, c.manifest, c.settings.precision):
            try:  # the file's own model in the form this worker runs (`gguf` with the kernel library, else `native`)
                await c.calibrator.add_variant(form)
            except Exception as exc:  # an import that fails for any reason: the worker is refused or runs the other form
                if form == deploy.FALLBACK_FORM:  # nothing else it could run
                    await self._refuse(channel, f"cannot provide the {form} variant: {exc}")
                    return
                c.event("variant", precision=form, status="skipped", reason=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if declared.drafter and c.drafting is None:
            await self._refuse(channel, "this coordinator runs no draft model to hand out (serve --speculative MODEL)")
            return
        name = declared.name[:32]
        wid = f"w{c.cluster.joins + 1}-{name}"[:40]
        link = c.links[wid] = Link(channel)
        # the join token was for admission only: the declaration kept in the state (and its event log) goes without it
        c.emit(S.WorkerJoined(wid, name, dataclasses.replace(declared, token=None), c.clock()))  # its dashboard line: narrate.entry
        await link.send(Welcome(wid).to_message())
        c.measure(M.DeviceJoined(name, c.clock()))
        if declared.drafter:  # no stage for it: it gets the draft model instead (cluster.drafters)
            c.spawn(c.drafting.attach(wid, link))
        else:
            c.calibrator.joined(wid)
            c.replan_wanted.set()
        try:
            await self._read_worker(wid, link)
        finally:
            await c.lose(wid, "disconnected")

    async def _refuse(self, channel: Channel, reason: str) -> None:
        c = self.coord
        c.event("refused", peer=channel.peer, reason=reason)
        try:
            await channel.send(error_frame(reason, code=ErrorCode.REFUSED.value))
            await channel.close(reason)
        except ChannelClosed:
            pass

    async def _read_worker(self, wid: str, link: Link) -> None:
        c = self.coord
        vocab = getattr(c.manifest, "vocab_size", None) or (1 << 31)
        while c.links.get(wid) is link:
            try:
                raw = await link.channel.recv()
            except ChannelClosed:
                return
            try:
                msg = decode(raw)
                typed = parse(msg, vocab)
                if msg.type is T.PONG:
                    validate.pong_stats(msg.fields)
            except (ProtocolError, validate.InvalidWorkerFrame) as exc:
                await self._refuse(link.channel, f"bad frame from {wid}: {exc}")
                return
            seen = c.cluster.workers.get(wid)
            if seen is not None and (seen.suspected_since is not None or c.clock() - seen.last_seen >= 0.05):
                c.emit(S.Heard(wid, c.clock()))  # frames closer than 50 ms apart tell the detector nothing new
            self._dispatch(wid, link, msg, typed)

    def _dispatch(self, wid: str, link: Link, msg: Message, typed) -> None:
        c = self.coord
        if msg.type is T.TOKEN:
            c.steps.tokens(wid, typed)
        elif msg.type is T.PONG:
            rtt = c.clock() - typed.t if typed.t is not None and typed.t <= c.clock() else None
            if rtt is not None:
                c.measure(M.HeartbeatRtt(wid, rtt))
            c.emit(S.Ponged(wid, rtt, {"kv_bytes": typed.kv_bytes, "queue": typed.queue, "busy_s": typed.busy_s,
                                          "computed": typed.computed, "prefix_bytes": typed.prefix_bytes}, c.clock()))
        elif msg.type is T.LOADED:
            if typed.kv_received is not None:
                c.deployer.migration.moved(typed)
            else:
                fut = link.loads.pop(typed.plan, None)
                if fut and not fut.done():
                    fut.set_result(typed)
        elif msg.type is T.PROBED:
            fut = link.probes.pop(typed.probe, None)
            if fut and not fut.done():
                fut.set_result(typed)
        elif msg.type is T.FORWARD and typed.relay_to:
            dep = c.cluster.active
            try:  # only a stage of the active plan may relay, and only to the stage after it
                validate.relay_frame(msg.fields, sender=wid, stages=dep.workers if dep else (), plan_id=dep.plan_id if dep else -1)
            except validate.InvalidWorkerFrame as exc:
                c.event("ignored", worker=wid, why=str(exc))
                return
            target = c.links.get(typed.relay_to)
            if target:
                fields = {k: v for k, v in msg.fields.items() if k != "relay_to"}
                c.spawn(c.steps.relay(typed.relay_to, target, Message(T.FORWARD, fields, msg.tensors)))
        elif msg.type in (T.DRAFTED, T.DRAFT_READY):
            if c.drafting is not None:
                c.drafting.answered(wid, typed)
        elif msg.type is T.ERROR:
            c.steps.worker_error(wid, typed)
        elif msg.type is T.BYE:  # it is leaving: drop it now, not after the suspect / lose timeouts
            final = bool(msg.get("final"))
            c.spawn(c.lose(wid, "shut down (final bye)" if final else "said bye", failure=not final))

    async def heartbeats(self) -> None:
        c = self.coord
        liveness = membership.LivenessSettings(c.settings.heartbeat_s, min_suspect_s=c.settings.dead_after_s,
                                               lose_after_s=c.settings.lose_after_s)
        last = c.clock()
        while True:
            await asyncio.sleep(c.settings.heartbeat_s)
            now = c.clock()
            if membership.quarantine_ended(c.cluster, last, now):
                c.replan_wanted.set()  # a quarantined device may be planned again
            last = now
            for verdict in membership.verdicts(c.cluster, now, liveness):
                if isinstance(verdict, membership.Lose):
                    c.spawn(c.lose(verdict.worker_id, verdict.why))
                else:
                    c.emit(S.Suspected(verdict.worker_id, now))
            suspects = membership.silent_stages(c.cluster, now, liveness, c.requests.replay_estimate_s())
            if suspects and membership.abandon_active(c.cluster, suspects, c.requests.lacking()):
                # A frozen stage would hold every request until it wakes or the step times out:
                # serve from the others now; it rejoins the plans when heard from again.
                plan = c.cluster.active.plan_id
                why = f"plan {plan}: stage {', '.join(suspects)} went silent"
                c.emit(S.PlanAbandoned(plan, why, now))
                c.steps.fail_plan(plan, PipelineBroken(why))
                c.replan_wanted.set()
            for wid, link in list(c.links.items()):
                try:
                    await link.send(Ping(now).to_message())
                except ChannelClosed:
                    c.spawn(c.lose(wid, "disconnected"))
