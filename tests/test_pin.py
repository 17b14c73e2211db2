"""An operator's plan stays: ``POST /v1/cluster/rebalance`` with ``pin_s`` keeps the re-planner
from replacing it for that long; without a pin the planner moves back to its own plan; a lost
worker ends a pin (the plan is abandoned and recovery is not pinned). Driven in the deterministic
simulation (real coordinator, fake workers, virtual clock)."""

from __future__ import annotations

import asyncio
import logging

from edgepipe.cluster.state.placement import StageAssignment as A
from edgepipe.cluster.simulation.sim import SETTINGS, UNIT_BYTES, UNIT_KV_ROOM, FakeWorker, Phase, VirtualLoop
from edgepipe.cluster.simulation.simrun import Schedule, World, settle
from edgepipe.cluster.rules.profiling import RUNTIME_OVERHEAD_BYTES

# Each can hold the whole model, and its stage of the plan being replaced beside the new one
# (a worker keeps the active plan's stage until the switch: the worker core counts both).
MEMORY = 16 * (UNIT_BYTES + UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES


async def _until(predicate, limit_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        assert loop.time() < deadline, "timed out (virtual time)"
        await asyncio.sleep(0.25)


def _stages(coord) -> list[tuple[str, int, int]]:
    return [(s.worker_id, s.start, s.end) for s in coord.cluster.active.stages]


async def _scenario() -> dict:
    world = World(Schedule(0, (MEMORY, MEMORY), (0.0, 0.0), (), ()))
    await world.start_coordinator()
    coord = world.coordinator
    world.workers = [FakeWorker(world, f"n{i}", MEMORY) for i in range(2)]
    for w in world.workers:
        w.start()
    await _until(lambda: coord.state is Phase.UP and len(coord.cluster.workers) == 2, 30)
    await asyncio.sleep(2 * SETTINGS["replan_every_s"])
    ids = sorted(coord.cluster.workers)
    own = _stages(coord)
    manual = [A(ids[0], 0, 1), A(ids[1], 1, coord.n_units)]
    if own == [(s.worker_id, s.start, s.end) for s in manual]:
        manual = [A(ids[1], 0, 1), A(ids[0], 1, coord.n_units)]
    seen: dict = {"own": own}

    unpinned = await coord.deploy(manual, reason="manual rebalance")
    await asyncio.sleep(3 * SETTINGS["replan_every_s"])
    seen["unpinned_replaced"] = coord.cluster.active.plan_id != unpinned.plan_id

    pinned = await coord.deploy(manual, reason="manual rebalance", pin_s=60.0)
    await asyncio.sleep(40.0)
    seen["pinned_kept_40s"] = coord.cluster.active.plan_id == pinned.plan_id and coord.status()["plan"]["pinned_s"] is not None
    await asyncio.sleep(30.0)
    seen["replaced_after_pin"] = coord.cluster.active.plan_id != pinned.plan_id and coord.status()["plan"]["pinned_s"] is None

    again = await coord.deploy(manual, reason="manual rebalance", pin_s=600.0)
    next(w for w in world.workers if w.name == coord.cluster.workers[manual[0].worker_id].name).kill()
    await _until(lambda: coord.state is Phase.UP and coord.cluster.active.plan_id != again.plan_id, 60)
    seen["recovered_unpinned"] = not coord.cluster.pinned(asyncio.get_running_loop().time())
    for w in world.workers:
        w.kill()
    await asyncio.sleep(0.01)  # the killed shells' tasks end on the loop
    await coord.stop()
    return seen


def test_a_pinned_manual_plan_stays_until_its_time_or_a_lost_worker():
    logging.disable(logging.CRITICAL)
    loop = VirtualLoop()
    try:
        seen = loop.run_until_complete(_scenario())
    finally:
        settle(loop)
        logging.disable(logging.NOTSET)
    assert seen == {"own": seen["own"], "unpinned_replaced": True, "pinned_kept_40s": True, "replaced_after_pin": True,
                    "recovered_unpinned": True}, seen
