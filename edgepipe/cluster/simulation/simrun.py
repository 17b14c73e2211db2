"""Seeded fault schedules for the simulation (``sim``) and the invariants checked after each.

``Schedule.random(seed)`` (``sim_schedule``) draws 1-6 workers (some joining late), a few requests (some with
out-of-range values), faults from ``sim.FAULTS`` and, in some, an operator's plan with a replicated
stage (``_replicate``: the faults then hit replicas too); ``run(schedule)`` plays it on a virtual
clock and returns a ``Report``. Invariants: every admitted request ends with exactly the
reference tokens or a one-line ``RequestFailed`` within ``bound_s`` (``REQUEST_BOUND_S`` plus
``PER_FAULT_S`` per fault in the schedule); no admission slot, KV reservation, pending step,
load/probe future or KV move is left over; when the live workers can hold the model the
cluster is Up within ``UP_BOUND_S`` of the last fault healing, and once Up after the faults it
serves a new request (liveness: retrying forever until the plan changes is not an answer). Replay one seed
(under any hash seed): ``python -m edgepipe.cluster.simulation.simrun SEED``; play a range of seeds and print a JSON
summary: ``python -m edgepipe.cluster.simulation.simrun --play FIRST COUNT``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass, field

from ..rules.planning import MemoryProportional, PlannerPolicy
from .sim import (QUARANTINE_FAULTS, SETTINGS, UP_BOUND_S, UNIT_BYTES, Admission, Coordinator, CoordinatorSettings, FakePackage, FakeWorker,
                  GenerationParams, Net, Phase, RequestFailed, VirtualLoop, can_hold, reference)
from ..state import sequence_ids, state as S
from ..shells.admission import AdmissionError
from .sim_replicas import replica_counts, replicate
from .sim_schedule import Fault, Req, Schedule  # noqa: F401 - Fault and Req: where callers know them

@dataclass
class Report:
    seed: int
    kinds: tuple[str, ...]
    violations: list[str] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    rejected: int = 0
    time_to_up: float | None = None
    worst_ok_s: float = 0.0
    worst_error_s: float = 0.0
    errors_seen: list[str] = field(default_factory=list)
    prefix_hits: int = 0  # prompt prefills that started from cached blocks
    prefix_dropped: int = 0  # times a coordinator dropped its whole prefix cache (plan switch, failed frame, miss)
    checkpoints: int = 0  # KV checkpoints every spare holder acknowledged
    resumed: int = 0  # sequences that resumed from a checkpoint after a recovery (the rest replayed whole)
    checkpoints_failed: int = 0  # checkpoints voided because a copy failed
    replicated: int = 0  # plans with a replicated stage committed
    replica_lost: int = 0  # workers lost while they ran a replica of the active plan
    prepared: list[float] = field(default_factory=list)  # when each plan began to be prepared (virtual seconds)
    prepare_failed: int = 0  # plans that failed to prepare
    dashboard: list[str] = field(default_factory=list)  # the kinds of the dashboard's lines, in order (every coordinator's)
    direct: int = 0  # decode steps a last stage fed itself (the direct token path)
    direct_lost: int = 0  # of its feeds and token copies, those a fault lost
    direct_first: int = 0  # of ``direct``, those a plan of several stages' last stage fed its first stage
    kv_left: list = field(default_factory=list)  # "worker:seq" of sequence KV live workers still hold at the end (``_held_sequences``; a violation)


class World:
    def __init__(self, schedule: Schedule):
        self.schedule, self.seed = schedule, schedule.seed
        self.net = Net(random.Random(schedule.seed))
        self.tasks: set[asyncio.Task] = set()
        self.coordinators: list[tuple[Coordinator, Admission]] = []
        self.workers: list[FakeWorker] = []

    @property
    def coordinator(self) -> Coordinator:
        return self.coordinators[-1][0]

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def start_coordinator(self) -> None:
        # As ``edgepipe serve`` runs it: calibration (stage timings, uplink and peer-link probes),
        # the planner's policy (objective, switch-or-stay, churn) and its spare plan for recovery.
        policy = MemoryProportional() if self.schedule.memory_placement else PlannerPolicy()  # serve --placement memory|planner
        coord = Coordinator(FakePackage(two_forms=bool(self.schedule.kernel_less)), CoordinatorSettings(**{**SETTINGS, **({} if self.schedule.kv_checkpoints else {"kv_checkpoint_tokens": 0})}), plan_fn=policy,
                            clock=asyncio.get_running_loop().time)
        await coord.start()
        admission = Admission(max_active=4, max_queue=8)
        admission.bind(coord)  # as ``create_app`` does: the book is the coordinator's state
        self.coordinators.append((coord, admission))


async def _client(world: World, req: Req, rid: str, report: Report) -> None:
    loop = asyncio.get_running_loop()
    coord, admission = world.coordinators[-1]
    prompt, max_tokens, top_k = list(req.prompt), req.max_tokens, 0
    if req.bad == "top_k":
        top_k = 1 << 64
    elif req.bad == "context":
        prompt = prompt * 300
    try:
        params = GenerationParams(max_tokens=0 if req.bad == "max_tokens" else max_tokens, top_k=top_k)
        state = coord.new_sequence(prompt, params, lambda ids: " ".join(map(str, ids)))
        ticket = await admission.admit(len(prompt) + max_tokens)
    except (ValueError, AdmissionError) as exc:
        if req.bad is None and isinstance(exc, ValueError):
            report.violations.append(f"{rid}: a valid request was refused: {exc}")
        report.rejected += 1
        return
    except Exception as exc:  # noqa: BLE001 - a crash before admission is a bug too
        report.violations.append(f"{rid}: {type(exc).__name__} before admission: {exc}")
        return
    if req.bad:
        report.violations.append(f"{rid}: a request with bad {req.bad} was admitted")
    t0 = loop.time()
    try:
        stream = coord.stream(state, rid)
        async for _ in stream:
            if req.cancel_after is not None and len(state.generated) >= req.cancel_after:
                await stream.aclose()  # the client went: its sequence ends with a DROP
                break
        took = loop.time() - t0
        report.ok += 1
        report.worst_ok_s = max(report.worst_ok_s, took)
        want = reference(prompt, max_tokens)[:len(state.generated) if req.cancel_after is not None else None]
        if state.generated != want:
            report.violations.append(f"{rid}: tokens {state.generated} != reference {want}")
    except RequestFailed as exc:
        took = loop.time() - t0
        report.errors += 1
        report.worst_error_s = max(report.worst_error_s, took)
        report.errors_seen.append(str(exc))
        if not str(exc) or "\n" in str(exc):
            report.violations.append(f"{rid}: error is not one line: {str(exc)!r}")
    except Exception as exc:  # noqa: BLE001 - anything else is a bug
        took = loop.time() - t0
        report.violations.append(f"{rid}: {type(exc).__name__}: {exc}")
    finally:
        admission.release(ticket)
    if took > world.schedule.bound_s:
        report.violations.append(f"{rid}: took {took:.1f} s > bound {world.schedule.bound_s:.0f} s")


async def _fault(world: World, f: Fault) -> float:
    """Carry out one fault; returns when its effect ends (virtual seconds)."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    w = world.workers[f.worker]
    if f.kind == "kill":
        w.kill()
    elif f.kind == "stall":
        w.stalled_until = now + f.seconds
    elif f.kind == "drop_work":
        w.dropping_until = now + f.seconds
    elif f.kind == "slow":
        w.slowdown = f.factor
    elif f.kind == "partition_coord":
        world.net.held_until[w.name] = now + f.seconds
    elif f.kind == "partition_peer":
        world.net.peer_cut_until[w.name] = now + f.seconds
    elif f.kind == "reconnect" and w.control is not None and not w.dead:
        await w.control.close("reconnect")
    elif f.kind == "restart":
        old = world.coordinator
        await world.start_coordinator()
        await old.stop()
    elif f.kind == "malformed" and not w.dead:
        w.malformed = 1 + f.worker % 4
    elif f.kind == "forget_prefixes":  # its cached blocks are gone, unknown to the coordinator
        w.model.prefixes.clear()
    elif f.kind == "refuse_kv":  # KV sent to it fails (targeted schedules only: not among the random FAULTS)
        w.refusing_kv_until = now + f.seconds
    elif f.kind == "lose_feed":  # the direct path: the next steps its last stage feeds are lost (targeted schedules)
        w.losing_feed_until = now + f.seconds
    elif f.kind == "refuse_feed":  # the direct path: its sends of the next step to the first stage fail (targeted schedules)
        w.refusing_feed_until = now + f.seconds
    elif f.kind == "lose_copy":  # the direct path: the coordinator's copies of the tokens it fed are lost (targeted schedules)
        w.losing_copy_until = now + f.seconds
    return now + (f.seconds if f.kind in ("stall", "partition_coord", "partition_peer", "drop_work", "refuse_kv", "lose_feed", "lose_copy",
                                  "refuse_feed")
                  else 0.0)


