"""Replicated stages in the deterministic simulation (real coordinator, fake workers running the
worker core, virtual clock): an operator's plan replicates the last stage over two workers;
concurrent sequences are spread over both replicas and every one streams exactly its reference;
killing one replica mid-stream recovers the plan (sequences resume from the KV checkpoints
taken from their replicas), and switching to the replicated plan and away
from it mid-stream moves each sequence's KV to and from its replica; every sequence still ends
exact, with no KV left anywhere."""

from __future__ import annotations

import asyncio
import logging

import pytest

from edgepipe.cluster.state import state as S
from edgepipe.cluster.state.placement import StageAssignment as A
from edgepipe.cluster.simulation.sim import SETTINGS, UNIT_BYTES, UNIT_KV_ROOM, FakeWorker, GenerationParams, Phase, VirtualLoop, reference
from edgepipe.cluster.simulation.simrun import Schedule, World, settle
from edgepipe.cluster.rules.profiling import RUNTIME_OVERHEAD_BYTES

MEMORY = 16 * (UNIT_BYTES + UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES  # each could hold the model twice over
MAX_TOKENS = 40
PROMPTS = [(5, 6, 7), (8, 9), (10, 11, 12, 13), (14,), (15, 16), (17, 18, 19)]


async def _until(predicate, limit_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        assert loop.time() < deadline, "timed out (virtual time)"
        await asyncio.sleep(0.25)


async def _scenario(mode: str) -> dict:
    kill = mode == "kill"
    world = World(Schedule(0, (MEMORY,) * 3, (0.0,) * 3, (), ()))
    await world.start_coordinator()
    coord = world.coordinator
    world.workers = [FakeWorker(world, f"n{i}", MEMORY) for i in range(3)]
    for w in world.workers:
        w.start()
    await _until(lambda: coord.state is Phase.UP and len(coord.cluster.workers) == 3, 30)
    await asyncio.sleep(2 * SETTINGS["replan_every_s"])
    a, b, c = sorted(coord.cluster.workers)
    # the replicated plan (mode "switch": first one without replicas, the replicated one mid-stream)
    stages = [A(a, 0, 3), A(b, 3, coord.n_units)] + ([] if mode == "switch" else [A(c, 3, coord.n_units)])
    dep = await coord.deploy(stages, reason="manual rebalance", pin_s=600.0)
    routes: dict[str, tuple] = {}
    states = {}

    async def client(i: int, prompt) -> None:
        rid = f"q{i}"
        st = states[rid] = coord.new_sequence(list(prompt), GenerationParams(max_tokens=MAX_TOKENS), lambda ids: " ".join(map(str, ids)))
        async for _ in coord.stream(st, rid):
            q = coord.cluster.requests.get(rid)
            if q is not None and q.route is not None and q.route[0] == dep.plan_id:
                routes[rid] = q.route[1]

    clients = [asyncio.ensure_future(client(i, p)) for i, p in enumerate(PROMPTS)]
    if mode == "switch":
        await _until(lambda: len(states) == len(PROMPTS) and all(len(s.generated) >= 4 for s in states.values()), 60)
        dep = await coord.deploy([A(a, 0, 3), A(b, 3, coord.n_units), A(c, 3, coord.n_units)], reason="manual rebalance", pin_s=600.0)
    await _until(lambda: len(routes) == len(PROMPTS) and all(len(s.generated) >= 6 for s in states.values()), 60)
    # a sequence's KV is on its route's replica only
    ids = {info.name: wid for wid, info in coord.cluster.workers.items()}
    held = {ids[w.name]: {seq.split(".")[0] for kv in w.model.kv.values() for seq in kv if not seq.rsplit(".", 1)[-1].startswith("c")}
            for w in world.workers}  # (<rid>.c<n>: a KV checkpoint the spare plan's holder keeps)
    misplaced = sorted(rid for rid, route in routes.items() for wid in (b, c) if wid not in route and rid in held[wid])
    on_route = all(rid in held[wid] for rid, route in routes.items() for wid in route)
    if mode == "switch":  # and away again, to a plan that cuts elsewhere
        live_then = len(coord.cluster.requests)
        back = await coord.deploy([A(a, 0, 4), A(c, 4, coord.n_units)], reason="manual rebalance", pin_s=600.0)
    if kill:
        victim = next(w for w in world.workers if w.name == coord.cluster.workers[c].name)
        victim.kill()
    await asyncio.wait_for(asyncio.gather(*clients), 300)
    await asyncio.sleep(SETTINGS["step_timeout_s"] + 2)  # the DROPs of finished sequences arrive
    seen = {
        "exact": {rid: st.generated == reference(list(p), MAX_TOKENS) for (rid, st), p in zip(sorted(states.items(), key=lambda kv: int(kv[0][1:])), PROMPTS)},
        "replicas_used": sorted({r[1] for r in routes.values()}),
        "first_stage": sorted({r[0] for r in routes.values()}),
        "kv_left": {w.name: sum(len(kv) for kv in w.model.kv.values()) for w in world.workers if not w.dead},
        "plan_after": coord.cluster.active is not None and coord.cluster.active.plan_id != dep.plan_id,
        "moved_to": [sum(isinstance(e, S.KvMoved) and e.plan == p for e in coord.history.events)
                     for p in ((dep.plan_id, back.plan_id) if mode == "switch" else ())],
        "live_then": live_then if mode == "switch" else None,
        "checkpoints": coord.checkpoints.counts.sent, "resumed": coord.checkpoints.counts.resumed,
        "requests_left": sorted(coord.cluster.requests),
        "pending_left": sorted(coord.cluster.steps.inflight) + sorted(coord.steps.waiters),
        "expected_replicas": sorted([b, c]), "expected_first": [a], "misplaced": misplaced, "on_route": on_route,
    }
    for w in world.workers:
        w.kill()
    await coord.stop()
    return seen


def _run(mode: str) -> dict:
    logging.disable(logging.CRITICAL)
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(_scenario(mode))
    finally:
        settle(loop)
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("mode", ["replicas", "kill", "switch"])
def test_sequences_spread_over_replicas_and_survive_a_replica_loss_and_switches(mode):
    seen = _run(mode)
    assert all(seen["exact"].values()), seen["exact"]
    assert seen["replicas_used"] == seen["expected_replicas"]  # both replicas of the last stage carried sequences
    assert seen["first_stage"] == seen["expected_first"]
    assert seen["on_route"] and not seen["misplaced"]
    assert seen["plan_after"] is (mode != "replicas")  # a lost replica: the plan recovered (whole-plan recovery)
    if mode == "kill":  # the spare held checkpoints taken from each sequence's replicas: they resumed from them
        assert seen["resumed"] > 0, seen
    if mode == "switch":  # every sequence's KV moved onto its replica, and off it again
        assert seen["moved_to"] == [len(PROMPTS), seen["live_then"]] and seen["live_then"] > 0, seen
    assert not seen["requests_left"] and not seen["pending_left"]
    assert all(n == 0 for n in seen["kv_left"].values()), seen["kv_left"]
