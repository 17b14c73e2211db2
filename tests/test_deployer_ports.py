"""The deployer and the calibrator run on what they are lent (``cluster.ports.Ports``), with no
coordinator: a bare state, a profile, links whose channels answer loads, the plan policy. A plan
change is read back as the events they emitted and the frames they sent (no process, no model)."""

from __future__ import annotations

import asyncio

from edgepipe.cluster.state import state as S
from edgepipe.cluster.shells.calibration import Calibrator
from edgepipe.cluster.shells.deployer import Deployer
from edgepipe.cluster.state.placement import StageAssignment as A
from edgepipe.cluster.rules.planning import MemoryProportional, PlanContext
from edgepipe.cluster.shells.ports import Ports
from edgepipe.cluster.rules.profiling import ClusterProfile
from edgepipe.cluster.state.settings import CoordinatorSettings
from edgepipe.cluster.simulation.sim import FakePackage
from edgepipe.cluster.shells.views import Link, WorkerView
from edgepipe.net.messages import Hello, Loaded, parse
from edgepipe.net.protocol import MessageType as T, decode


class AnsweringChannel:
    """A worker's control channel that answers every LOAD at once (ok) and records every frame."""

    def __init__(self, name: str, links: dict):
        self.name, self.links, self.sent = name, links, []

    async def send(self, frame: bytes) -> None:
        msg = decode(frame)
        self.sent.append(msg)
        if msg.type is T.LOAD:
            fut = self.links[self.name].loads.get(msg.get("plan"))
            if fut is not None and not fut.done():
                fut.set_result(Loaded(ok=True, plan=msg.get("plan")))


def test_a_plan_change_carried_out_on_lent_ports_alone():
    async def main():
        package, settings = FakePackage(), CoordinatorSettings(calibrate=False)
        profile = ClusterProfile(package.manifest)
        box = {"state": S.ClusterState()}
        events, tasks = [], []
        links: dict[str, Link] = {}

        def emit(event):
            box["state"] = S.apply(box["state"], event)
            events.append(event)
            return box["state"]

        for i, name in enumerate(("w1", "w2")):
            links[name] = Link(AnsweringChannel(name, links))
            hello = Hello.from_fields({"name": name, "memory_bytes": 8 << 30, "data_url": f"tcp://{name}:1"})
            emit(S.WorkerJoined(name, name, hello, float(i)))
        ports = Ports(state=lambda: box["state"], emit=emit, measure=profile.apply, note=lambda kind, **f: events.append(kind),
                      clock=lambda: 10.0, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1],
                      links=lambda: links, replan_wanted=asyncio.Event(), settings=settings, package=package, profile=profile)
        views = lambda: {w: WorkerView(info, links[w]) for w, info in box["state"].workers.items()}  # noqa: E731
        context = lambda workers: PlanContext(box["state"], profile, workers, 10.0, 64, 1.0)  # noqa: E731
        policy = MemoryProportional()
        calibrator = Calibrator(ports, policy, context, views)
        deployer = Deployer(ports, calibrator, policy, context, views, lacking=lambda: None, steps_in_flight=lambda: False)
        deployer.migrate_kv = False  # no sequence runs: no KV to move (``migration`` is the coordinator's to attach)

        first = await deployer.replan()
        assert first is not None and box["state"].active == first and box["state"].phase is S.Phase.UP
        n = len(package.manifest.units)
        second = await deployer.deploy([A("w2", 0, n // 2), A("w1", n // 2, n)], reason="operator")
        await asyncio.gather(*tasks, return_exceptions=True)
        return box["state"], events, links, first, second

    state, events, links, first, second = asyncio.run(main())
    kinds = [type(e).__name__ for e in events if not isinstance(e, str)]
    # the second change pauses sequences around its commit; the first (nothing up) does not
    assert kinds.count("SwitchStarted") == 1 and kinds.index("SwitchStarted") < kinds.index("SwitchEnded")
    assert kinds[kinds.index("SwitchStarted") + 1] == "Committed" and state.switching is None
    assert state.active == second and set(state.secrets) == {first.plan_id, second.plan_id}  # the replaced plan's kept
    # each plan's commit carries how its change went (the dashboard's "up" line is read from it)
    commits = [e for e in events if isinstance(e, S.Committed)]
    assert [c.deployment.plan_id for c in commits] == [first.plan_id, second.plan_id]
    assert commits[0].timings.replaced is None and commits[1].timings.replaced == first.plan_id
    assert "quiesce_s" in commits[1].timings.moved and all(c.timings.fetched_bytes == 0 for c in commits)
    assert "up" not in events  # no longer a free note beside the commit
    # each stage was sent the secret the state keeps for it, and its successor's for the hop
    for i, stage in enumerate(second.stages):
        load = next(parse(m) for m in links[stage.worker_id].channel.sent if m.type is T.LOAD and m.get("plan") == second.plan_id)
        assert load.data_secret == state.secrets[second.plan_id][stage.worker_id]
        if i + 1 < len(second.stages):
            assert load.next.secret == state.secrets[second.plan_id][second.stages[i + 1].worker_id]
    # and which plans each keeps: the new one only
    for w in ("w1", "w2"):
        assert [parse(m).keep for m in links[w].channel.sent if m.type is T.ACTIVATE][-1] == [second.plan_id]


def test_a_worker_lost_as_it_joins_leaves_no_calibration_coroutine_unawaited():
    """``joined`` spawns the calibration; ``lost`` at once cancels it before its first step. The
    work's coroutine used to be made in ``joined`` and handed to the task, so that cancelled task
    left it never awaited ("coroutine 'Calibrator.calibrate' was never awaited", seen in the
    simulation's injected-bug runs, torn down while a worker was joining)."""
    import gc
    import warnings

    async def main():
        package, settings = FakePackage(), CoordinatorSettings(calibrate=True)
        profile = ClusterProfile(package.manifest)
        box = {"state": S.ClusterState()}
        tasks = []

        def emit(event):
            box["state"] = S.apply(box["state"], event)
            return box["state"]

        hello = Hello.from_fields({"name": "w1", "memory_bytes": 8 << 30, "data_url": "tcp://w1:1"})
        emit(S.WorkerJoined("w1", "w1", hello, 0.0))
        ports = Ports(state=lambda: box["state"], emit=emit, measure=profile.apply, note=lambda kind, **f: None,
                      clock=lambda: 10.0, spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1],
                      links=lambda: {}, replan_wanted=asyncio.Event(), settings=settings, package=package, profile=profile)
        calibrator = Calibrator(ports, MemoryProportional(), lambda workers: None, lambda: {})
        calibrator.joined("w1")
        assert box["state"].workers["w1"].calibrating
        calibrator.lost("w1")
        await asyncio.gather(*tasks, return_exceptions=True)
        return tasks

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tasks = asyncio.run(main())
        del tasks
        gc.collect()
    unawaited = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "never awaited" in str(w.message)]
    assert not unawaited, unawaited