def _leaks(coord: Coordinator, admission: Admission) -> list[str]:
    out = []
    if coord.cluster.steps.inflight or coord.steps.waiters:
        out.append(f"pending steps left: {sorted(f.seq for f in coord.cluster.steps.inflight.values())}, awaited {sorted(coord.steps.waiters)}")
    if coord.cluster.requests:
        out.append(f"KV reservations left: {sorted(coord.cluster.requests)}")
    if admission.running or admission.queued:
        out.append(f"admission slots left: {len(admission.running)} running, {admission.queued} queued")
    if any(link.loads or link.probes for link in coord.links.values()):
        out.append(f"load/probe futures left: {[(w, sorted(l.loads), sorted(l.probes)) for w, l in coord.links.items() if l.loads or l.probes]}")
    if coord.cluster.moves or coord.deployer.migration.acks:
        out.append(f"KV moves left: {sorted(coord.cluster.moves)}, awaited {sorted(coord.deployer.migration.acks)}")
    if coord.cluster.steps.ahead:
        out.append(f"direct runs left: {sorted(coord.cluster.steps.ahead)}")
    if not coord.cluster.steps.lanes.idle() or coord.steps.outgoing:
        out.append(f"lane members left (frames waiting: {sorted(coord.steps.outgoing)})")
    if coord.cluster.prefix.cache.pending:
        out.append(f"prefix decisions never committed or dropped: {sorted(coord.cluster.prefix.cache.pending)}")
    cached, active = coord.cluster.prefix.cache, coord.cluster.active
    if cached.blocks and (active is None or cached.plan != active.plan_id):  # a switch or a recovery invalidates it
        out.append(f"prefix blocks of plan {cached.plan} kept while {active.plan_id if active else 'no plan'} is active")
    copies = coord.cluster.checkpoint_copies
    if copies or coord.checkpoints.acks or coord.cluster.checkpoints:
        out.append(f"KV checkpoints left: {sorted(copies.placed)} placed, {sorted(copies.flying)} in flight, {len(copies.copies)} copies")
    return out


