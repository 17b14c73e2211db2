"""The worker's decisions as data (sans-IO): ``handle(state, event) -> (state, commands)``.

A worker holds stages (a unit range of one plan each), built sessions (a stage graph loaded
into a runner, shared by plans that cut the same range) and, per session, how many positions of
each sequence its KV holds. Everything that changes that — a frame from the coordinator or a
predecessor, a finished download, build, compute, KV import, probe — is an event; ``handle``
returns the new state and the commands the shell must carry out (send a frame, fetch files,
build a session, run a stage, move KV, time a probe). The shell (``worker.shell``) executes
them over sockets, threads and ONNX Runtime; the simulation (``cluster.sim``) executes them
with a fake model, so the simulation runs this core, the one the real worker ships.

Compute-ordered events (FORWARD, DROP, KV, KV_EXPORT) reach ``handle`` in arrival order, one at
a time, after the previous one's commands are done: a frame is checked against the KV as it
stands when its turn comes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..emulate.slowdown import MemoryBudget, MemoryBudgetExceeded, SlowdownPolicy
from ..net import limits, validate
from ..net.messages import (PROBE_PLAN, Activate, Drop, Emulate, Error, ErrorCode, Forward, Kv, KvExport, Load, Loaded, Pong, Probe, Probed,
                            Token)

from .data import (  # noqa: F401 - the core's vocabulary, used as core.X by the shells and tests
    Session, Stage, WorkerState, Joined, Pinged, Fetched, Built, LoadFailed, Computed, Failed, Imported, ExportFailed,
    StageTimed, PeerMeasured, SendControl, SendPeer, Forget, FetchFiles, BuildSession, KeepSessions, RunStage, Wait,
    DropSequence, ExportKv, ImportKv, SendLinkPayload, MeasurePeer, TimeStage, FeedSelf, FeedFirst, Event, Command)

KV_RESERVE_TOKENS = limits.KV_RESERVE_TOKENS  # KV room a stage must leave for at least one sequence this long
INLINE_STEP_S = 0.02  # decode steps faster than this run on the event loop (no thread hand-off)
# Sequence ids are never reused after a DROP (a replay takes a new epoch's id; a sequence moved away
# comes back only by a KV import): a frame of a dropped id that would start its KV afresh is stale
# (it sat behind a stall while the coordinator gave up on it) and is discarded. The last this many are kept.
DROPPED_KEPT = 4096


# -- the transition ------------------------------------------------------------------------------------------
def handle(state: WorkerState, event: Event) -> tuple[WorkerState, list[Command]]:
    """The state after ``event`` and what the shell must do about it."""
    on = _HANDLERS.get(type(event))
    return on(state, event) if on is not None else (state, [])


def _joined(state: WorkerState, event: Joined) -> tuple[WorkerState, list[Command]]:
    """Forget what belonged to the previous membership: plan ids are the coordinator's (a
    restarted one counts from 1 again) and its sequences are rebuilt elsewhere by replay.
    Built sessions stay, as warm spares, so a rejoin that gets the same range builds nothing."""
    warm = state.warm | {s.graph for s in state.stages.values()}
    return replace(state, worker_id=event.worker_id, joins=state.joins + 1, stages={}, warm=frozenset(warm), held={},
                   dropped={}), [Forget()]


def _pinged(state: WorkerState, event: Pinged) -> tuple[WorkerState, list[Command]]:
    return state, [SendControl(Pong(event.t, event.kv_bytes, event.queue, state.busy_s, state.computed, state.fetched_bytes, state.joins,
                                    round(event.loop_lag_s, 3), event.prefix_bytes).to_message())]


def _load(state: WorkerState, load: Load) -> tuple[WorkerState, list[Command]]:
    return state, [FetchFiles(load)]


def _loaded(plan: int, **fields) -> SendControl:
    return SendControl(Loaded(plan=plan, **fields).to_message())


def _fetched(state: WorkerState, event: Fetched) -> tuple[WorkerState, list[Command]]:
    load = event.load
    state = replace(state, fetched_bytes=state.fetched_bytes + event.fetched_bytes)
    if load.prefetch:  # a spare plan: hold the files, build nothing yet
        return state, [_loaded(load.plan, ok=True, prefetched=True, fetched_bytes=event.fetched_bytes)]
    if state.budget_bytes is not None:
        reserve = min(KV_RESERVE_TOKENS, load.max_context or KV_RESERVE_TOKENS)  # as the planner counts it
        kv = (load.kv_bytes_per_token or 0) * reserve
        try:
            MemoryBudget(state.budget_bytes).check(event.weight_bytes + kv, f"units [{load.start}, {load.end}) weights + KV for "
                                                   f"{reserve} tokens", state.in_use(load.keep, bool(load.warm), load.graph))
        except MemoryBudgetExceeded as exc:
            return state, [_loaded(load.plan, ok=False, error=str(exc).splitlines()[0], needed_bytes=exc.requested_bytes,
                                   free_bytes=max(0, exc.budget_bytes - exc.in_use_bytes), budget_bytes=exc.budget_bytes)]
    commands: list[Command] = []
    if not load.warm and load.plan >= 0 and load.graph not in state.warm:
        # The real stage takes the memory a warm spare held (calibration's small ranges, with
        # negative plan ids, leave it: it may be this worker's stage again). The checkpoint KV in
        # the spare's session goes too: the coordinator voids it at the prepare (``checkpoints.displaced``).
        state = replace(state, warm=frozenset(), stages=_without_spare(state), spare=None)
        commands.append(KeepSessions(_used_graphs(state)))
        state = _forget_sessions(state)
    if load.graph in state.sessions:  # a session already built for this graph (kept range, warm spare) is reused
        built = Built(load, state.sessions[load.graph], event.weight_bytes, event.fetched_bytes, 0.0, True, event.repaired)
        more_state, more = _built(state, built)
        return more_state, commands + more
    return state, commands + [BuildSession(load, event.fetched_bytes, event.weight_bytes, event.repaired)]


def _kv_move_bytes(load: Load, session: Session) -> int:
    """KV bytes per position a move or checkpoint into this stage may carry: the LOAD counts the
    stage's own cache (fp16 in the gguf form), but a worker of the fp32 form may send its KV (the
    import converts), so the frame limit allows fp32."""
    return int(load.kv_bytes_per_token or 0) * 4 // session.kv_itemsize


def _built(state: WorkerState, event: Built) -> tuple[WorkerState, list[Command]]:
    load, session = event.load, event.session
    state = replace(state, sessions={**state.sessions, load.graph: session})
    commands: list[Command] = []
    if load.warm:
        state = replace(state, warm=frozenset({load.graph}), stages=_without_spare(state), spare=None)
        if load.plan < 0:  # the spare plan's stage: it takes KV checkpoints (cluster.checkpoints), never a FORWARD
            spare = Stage(load.plan, load.start, load.end, load.graph, load.next, event.weight_bytes,
                          secret=data_secret(state, state.data_url, load.plan, load.data_secret),
                          frame_limit=limits.data_frame_limit(int(load.max_context or 4096), session.hidden, _kv_move_bytes(load, session)),
                          max_context=load.max_context, matmul_bytes=load.matmul_bytes,
                      head_bytes=int(load.head_bytes or 0))
            state = replace(state, stages={**state.stages, load.plan: spare}, spare=load.plan)
        state = _forget_sessions(state)
        commands.append(KeepSessions(_used_graphs(state)))
    else:
        first = load.first if load.next.kind == "coordinator" else None
        stage = Stage(load.plan, load.start, load.end, load.graph, load.next, event.weight_bytes,
                      secret=data_secret(state, state.data_url, load.plan, load.data_secret),
                      frame_limit=limits.data_frame_limit(int(load.max_context or 4096), session.hidden, _kv_move_bytes(load, session)),
                      max_context=load.max_context, matmul_bytes=load.matmul_bytes,
                      head_bytes=int(load.head_bytes or 0), first=first,
                      first_secret=feed_secret(state, first.url, load.plan, first.secret) if first else None,
                      fed_by=load.fed_by if session.takes_token_ids else None,
                      feed_secret=feed_secret(state, state.data_url, load.plan, load.feed_secret)
                      if load.fed_by and session.takes_token_ids else None)
        state = replace(state, stages={**state.stages, load.plan: stage})
    repaired = list(event.repaired) if event.repaired else None  # cached files that failed their hash and were fetched again
    return state, commands + [_loaded(load.plan, ok=True, load_s=event.load_s, fetched_bytes=event.fetched_bytes,
                                      weight_bytes=event.weight_bytes, reused_session=event.reused, repaired=repaired)]


def _load_failed(state: WorkerState, event: LoadFailed) -> tuple[WorkerState, list[Command]]:
    return state, [_loaded(event.load.plan, ok=False, error=event.error)]


def _without_spare(state: WorkerState) -> dict[int, Stage]:
    """The stages but the spare plan's (its session, and the checkpoints in it, go with it)."""
    return {p: s for p, s in state.stages.items() if p != state.spare}


