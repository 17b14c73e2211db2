"""The worker process's shell: the receive loop, the in-order compute queue, carrying out the
core's commands, the peer connections and the reconnect with backoff. Every decision is
``worker.core``'s: this shell turns what arrives into core events and carries out the commands
``core.handle`` returns. Its I/O goes through ``worker.ports`` (the control channel, the data
port, peers, downloads, the compute, sleep and clock): the real ones by default, fakes in the
simulation (``cluster.sim_worker``), which so runs this very shell. Needs only onnxruntime,
numpy, msgpack and websockets."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace

from .. import PROTOCOL_VERSION
from ..net.channel import Channel, ChannelClosed, ShapedChannel
from ..net.messages import Bye, Draft, DraftLoad, Drop, Error, ErrorCode, Forward, Hello, Kv, KvExport, Notice, Ping, Probed, Welcome, parse
from ..net.protocol import Message, ProtocolError, decode, encode
from . import connect, core, links
from .ports import WorkerPorts, websocket_errors as _websocket_errors
from .runners import failure
from .settings import WorkerSettings, reconnect_delay, system_memory

log = logging.getLogger("edgepipe.worker")
STABLE_SESSION_S = 10.0  # a membership that lasted this long resets the backoff
WELCOME_TIMEOUT_S = 120.0  # the coordinator may build a weight variant before it welcomes
LOOP_LAG_WARN_S = 1.0  # the event loop held up this long (a PONG would have waited as long): log it
IN_ORDER = (Forward, Kv, Drop, KvExport)  # computed in arrival order, one at a time


class Worker:
    def __init__(self, settings: WorkerSettings, ports: WorkerPorts | None = None):
        """``ports``: the worker's I/O (``worker.ports``); None: the real ones for ``settings``."""
        self.s = settings
        self.ports = ports = ports or WorkerPorts.real(settings)
        self.device = ports.host.device
        self.native_kernel, self.native_kernel_note = ports.host.native_kernel, ports.host.native_kernel_note
        self.runners, self.data_port = ports.compute, ports.data
        self.state = core.WorkerState(settings.name, settings.join_token, settings.memory_bytes, settings.slowdown, settings.misreport,
                                      settings.drop_work, settings.activation_dtype, roofline=settings.roofline_policy())
        self.control: Channel | None = None
        self.peers: dict[str, Channel] = {}
        self.queue: asyncio.Queue[Forward | Kv | Drop | KvExport] = asyncio.Queue()
        self.link = None
        if settings.link_delay_ms or settings.link_rate:
            from ..emulate.shaper import LinkShape, ShapedLink, parse_rate

            rate = parse_rate(settings.link_rate) if settings.link_rate else None
            self.link = ShapedLink(LinkShape(delay_ms=settings.link_delay_ms, rate_bytes_per_s=rate))
        self._background: set[asyncio.Task] = set()
        self.loop_lag_s = 0.0  # worst event-loop hold-up since the last PONG reported it
        self.drafter = None  # --role drafter: the draft model it runs beside the pipeline (worker.drafter)
        if settings.role == "drafter":
            from .drafter import DrafterRole

            cache, headers = ports.blobs.cache, ports.blobs.headers()
            self.drafter = DrafterRole(lambda sha: cache.fetch(self.s.coordinator, sha, headers), cache.path,
                                       self._send_control, settings.threads, settings.slowdown)

    @property
    def id(self) -> str | None:
        return self.state.worker_id

    # -- the core ---------------------------------------------------------------------------
    async def feed(self, event) -> None:
        """Hand an event to the core and carry out what it says."""
        self.state, commands = core.handle(self.state, event)
        for cmd in commands:
            await self._execute(cmd)

    async def _execute(self, cmd) -> None:
        if isinstance(cmd, core.SendControl):
            await self._send_control(cmd.msg)
        elif isinstance(cmd, core.SendPeer):
            try:
                await self._send_peer(cmd.url, encode(cmd.msg), cmd.plan, cmd.secret, cmd.fingerprint)
            except ChannelClosed as exc:
                if cmd.about is not None:
                    await self.feed(core.Failed(cmd.about, ErrorCode.UNREACHABLE, f"next hop unreachable: {exc}"))
        elif isinstance(cmd, core.FeedSelf):
            # on the next turn of the loop, behind what arrived meanwhile: a stage feeding itself
            # still hears pings and DROPs between its steps (a queue.get that finds an item never yields)
            asyncio.get_running_loop().call_soon(self.ports.loopback or self.queue.put_nowait, cmd.forward)
        elif isinstance(cmd, core.FeedFirst):
            copy = cmd.copy
            try:
                await self._send_peer(cmd.url, encode(cmd.forward.to_message()), cmd.plan, cmd.secret, cmd.fingerprint, feed=True)
            except ChannelClosed as exc:
                log.warning("plan %d: could not feed the first stage the next step (the coordinator sends it): %s", cmd.plan, exc)
                copy = cmd.unfed()
            await self._send_control(copy.to_message())
        elif isinstance(cmd, core.RunStage):
            joins = self.state.joins
            event = await self.runners.run(cmd, joins, self.s.threads == 1)
            if self.state.joins != joins or cmd.graph not in self.state.sessions:
                # the worker rejoined (its sequences were forgotten) or let the session go while this ran:
                # the KV the compute wrote belongs to no one now
                for seq in cmd.seqs:
                    self.runners.drop(core.DropSequence((cmd.graph,), seq))
            await self.feed(event)
        elif isinstance(cmd, core.Wait):
            await self.ports.sleep(cmd.seconds)
        elif isinstance(cmd, core.DropSequence):
            self.runners.drop(cmd)
        elif isinstance(cmd, core.KeepSessions):
            self.runners.keep(cmd)
        elif isinstance(cmd, core.Forget):
            self._forget()
        elif isinstance(cmd, core.FetchFiles):
            self._spawn(self._fetch(cmd.load))
        elif isinstance(cmd, core.BuildSession):
            await self._build(cmd)
        elif isinstance(cmd, core.ExportKv):
            await self._export(cmd)
        elif isinstance(cmd, core.ImportKv):
            try:
                event = await self.runners.import_kv(cmd)
            except Exception as exc:  # noqa: BLE001 - a bad KV frame must not kill the worker
                event = core.Failed(cmd.kv, *failure(exc))
            await self.feed(event)
        elif isinstance(cmd, core.SendLinkPayload):
            await self._send_control(Probed(cmd.probe, True).to_message({"payload": links.incompressible(cmd.nbytes)}))
        elif isinstance(cmd, core.MeasurePeer):
            self._spawn(self._measure_peer(cmd))
        elif isinstance(cmd, core.TimeStage):
            self._spawn(self._time_stage(cmd))

    def _forget(self) -> None:
        while not self.queue.empty():  # frames of the previous membership's plans
            self.queue.get_nowait()
        self.runners.forget_sequences()
        for channel in self.peers.values():
            self._spawn(channel.close())
        self.peers.clear()

    # -- loading ----------------------------------------------------------------------------
    async def _fetch(self, load) -> None:
        try:
            fetched, weight_bytes, repaired = await self.ports.blobs.fetch(load)
            event = core.Fetched(load, fetched, weight_bytes, repaired)
        except (OSError, ValueError, RuntimeError) as exc:
            event = core.LoadFailed(load, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        await self.feed(event)

    async def _build(self, cmd: core.BuildSession) -> None:
        load, t0 = cmd.load, self.ports.clock()
        try:
            session = await self.runners.build(load, self.ports.blobs.path(load.graph))
            event = core.Built(load, session, cmd.weight_bytes, cmd.fetched_bytes, self.ports.clock() - t0, False, cmd.repaired)
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            text = str(exc).splitlines()[0] if str(exc) else ""
            event = core.LoadFailed(load, text if isinstance(exc, (OSError, ValueError, RuntimeError)) else f"{type(exc).__name__}: {text}")
        await self.feed(event)

    # -- KV and probes ----------------------------------------------------------------------
    async def _export(self, cmd: core.ExportKv) -> None:
        e = cmd.export
        try:
            frame = await self.runners.export(cmd)
            await self._send_peer(e.url, frame, e.to_plan, cmd.secret, e.fingerprint)
        except (KeyError, ChannelClosed, ValueError) as exc:
            await self.feed(core.ExportFailed(e, str(exc)))

    async def _measure_peer(self, cmd: core.MeasurePeer) -> None:
        try:
            rtt, bandwidth = await self.ports.peers.measure(cmd.url, cmd.secret, cmd.fingerprint, cmd.most_bytes, self._shape)
            event = core.PeerMeasured(cmd.probe, rtt, bandwidth)
        except (ChannelClosed, OSError, ValueError, ProtocolError, asyncio.TimeoutError, _websocket_errors()) as exc:
            event = core.PeerMeasured(cmd.probe, error=str(exc) or type(exc).__name__)
        await self.feed(event)

    async def _time_stage(self, cmd: core.TimeStage) -> None:
        session = self.state.sessions.get(cmd.graph)
        if session is None:
            return await self._send_control(Probed(cmd.probe, False).to_message())
        try:
            timed = await self.runners.time_stage(cmd, session, self.state.slowdown, self.state.roofline)
        except Exception as exc:  # the probe fails, not the worker: the coordinator hears why and goes on
            log.warning("timing probe %s failed: %s", cmd.probe, exc)
            return await self._send_control(Probed(cmd.probe, False, error=(str(exc) or type(exc).__name__).splitlines()[0][:200]).to_message())
        await self.feed(timed)

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, control: Channel | None = None) -> None:
        """Join the coordinator and serve until it says a final bye (or the process is stopped).

        A dropped control connection does not end the worker: it reconnects with jittered
        exponential backoff, keeping its data port, blob cache and built sessions, and joins
        again as a new member (the coordinator recalls its calibration by name and hardware).
        With a ``control`` channel given (in-memory use) it serves that one channel only."""
        server = await self.data_port.start(lambda plan, check: core.admit_data(self.state, plan, check), self.receive, self._shape,
                                              lambda plan, check: core.admit_feed(self.state, plan, check))
        self.state = replace(self.state, data_url=self.data_port.url)
        compute = asyncio.create_task(self._compute_loop())
        lag = asyncio.create_task(self._watch_loop_lag()) if self.ports.lag_tick_s else None
        try:
            if control is not None:
                await self._session(control)
                return
            clock = self.ports.clock
            attempt, gone_since = 0, clock()
            while True:
                started = clock()
                try:
                    channel = await self.ports.connect()
                except (OSError, asyncio.TimeoutError, ValueError, _websocket_errors()) as exc:
                    judged = connect.verdict(exc, connect.control_url(self.s.coordinator))
                    if isinstance(judged, connect.Stop):
                        raise connect.CannotJoin(judged.why) from None
                    await self._tls_instead(exc)
                    why = judged.why
                else:
                    joins = self.state.joins
                    if await self._session(channel):
                        return
                    why = "control connection lost"
                    if self.state.joins > joins:  # it was a member: the coordinator is gone from now
                        gone_since = clock()
                        if gone_since - started > STABLE_SESSION_S:
                            attempt = 0  # it served a while: the backoff starts afresh
                delay = reconnect_delay(attempt, self.ports.draw(), clock() - gone_since)
                attempt += 1
                log.warning("%s; reconnecting in %.1f s (attempt %d)", why, delay, attempt)
                await self.ports.sleep(delay)
        finally:
            compute.cancel()
            if lag is not None:
                lag.cancel()
            if server is not None:
                server.close()
            self.runners.close()
            if self.drafter is not None:
                self.drafter.close()

    async def serve_until_terminated(self) -> None:
        """``run``, with SIGTERM cancelling it as Ctrl-C does: the worker then says a final bye."""
        import signal
        import threading

        task = asyncio.current_task()

        def terminate() -> None:
            task.cancel()
            # asyncio.run joins executor threads on the way out (a compute or a download in
            # flight): never let that keep a stopped worker alive for more than a moment
            timer = threading.Timer(3.0, os._exit, (0,))
            timer.daemon = True
            timer.start()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminate)
        await self.run()

    async def _watch_loop_lag(self) -> None:
        """Measure how late the event loop wakes up: what a heartbeat would have waited."""
        tick = self.ports.lag_tick_s
        while True:
            t0 = self.ports.clock()
            await self.ports.sleep(tick)
            held = self.ports.clock() - t0 - tick
            self.loop_lag_s = max(self.loop_lag_s, held)
            if held > LOOP_LAG_WARN_S:
                log.warning("event loop held up for %.2f s (heartbeats waited as long)", held)

    async def _session(self, channel: Channel) -> bool:
        """One membership: hello, welcome, then control frames until the channel ends.
        True when the coordinator said a final bye (the worker should exit)."""
        self.control = self._shape(channel)
        try:
            await self.control.send(encode(self.hello().to_message()))
            reply = decode(await asyncio.wait_for(self.control.recv(), timeout=WELCOME_TIMEOUT_S))
            welcome = parse(reply)
            if isinstance(welcome, Error):
                raise PermissionError(f"coordinator refused this worker: {welcome.message}")
            if not isinstance(welcome, Welcome):
                raise ProtocolError(f"expected welcome, got {reply.type.value}")
        except ProtocolError as exc:  # it speaks WebSocket at /v1/worker, but not our protocol: retrying cannot help
            await self._close_control()
            if "protocol version" in str(exc):
                raise connect.CannotJoin(f"{self.s.coordinator} speaks another edgepipe protocol ({exc}): install the coordinator's own "
                                         f"edgepipe here (the pip line `serve` prints)") from None
            raise connect.CannotJoin(f"{self.s.coordinator} is not an edgepipe coordinator (its answer to the hello: {exc})") from None
        except (ChannelClosed, asyncio.TimeoutError) as exc:
            log.warning("no welcome from the coordinator: %s", str(exc) or type(exc).__name__)
            await self._close_control()
            return False
        await self.feed(core.Joined(welcome.worker_id))
        log.info("joined as %s (pid %s, %d blobs held, %d sessions kept, %d bytes downloaded so far)",
                 self.id, self.ports.host.pid, len(self.ports.blobs.held()), len(self.state.sessions), self.state.fetched_bytes)
        try:
            return await self._control_loop()
        except asyncio.CancelledError:  # the process is stopping for good: the coordinator drops it at once
            await self._final_bye()
            raise
        finally:
            await self._close_control()

    async def _final_bye(self) -> None:
        try:
            await asyncio.wait_for(self.control.send(encode(Bye(final=True).to_message())), timeout=1.0)
        except (ChannelClosed, OSError, asyncio.TimeoutError, _websocket_errors()):
            pass

    async def _close_control(self) -> None:
        """Close the control channel without waiting long on a coordinator that cannot answer."""
        try:
            await asyncio.wait_for(self.control.close(), timeout=1.0)
        except (ChannelClosed, OSError, asyncio.TimeoutError, _websocket_errors()):
            ws = getattr(getattr(self.control, "inner", self.control), "ws", None)
            if getattr(ws, "transport", None) is not None:
                ws.transport.abort()

    def hello(self) -> Hello:
        return Hello(
            name=self.s.name, token=self.s.join_token, protocol=PROTOCOL_VERSION, kind="native",
            memory_bytes=self.s.memory_bytes or self.device.memory_bytes or system_memory(), threads=self.s.threads or os.cpu_count(),
            device=self.device.kind, adapter=self.device.adapter,
            device_note=self.device.note if self.s.device != "cpu" else None,
            native_kernel=self.native_kernel, native_kernel_note=self.native_kernel_note,
            data_url=self.data_port.url, held=tuple(self.ports.blobs.held()), pid=self.ports.host.pid, data_fingerprint=self.data_port.fingerprint,
            power_busy_w=self.s.power_busy_w, power_idle_w=self.s.power_idle_w, emulation=self.s.emulation(),
            role=self.s.role if self.s.role != "stage" else None,
        )

    async def _tls_instead(self, exc: BaseException) -> None:
        """An http:// coordinator that hung up during the handshake: if it speaks TLS, say so and stop."""
        from websockets.exceptions import InvalidMessage

        if not (isinstance(exc, InvalidMessage) and self.s.coordinator.startswith("http://")):
            return
        from urllib.parse import urlsplit

        from ..net import tls

        where = urlsplit(self.s.coordinator)
        try:
            await asyncio.get_running_loop().run_in_executor(None, tls.server_certificate, where.hostname, where.port or 80, 5)
        except (OSError, ValueError):
            return  # not TLS either: a coordinator stopping, retried
        pin = self.s.tls_fingerprint or "<the sha256 `serve --tls` prints>"
        raise connect.CannotJoin(f"{where.netloc} serves TLS: join with --coordinator https://{where.netloc}{where.path} --tls-fingerprint {pin}")

    def _shape(self, channel: Channel) -> Channel:
        return ShapedChannel(channel, self.link) if self.link else channel

    # -- receiving --------------------------------------------------------------------------
    async def _control_loop(self) -> bool:
        """Handle control frames; True on a final bye. A coordinator silent for longer than
        ``silence_s`` (it pings every half second) is taken as a dead connection."""
        while True:
            try:
                raw = await asyncio.wait_for(self.control.recv(), timeout=self.s.silence_s)
            except ChannelClosed:
                log.warning("the coordinator closed the control channel")
                return False
            except asyncio.TimeoutError:
                log.warning("nothing from the coordinator for %.0f s", self.s.silence_s)
                return False
            try:
                typed = parse(decode(raw))
            except ProtocolError as exc:
                log.warning("bad frame from coordinator: %s", exc)
                continue
            if isinstance(typed, Bye):
                # A bye is final only when it says so (a coordinator leaving for good); a plain one
                # is a coordinator stopping, perhaps to restart: come back when it is there again.
                log.warning("the coordinator said bye%s", " (final)" if typed.final else "")
                return bool(typed.final)
            try:  # a reply (a PONG) that cannot leave for this long: the connection is dead
                await asyncio.wait_for(self.receive(typed), timeout=self.s.silence_s)
            except asyncio.TimeoutError:
                log.warning("could not send to the coordinator for %.0f s", self.s.silence_s)
                return False
            except ChannelClosed:  # it closed while this frame was answered (a PONG): reconnect, as for a closed recv
                log.warning("the control channel closed while answering the coordinator")
                return False

    async def receive(self, typed) -> None:
        """A frame from the coordinator or a predecessor, as ``net.messages.parse`` typed it."""
        if isinstance(typed, (DraftLoad, Draft)) or (isinstance(typed, Drop) and self.drafter is not None):
            return self._drafting(typed)
        if isinstance(typed, IN_ORDER):
            await self.queue.put(typed)  # in order with the forwards: a DROP never while that sequence computes
        elif isinstance(typed, Ping):
            kv = self.runners.kv_bytes({s.graph for s in self.state.stages.values()} | self.state.warm)  # with checkpoints held for a spare
            await self.feed(core.Pinged(typed.t, kv, self.queue.qsize(), self.loop_lag_s, self.runners.prefix_bytes))
            self.loop_lag_s = 0.0
        elif isinstance(typed, Error):
            log.warning("coordinator: %s", typed.message)
        elif isinstance(typed, Notice):  # what the coordinator prepares for this worker (e.g. the units of its variant)
            log.info("coordinator: %s", typed.text)
        elif not isinstance(typed, Message):
            await self.feed(typed)

    def _drafting(self, typed) -> None:
        """A drafter's frames: loads and drafts run on its draft thread, in arrival order."""
        if self.drafter is None:
            log.warning("%s for a worker that is not a drafter (start it with --role drafter)", typed.TYPE.value)
        elif isinstance(typed, DraftLoad):
            self._spawn(self.drafter.load(typed))
        elif isinstance(typed, Draft):
            self._spawn(self.drafter.draft(typed, typed.tensors.get("ids")))
        else:
            self._spawn(self.drafter.forget(typed.seq))

    async def _compute_loop(self) -> None:
        """Run what arrives in order; a forward frame (one lane of sequences) is one batch.

        Two frames waiting here are not merged: run one after the other, their lanes spread
        over the stages again instead of travelling bunched (see ``cluster.batching``)."""
        while True:
            msg = await self.queue.get()
            try:
                await self.feed(msg)
            except ChannelClosed:
                pass  # the coordinator is gone: the session ends and a rejoin forgets these
            except Exception as exc:  # noqa: BLE001 - nothing may kill the compute loop
                log.exception("%s failed", msg.TYPE.value)
                await self._quiet(core.Failed(msg, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:200]))

    async def _quiet(self, event) -> None:
        try:
            await self.feed(event)
        except ChannelClosed:
            pass

    # -- sending ----------------------------------------------------------------------------
    async def _send_peer(self, url: str, frame: bytes, plan: int, secret: str | None, fingerprint: str | None = None,
                         feed: bool = False) -> None:
        """Send to another worker's data port, one connection per (port, plan), presenting
        that stage's secret (``feed``: the first stage's feed secret, on a connection of its own);
        any failure to reach it is ChannelClosed."""
        key = f"{url}#feed#{plan}" if feed else f"{url}#{plan}"
        try:
            channel = self.peers.get(key)
            if channel is None:
                for stale in [k for k in self.peers if int(k.rsplit("#", 1)[1]) not in self.state.stages and k != key]:
                    self._spawn(self.peers.pop(stale).close())  # plans this worker no longer runs
                channel = self.peers[key] = self._shape(await self.ports.peers.open(url, plan, secret, fingerprint))
            await channel.send(frame)
        except (ChannelClosed, OSError, asyncio.TimeoutError, _websocket_errors()) as exc:
            self.peers.pop(key, None)  # a dead peer must not poison later sends
            raise ChannelClosed(f"{url}: {exc}") from None

    async def _send_control(self, msg: Message) -> None:
        await self.control.send(encode(msg))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)
        return task