def _held_sequences(workers: list[FakeWorker]) -> list[str]:
    """Sequence KV (not checkpoints) a live worker still holds once every request has ended: a DROP
    that missed a stage (the direct path's targeted schedules check it is empty: a run's steps past
    a stop must go at every stage)."""
    return sorted(f"{w.name}:{seq}" for w in workers if not w.dead for kv in w.model.kv.values() for seq in kv
                  if not sequence_ids.is_checkpoint(seq))


def _held_checkpoints(workers: list[FakeWorker]) -> list[str]:
    """Checkpoint KV (``<rid>.c<n>``) a live worker still holds once every request has ended."""
    return sorted(f"{w.name}:{seq}" for w in workers if not w.dead for kv in w.model.kv.values() for seq in kv
                  if sequence_ids.is_checkpoint(seq))


async def _main(schedule: Schedule) -> Report:
    loop = asyncio.get_running_loop()
    report = Report(schedule.seed, tuple(f.kind for f in schedule.faults))
    world = World(schedule)
    await world.start_coordinator()
    budgets = dict(enumerate(schedule.budgets))
    world.workers = [FakeWorker(world, f"n{i}", m, kernel=i not in schedule.kernel_less, budget=budgets.get(i))
                     for i, m in enumerate(schedule.memories)]
    plan = sorted([(t, 0, i) for i, t in enumerate(schedule.join_at)] + [(r.at, 1, i) for i, r in enumerate(schedule.requests)]
                  + [(f.at, 2, i) for i, f in enumerate(schedule.faults)] + ([(schedule.replicate, 3, 0)] if schedule.replicate is not None else []))
    clients, healed = [], 0.0
    for at, kind, i in plan:
        if at > loop.time():
            await asyncio.sleep(at - loop.time())
        if kind == 0:
            world.workers[i].start()
        elif kind == 1:
            clients.append(world.spawn(_client(world, schedule.requests[i], f"q{i}", report)))
        elif kind == 3:
            world.spawn(replicate(world.coordinator))
        else:
            healed = max(healed, await _fault(world, schedule.faults[i]))
    healed = max(healed, loop.time())
    faults_over = healed
    coord = world.coordinator
    # A quarantine is a deliberate, bounded exclusion: only a worker that really dropped work
    # (stalled, cut off, dropping frames) may get one, and the Up bound counts from its end.
    faulted = {world.workers[f.worker].name for f in schedule.faults if f.kind in QUARANTINE_FAULTS}

    def unfair_quarantines() -> list[str]:
        return [f"{identity[0]} quarantined without a fault that drops work: {q.why}" for c, _ in world.coordinators
                for identity, q in c.cluster.quarantine.items() if identity[0] not in faulted]

    report.violations += unfair_quarantines()
    quarantined = [q.until for q in coord.cluster.quarantine.values()]
    healed = max([healed, *quarantined])
    # Up within the bound once faults are over, if the live workers can hold the model.
    while loop.time() < healed + UP_BOUND_S and coord.state is not Phase.UP:
        await asyncio.sleep(0.25)
    alive = [w for w in world.workers if not w.dead and w.tasks]
    joined = {info.name: info.joined_at for info in coord.cluster.workers.values()}
    alive.sort(key=lambda w: (joined.get(w.name, float("inf")), w.name))  # can_hold splits in join order
    memories = [w.memory for w in alive]
    if coord.state is Phase.UP:
        report.time_to_up = max(0.0, loop.time() - healed)
    elif can_hold(memories):
        report.violations.append(f"not Up {UP_BOUND_S:.0f} s after the last fault healed although the live workers "
                                 f"{[m // UNIT_BYTES for m in memories]} (x100 MB) can hold the model ({coord.cluster.last_failure})")
    deadline = loop.time() + schedule.bound_s * 2
    while any(not c.done() for c in clients) and loop.time() < deadline:
        await asyncio.sleep(0.5)
    hung = sum(not c.done() for c in clients)
    if hung:
        report.violations.append(f"{hung} request(s) still running {schedule.bound_s * 2:.0f} s after the faults")
    report.violations += [v for v in unfair_quarantines() if v not in report.violations]  # those the requests' steps led to
    # Liveness: once no fault is under way and the cluster is Up, a new request is served when the
    # workers not sitting out a quarantine can hold the model.
    await asyncio.sleep(max(0.0, faults_over - loop.time()))
    while loop.time() < faults_over + UP_BOUND_S and coord.state is not Phase.UP:
        await asyncio.sleep(0.25)
    benched = {identity[0] for identity, q in coord.cluster.quarantine.items() if q.until > loop.time()}
    if coord.state is Phase.UP and can_hold([w.memory for w in alive if w.name not in benched]):
        probe = Report(schedule.seed, ())
        await _client(world, Req(loop.time(), (1, 2, 3), 4), "probe", probe)
        if probe.ok != 1:
            report.violations.append(f"Up after the faults, yet a new request was not served: "
                                     f"{(probe.errors_seen or probe.violations or ['no answer'])[0]}")
    await asyncio.sleep(SETTINGS["step_timeout_s"] + 2)  # background clean-up (KV drops) finishes
    first = [set(_leaks(c, adm)) for c, adm in world.coordinators]
    await asyncio.sleep(SETTINGS["load_timeout_s"] + 1)  # a load or move seen in flight twice, that long apart, leaked
    for i, (c, adm) in enumerate(world.coordinators):
        report.violations += [f"coordinator {i}: {leak}" for leak in _leaks(c, adm) if leak in first[i]]
    if world.coordinators[-1][0].links and (held := _held_checkpoints(world.workers)):
        report.violations.append(f"checkpoint KV still held by workers: {held}")
    report.checkpoints = sum(c.checkpoints.counts.sent for c, _ in world.coordinators)
    report.resumed = sum(c.checkpoints.counts.resumed for c, _ in world.coordinators)
    report.checkpoints_failed = sum(c.checkpoints.counts.failed for c, _ in world.coordinators)
    report.prefix_hits = sum(c.cluster.prefix.counts.hits for c, _ in world.coordinators)
    report.replicated, report.replica_lost = (sum(n) for n in zip(*(replica_counts(c) for c, _ in world.coordinators)))
    report.prefix_dropped = sum(c.cluster.prefix.counts.dropped for c, _ in world.coordinators)
    history = [e for c, _ in world.coordinators for e in c.history.events]
    report.prepared = sorted(e.now for e in history if isinstance(e, S.Preparing))
    report.prepare_failed = sum(isinstance(e, S.PrepareFailed) for e in history)
    report.dashboard = [str(line.get("kind")) for c, _ in world.coordinators for line in c.events]
    report.direct = sum(w.fed for w in world.workers)
    report.direct_lost = sum(w.feeds_lost + w.copies_lost for w in world.workers)
    report.direct_first = sum(w.fed_first for w in world.workers)
    report.kv_left = _held_sequences(world.workers)
    if report.kv_left:
        report.violations.append(f"sequence KV still held by workers after every request ended: {report.kv_left[:8]}")
    for w in world.workers:
        w.kill()
    for c, _ in world.coordinators:
        await c.stop()
    return report


def run(schedule: Schedule) -> Report:
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(_main(schedule))
    finally:
        settle(loop)


def settle(loop: asyncio.AbstractEventLoop, rounds: int = 10) -> None:
    """Cancel what still runs on ``loop`` and let it finish, then close the loop. A worker shell
    that is cancelled closes its channels in tasks of its own: those are let finish too, so no
    coroutine is left for the garbage collector to finalise later (in another test's code)."""
    for _ in range(rounds):
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            break
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def replay_command(seed: int) -> str:
    return f".venv/bin/python -m edgepipe.cluster.simulation.simrun {seed}"  # any hash seed (test_sim)


if __name__ == "__main__":
    if sys.argv[1] == "--play":
        from .simplay import play

        print(json.dumps(play(int(sys.argv[2]), int(sys.argv[3]))))
        sys.exit(0)
    r = run(Schedule.random(int(sys.argv[1])))
    print(Schedule.random(int(sys.argv[1])))
    print(r)
    sys.exit(1 if r.violations else 0)