def _used_graphs(state: WorkerState) -> frozenset[str]:
    return frozenset({s.graph for s in state.stages.values()}) | state.warm


def _forget_sessions(state: WorkerState) -> WorkerState:
    """Keep only sessions a stage uses or the warm spare (the shell releases the rest)."""
    used = _used_graphs(state)
    return replace(state, sessions={g: s for g, s in state.sessions.items() if g in used},
                   held={g: h for g, h in state.held.items() if g in used}, step_s={g: t for g, t in state.step_s.items() if g in used})


def _activate(state: WorkerState, event: Activate) -> tuple[WorkerState, list[Command]]:
    keep = set(event.keep)
    state = _forget_sessions(replace(state, stages={p: s for p, s in state.stages.items() if p in keep}))
    return state, [KeepSessions(_used_graphs(state), frozenset(state.stages))]


def _drop(state: WorkerState, event: Drop) -> tuple[WorkerState, list[Command]]:
    # the warm spare's session too: it may hold KV checkpoints while its stage is not (yet) there
    graphs = tuple(sorted({s.graph for s in state.stages.values()} | state.warm))
    held = {g: {s: n for s, n in h.items() if s != event.seq} for g, h in state.held.items()}
    dropped = dict(state.dropped)
    dropped.pop(event.seq, None)
    dropped[event.seq] = None
    if len(dropped) > DROPPED_KEPT:
        del dropped[next(iter(dropped))]  # the oldest
    return replace(state, held=held, dropped=dropped), [DropSequence(graphs, event.seq)]


def _emulate(state: WorkerState, event: Emulate) -> tuple[WorkerState, list[Command]]:
    SlowdownPolicy(event.slowdown)  # a bad factor raises here, before it is taken
    return replace(state, slowdown=event.slowdown), []


def _probe(state: WorkerState, probe: Probe) -> tuple[WorkerState, list[Command]]:
    if probe.kind == "link":
        return state, [SendLinkPayload(probe.probe, int(probe.bytes or limits.LINK_PROBE_DEFAULT_BYTES))]
    if probe.kind == "accept":  # peers presenting this secret on PROBE_PLAN may time this data port
        secret = probe.secret if isinstance(probe.secret, str) and probe.secret else None
        return replace(state, probe_secret=secret), [SendControl(Probed(probe.probe, secret is not None).to_message())]
    if probe.kind == "peer":
        if not (isinstance(probe.url, str) and probe.url.startswith(("ws://", "wss://"))):
            return state, [SendControl(Probed(probe.probe, False, error=f"peer probe: bad url {probe.url!r}"[:200]).to_message())]
        return state, [MeasurePeer(probe.probe, probe.url, probe.secret, probe.fingerprint, int(probe.bytes or limits.LINK_PROBE_DEFAULT_BYTES))]
    stage = state.stages.get(probe.plan) if probe.plan is not None else None
    if stage is None:
        return state, [SendControl(Probed(probe.probe, False).to_message())]
    return state, [TimeStage(probe.probe, stage.graph, int(probe.reps or 8), int(probe.context or 64), int(probe.rows or 1), stage.compute_bytes)]


def _stage_timed(state: WorkerState, event: StageTimed) -> tuple[WorkerState, list[Command]]:
    return state, [SendControl(Probed(event.probe, True, [t / state.misreport for t in event.times]).to_message())]


def _peer_measured(state: WorkerState, event: PeerMeasured) -> tuple[WorkerState, list[Command]]:
    if event.error is not None:
        return state, [SendControl(Probed(event.probe, False, error=event.error.splitlines()[0][:200]).to_message())]
    return state, [SendControl(Probed(event.probe, True, rtt_s=event.rtt_s, bandwidth_bytes_per_s=event.bandwidth_bytes_per_s).to_message())]


# -- the data path -------------------------------------------------------------------------------------------
def forward_problem(state: WorkerState, msg: Forward) -> tuple[ErrorCode, str] | None:
    """Why a FORWARD frame cannot run on this worker now, or None."""
    plan, batch, x = msg.plan, msg.batch, msg.x
    stage = state.stages.get(plan)
    if stage is None:
        return ErrorCode.NO_STAGE, f"worker {state.worker_id} holds no stage for plan {plan}"
    if x is None or x.ndim < 2 or x.shape[0] != len(batch) or not batch:
        return ErrorCode.BAD_INPUT, f"forward frame: x has {0 if x is None else x.shape[0]} rows for {len(batch)} sequences"
    session = state.sessions[stage.graph]
    if not session.takes_token_ids:  # a stage checks what its predecessor sent before using it
        problem = validate.activation_problem(x, session.hidden or None, stage.max_context)
        if problem:
            return ErrorCode.CORRUPT_INPUT, f"plan {plan}: {problem}"
    entries = msg.entries()
    for item in entries:  # a frame must start where the sequence's cache ends: a lost frame leaves a hole
        try:
            prefix = validate.prefix_entry({"prefix": item.prefix}) if item.prefix is not None else None
        except ValueError as exc:
            return ErrorCode.BAD_INPUT, str(exc)
        pos = item.pos
        # A stage without decoder layers (embedding or head alone) keeps no KV: nothing to check
        # (and no KV moves to it, so after a switch it has not heard of the sequence).
        held = state.length(stage.graph, item.seq)
        if prefix and prefix.get("reuse") and session.layers:  # cached blocks become the sequence's first positions
            if held:
                return ErrorCode.BAD_INPUT, f"{item.seq} already holds {held} positions: a prefix is installed into a new sequence only"
            held = len(prefix["reuse"]) * prefix["block"]
        if item.rewind and pos is not None and 0 <= pos < held:
            held = pos  # speculative decoding: the stage forgets the drafts the last verify rejected (runners.run)
        if pos is not None and session.layers and pos != held:
            return ErrorCode.CORRUPT_INPUT, f"plan {plan}: {item.seq} holds {held} positions, the frame starts at {pos} (a frame was lost)"
    if len(entries) != 1 and any(item.verify for item in entries):
        return ErrorCode.BAD_INPUT, "a verify frame holds one sequence"
    return None


def _forward(state: WorkerState, msg: Forward) -> tuple[WorkerState, list[Command]]:
    if state.drop_work:
        return state, []
    msg = without_dropped(state, msg)
    if msg is None:  # the stage's own next steps of sequences the coordinator dropped meanwhile (they stopped)
        return state, []
    problem = forward_problem(state, msg)
    if problem is not None:
        return state, errors_for(msg, *problem)
    stage = state.stages[msg.plan]
    x = msg.x  # fp16 on a half-width wire: the compute casts it for its graph (worker.runners)
    # A fast decode step runs on the loop, skipping two thread hand-offs per hop (a heartbeat
    # waits at most one such step). Slow steps and prefills use the thread, so the loop stays
    # free to answer heartbeats.
    inline = x.shape[1] == 1 and state.step_s.get(stage.graph, 0.0) < INLINE_STEP_S
    entries = msg.entries()
    prefixes = tuple((item.seq, item.prefix) for item in entries if item.prefix is not None)
    half = state.activation_dtype == "float16" and stage.next.kind == "worker"
    return state, [RunStage(msg, stage.graph, [item.seq for item in entries], x, inline and not prefixes, prefixes,
                            "float16" if half else None)]


def _computed(state: WorkerState, event: Computed) -> tuple[WorkerState, list[Command]]:
    msg, batch, plan = event.forward, event.forward.batch, event.forward.plan
    if event.joins != state.joins:  # rejoined meanwhile: that step belonged to the previous membership
        return state, []
    stage = state.stages.get(plan)
    graph = stage.graph if stage is not None else None
    step_s = {**state.step_s, graph: event.compute_s} if graph and event.positions == 1 else state.step_s
    extra = emulated_wait(state, stage, event)
    state = replace(_with_lengths(state, graph, event.lengths), step_s=step_s, busy_s=state.busy_s + event.compute_s + extra,
                    computed=state.computed + len(batch))
    commands: list[Command] = [Wait(extra)] if extra > 0 else []
    if stage is None:  # the plan was replaced while it computed: nobody waits for the result
        return state, commands
    out = event.out  # already in the wire's dtype (RunStage.out_dtype)
    elem = 2 if state.activation_dtype == "float16" else 4
    timings = list(msg.timings or []) + [[state.worker_id, (event.compute_s + extra) / state.misreport, event.positions, elem, len(batch)]]
    if stage.next.kind == "coordinator":
        entries = msg.entries()
        if not all(item.partial for item in entries):  # replay frames before the last: no token wanted
            tokens = [int(t) for t in event.out]  # a verify entry: the target's token after each of its positions
            chosen = {"tokens": tokens[-1:], "verified": [tokens]} if entries[0].verify else {"tokens": tokens}
            fed, feed = None, None
            itself = state.sessions[stage.graph].takes_token_ids  # a one-stage plan: it feeds itself; else the plan's first stage
            if event.positions == 1 and (itself or stage.first is not None):
                fed = [feeds_next(item, token) for item, token in zip(batch, chosen["tokens"])] if len(chosen["tokens"]) == len(batch) else None
                if fed is not None and any(fed):
                    feed = next_forward(plan, batch, chosen["tokens"], fed)
                elif not any(item.get("ahead") for item in batch):
                    fed = None  # nothing asked for the direct path: the frame is as it always was
            copy = Token(plan, batch, timings=timings, logprobs=event.logprobs.get("logprobs"), fed=fed, **chosen)
            # the next step first: it is the run's critical path, the coordinator's copy is not
            if feed is not None and not itself:  # the copy goes after the send, unfed if the send failed
                commands.append(FeedFirst(stage.first.url, plan, feed, stage.first_secret, stage.first.fingerprint, copy))
            else:
                commands += [FeedSelf(feed)] if feed is not None else []
                commands.append(SendControl(copy.to_message()))
        return state, commands
    # A replicated next stage: each row goes to the replica on its entry's route (a frame per
    # replica; the computations so far are timed in the first frame only, so they count once).
    rows: dict[str, tuple] = {}
    for i, item in enumerate(batch):
        hop = stage.next.toward([item])
        rows.setdefault(hop.id, (hop, []))[1].append(i)
    for k, (hop, mine) in enumerate(rows.values()):
        part, x = (batch, out) if len(mine) == len(batch) else ([batch[i] for i in mine], out[mine])
        sent = Forward(plan, part, [] if k else timings)
        if hop.relay:
            commands.append(SendControl(replace(sent, relay_to=hop.id).to_message({"x": x})))
        else:
            commands.append(SendPeer(hop.url, plan, sent.to_message({"x": x}),
                                     data_secret(state, hop.url, plan, hop.secret), hop.fingerprint, about=msg))
    return state, commands


# -- the direct token path ------------------------------------------------------------------------------------
def feeds_next(item: dict, token: int) -> bool:
    """Whether a last stage that also takes token ids feeds ``item``'s next step itself with the
    ``token`` it sampled: the coordinator allowed ``ahead`` more steps (``cluster.direct``), it is a
    decode step at a known position, greedy or sampled with the draw of each step it may feed
    (``uniforms``: the coordinator's), and ``token`` is not one of its ``stop`` ids (an end of
    sequence the coordinator would stop at). The coordinator hears which (``Token.fed``)."""
    ahead, stop, sampling = item.get("ahead"), item.get("stop") or (), item.get("sampling") or {}
    uniforms = item.get("uniforms")
    drawn = not sampling.get("do_sample") or (type(uniforms) is list and type(ahead) is int and len(uniforms) >= ahead
                                              and all(type(u) is float and 0 <= u < 1 for u in uniforms))
    return (type(ahead) is int and ahead > 0 and type(item.get("pos")) is int and not item.get("partial") and not item.get("verify")
            and drawn and token not in stop)


def next_forward(plan: int, batch: list, tokens: list[int], fed: list[bool]) -> Forward:
    """The frame of the fed entries' next steps: one position on, one step less ahead, marked
    ``direct`` (the stage's own, not the coordinator's), in the frame's order (a lane stays one batch);
    a sampled entry's next step samples with the first of its ``uniforms`` and passes on the rest."""
    items, ids = [], []
    for item, token, go in zip(batch, tokens, fed):
        if go:
            nxt = {k: v for k, v in item.items() if k not in ("prefix", "rewind", "partial")}
            nxt.update(step=item["step"] + 1, pos=item["pos"] + 1, ahead=item["ahead"] - 1, direct=True)
            if "uniforms" in item:
                nxt.update(sampling={**item["sampling"], "uniform": item["uniforms"][0]}, uniforms=item["uniforms"][1:])
            items.append(nxt)
            ids.append([token])
    return Forward(plan, items, tensors={"x": np.array(ids, np.int64)})


def without_dropped(state: WorkerState, msg: Forward) -> Forward | None:
    """A frame without the sequences it must not run: the stage's own next steps (``direct``
    entries) of sequences it no longer holds (the coordinator stopped them while the stage ran
    ahead), and any entry of a sequence this worker dropped that it does not hold (a stale frame:
    it would bring the dropped KV back, never to be freed). None when none is left; the rest of a
    frame for a stage this worker lacks goes on, to be refused as such."""
    batch, stale = msg.batch, state.dropped
    if not any(type(item) is dict and (item.get("direct") or item.get("seq") in stale) for item in batch):
        return msg
    stage = state.stages.get(msg.plan)
    if stage is not None and not session_layers(state, stage.graph):  # an embedding or a head alone holds no KV to tell
        return msg
    keep = [i for i, item in enumerate(batch)
            if not (item.get("direct") or item.get("seq") in stale) or (stage is not None and state.length(stage.graph, item["seq"]) > 0)]
    if len(keep) == len(batch):
        return msg
    if not keep:
        return None
    return Forward(msg.plan, [batch[i] for i in keep], msg.timings, tensors={"x": msg.x[keep]})


def emulated_wait(state: WorkerState, stage: Stage | None, event: Computed) -> float:
    """Seconds the emulated device still takes after the real compute of ``event`` (0: none emulated)."""
    if state.roofline is not None:
        entries = event.forward.entries()
        rows = len(entries) * event.positions
        head_rows = rows if any(e.verify for e in entries) else len(entries)  # a verify's head computes every position
        if stage is None:
            return state.roofline.extra_wait(event.compute_s, 0, rows)
        return state.roofline.extra_wait(event.compute_s, stage.compute_bytes, rows, min(stage.head_bytes, stage.compute_bytes), head_rows)
    return SlowdownPolicy(state.slowdown).extra_wait(event.compute_s, event.cpu_s)


def errors_for(msg, code: ErrorCode, text: str) -> list[Command]:
    """An ERROR to the coordinator for each sequence of a failed FORWARD (other frames: none)."""
    if not isinstance(msg, Forward):
        return []
    return [SendControl(Error(text, code, item.seq, item.step, item.rid).to_message()) for item in msg.entries()]


def _failed(state: WorkerState, event: Failed) -> tuple[WorkerState, list[Command]]:
    stage = state.stages.get(event.msg.plan) if isinstance(event.msg, Forward) else None
    if stage is not None:
        state = _with_lengths(state, stage.graph, event.lengths)
    if isinstance(event.msg, Kv):  # the mover waits for this move's answer
        return state, [_kv_ack(event.msg.move, ok=False, error=event.text)]
    return state, errors_for(event.msg, event.code, event.text)


def _with_lengths(state: WorkerState, graph: str | None, lengths: dict) -> WorkerState:
    """The KV positions the runner now holds for these sequences (a session without decoder
    layers holds none: nothing to track)."""
    if graph is None or not lengths or not state.sessions.get(graph, Session(graph, False, False, 0, ())).layers:
        return state
    return replace(state, held={**state.held, graph: {**state.held.get(graph, {}), **lengths}})


def _export(state: WorkerState, export: KvExport) -> tuple[WorkerState, list[Command]]:
    stage = state.stages.get(export.plan)
    if stage is None or export.seq not in state.held.get(stage.graph, {}) or not export.url:
        why = f"no stage for plan {export.plan}" if stage is None else "no destination" if not export.url else f"{export.seq} is not held here"
        return state, [_kv_ack(export.move, ok=False, error=why)]
    held = state.length(stage.graph, export.seq)
    if export.upto is not None and session_layers(state, stage.graph) and held < export.upto:  # positions it never had
        return state, [_kv_ack(export.move, ok=False, error=f"{export.seq} holds {held} positions, not {export.upto}")]
    return state, [ExportKv(export, stage.graph, data_secret(state, export.url, export.to_plan, export.secret))]


def _export_failed(state: WorkerState, event: ExportFailed) -> tuple[WorkerState, list[Command]]:
    return state, [_kv_ack(event.export.move, ok=False, error=event.error)]


def _kv_ack(move: int, **fields) -> SendControl:
    return SendControl(Loaded(kv_received=move, **fields).to_message())


def session_layers(state: WorkerState, graph: str) -> tuple[int, ...]:
    session = state.sessions.get(graph)
    return session.layers if session is not None else ()


def _import(state: WorkerState, msg: Kv) -> tuple[WorkerState, list[Command]]:
    stage = state.stages.get(msg.plan)
    if stage is None:
        return state, [_kv_ack(msg.move, ok=False, error=f"no stage for plan {msg.plan}")]
    return state, [ImportKv(msg, stage.graph, state.sessions[stage.graph].layers)]


def _imported(state: WorkerState, event: Imported) -> tuple[WorkerState, list[Command]]:
    held = {**state.held.get(event.graph, {}), event.kv.seq: event.length}
    dropped = dict(state.dropped)
    dropped.pop(event.kv.seq, None)  # moved back here: its frames are live again
    return replace(state, held={**state.held, event.graph: held}, dropped=dropped), [
        _kv_ack(event.kv.move, plan=event.kv.plan, ok=True, bytes=event.nbytes)]


_HANDLERS = {
    Joined: _joined, Pinged: _pinged, Load: _load, Fetched: _fetched, Built: _built, LoadFailed: _load_failed,
    Activate: _activate, Drop: _drop, Emulate: _emulate, Probe: _probe, StageTimed: _stage_timed,
    PeerMeasured: _peer_measured, Computed: _computed, Failed: _failed, KvExport: _export, ExportFailed: _export_failed,
    Imported: _imported, Forward: _forward, Kv: _import,
}


# -- pure helpers the shell uses -----------------------------------------------------------------------------
def data_secret(state: WorkerState, url: str | None, plan: int, given: str | None) -> str | None:
    """The secret of the stage at ``url`` for ``plan``: as issued by the coordinator, else derived
    from the join token, else none (a cluster without a join token is open)."""
    from ..net import auth

    if given:
        return given
    return auth.derived_secret(state.join_token, url, plan) if state.join_token and url else None


def feed_secret(state: WorkerState, url: str | None, plan: int, given: str | None) -> str | None:
    """What a plan's last stage presents at its first stage (at ``url``) to feed it a direct run's
    next step: as issued by the coordinator, else derived from the join token, else none (an open cluster)."""
    from ..net import auth

    if given:
        return given
    return auth.derived_feed_secret(state.join_token, url, plan) if state.join_token and url else None


def admit_data(state: WorkerState, plan: int | None, bearer_ok) -> int | None:
    """The frame limit for a data-port connection that names ``plan`` (``bearer_ok(secret)``
    says whether its Authorization presents ``secret``), or None to refuse it."""
    if plan == PROBE_PLAN and bearer_ok(state.probe_secret):
        return PROBE_PLAN_FRAME_LIMIT
    stage = state.stages.get(plan) if plan is not None else None
    if stage is not None and (stage.secret is None or bearer_ok(stage.secret) or admit_feed(state, plan, bearer_ok)):
        return stage.frame_limit
    return None


def admit_feed(state: WorkerState, plan: int | None, bearer_ok) -> bool:
    """Whether a data-port connection for ``plan`` is its last stage feeding this first stage the
    next steps of direct runs (the one connection that may carry token ids): closed unless the
    stage's LOAD named the peer (``fed_by``), and then only with its feed secret (an open cluster: none)."""
    stage = state.stages.get(plan) if plan is not None else None
    return stage is not None and stage.fed_by is not None and (stage.feed_secret is None or bearer_ok(stage.feed_secret))


PROBE_PLAN_FRAME_LIMIT = (1 << 20) + limits.HEADER_SLACK_BYTES  # largest frame a probe connection may send
