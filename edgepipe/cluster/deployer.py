"""Carrying out plan changes: re-plan, load stages, swap, move KV, prepare the spare (I/O).

A new plan is prepared in an inactive slot on every worker while the active one keeps serving
(Preparing, when nothing is up), then swapped in between two steps (Committing): sequences
pause at the gate, in-flight steps drain, live sequences' KV is copied (``migration``) where ``deploy.kv_moves``
says (or rebuilt by replay when that is cheaper or a copy fails), and the plan commits only if
none of its workers left meanwhile. Every change of state goes through ``Coordinator.emit``.
"""

from __future__ import annotations

import asyncio
import itertools

from ..net import auth
from ..net.messages import Activate, Loaded
from . import deploy, state as S
from .placement import Deployment, StageAssignment
from .migration import KvMigration
from .profiling import RUNTIME_OVERHEAD_BYTES

QUIESCE_S = 30.0


class Deployer:
    def __init__(self, coord):
        self.coord = coord
        self.lock = asyncio.Lock()
        self.gate = asyncio.Event()  # cleared while a new plan is committed (no new steps)
        self.gate.set()
        self.migrate_kv = True
        self.migration = KvMigration(coord, self)
        self.secrets: dict[int, dict[str, str]] = {}  # plan -> worker -> its data-port secret (net.auth)
        self._plan_ids = itertools.count(1)
        self._ids = itertools.count(1)

    # -- values ----------------------------------------------------------------------------------
    def precision(self, worker_id: str) -> str | None:
        """The weight variant the worker is sent (``deploy.worker_variant``: `gguf` or the
        MatMulNBits fallback by whether it has the kernel library; None: the package's own)."""
        w = self.coord.cluster.workers.get(worker_id)
        if w is None:
            return self.coord.settings.precision
        return deploy.worker_variant(w.hello, self.coord.manifest, self.coord.settings.precision)

    def on_gpu(self, worker_id: str) -> bool:
        """Whether the worker computes on a GPU (it is sent the GPU form of its stage's graph)."""
        w = self.coord.cluster.workers.get(worker_id)
        return bool(w and w.hello.device == "gpu")

    def kv_capacity(self) -> int | None:
        c = self.coord
        return deploy.kv_capacity(c.cluster, c.manifest, lambda w: self.precision(w.id), RUNTIME_OVERHEAD_BYTES)

    def kv_plan_positions(self) -> int:
        return deploy.kv_plan_positions(self.coord.cluster, self.coord.profile.context_tokens)

    # -- re-planning -----------------------------------------------------------------------------
    async def replanner(self) -> None:
        c = self.coord
        while True:
            try:
                await asyncio.wait_for(c.replan_wanted.wait(), timeout=c.settings.replan_every_s)
            except asyncio.TimeoutError:
                pass  # the periodic check: measured speeds may have drifted
            await asyncio.sleep(0.05)  # let a burst of joins/leaves settle
            c.replan_wanted.clear()
            if c.cluster.active is not None:  # when down, recover with who is ready now
                await c.calibrator.settled()
            try:
                await self.replan()
            except Exception as exc:  # a failed plan must not stop future re-planning
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                c.emit(S.PlanFailed(why))
                c.event("plan_failed", error=why)
                await asyncio.sleep(0.5)
                c.replan_wanted.set()

    async def replan(self, force: bool = False) -> Deployment | None:
        c = self.coord
        async with self.lock:
            calibrating = c.calibrator.busy()
            views = c.workers
            workers = [views[w.id] for w in c.cluster.live(c.clock()) if w.id in views and w.id not in calibrating]
            if len(workers) < c.settings.min_workers and not c.cluster.ever_up:
                return None  # min_workers gates only the first plan; later, serve with who is left
            if not workers:
                return None
            lacking = c.requests.lacking()
            if lacking is not None:  # no plan can fit: say so instead of trying plans that cannot load
                c.emit(S.PlanFailed(lacking))
                return None
            spare = deploy.recovery_plan(c.cluster, {w.id for w in workers})
            if spare is not None:
                # Down: the spare plan's files (and sessions, where budgets allowed) are already in
                # place, so it is up fastest; the policy may move to a better plan once serving.
                stages, reason, predicted = list(spare), "spare plan (recovery)", {}
                c.replan_wanted.set()
            else:
                stages, reason, predicted = c.plan_fn(c.plan_context(workers))
            if not stages:
                c.emit(S.PlanFailed(reason))
                c.event("plan_failed", error=reason)
                return None
            current = c.cluster.active
            if not force and deploy.stay_reason(current, stages, c.cluster.pinned(c.clock()), predicted.get("switch")) is not None:
                return current
            try:
                return await self._deploy(stages, reason, {k: v for k, v in predicted.items() if k != "switch"})
            except Exception:
                if spare is not None:
                    c.emit(S.SpareChosen(None))  # the next attempt asks the planner
                raise

    # -- deploying -------------------------------------------------------------------------------
    async def load(self, worker_id: str, msg) -> Loaded:
        c = self.coord
        link = c.links.get(worker_id)
        if link is None:
            raise deploy_error(f"worker {worker_id} left before deployment")
        fut = link.loads[msg.plan] = asyncio.get_running_loop().create_future()
        try:
            await link.send(msg.to_message())
            return await asyncio.wait_for(fut, timeout=c.settings.load_timeout_s)
        finally:
            link.loads.pop(msg.plan, None)

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None,
                     pin_s: float = 0.0) -> Deployment:
        """Prepare ``stages`` beside the active plan, then swap it in (after any change under way:
        two plans prepared at once would each move KV from a plan the other replaced). With
        ``pin_s`` the re-planner keeps it that long, unless one of its workers is lost."""
        async with self.lock:
            dep = await self._deploy(stages, reason, predicted)
            self.coord.emit(S.Pinned(dep.plan_id if pin_s > 0 else None, self.coord.clock() + pin_s))
            return dep

    async def _deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None) -> Deployment:
        c = self.coord
        dep = Deployment(next(self._plan_ids), tuple(stages), reason, predicted or {})
        t0 = c.clock()
        c.emit(S.Preparing(dep, t0))
        c.event("prepare", plan=dep.plan_id, stages=[[s.worker_id, s.start, s.end] for s in stages], reason=reason)
        old = c.cluster.active
        keep = [dep.plan_id] + ([old.plan_id] if old else [])
        try:
            if any(s.worker_id not in c.cluster.workers for s in stages):
                raise deploy_error(f"worker {next(s.worker_id for s in stages if s.worker_id not in c.cluster.workers)} left before deployment")
            secrets = auth.plan_secrets(len(stages)) if c.settings.issue_data_secrets else [None] * len(stages)
            self.secrets[dep.plan_id] = {s.worker_id: secret for s, secret in zip(stages, secrets) if secret}
            loads = [self.load(s.worker_id, deploy.load_message(c.package, dep.plan_id, s.start, s.end, self.precision(s.worker_id),
                                                                deploy.next_hop(stages, i, c.cluster.workers, secrets), keep,
                                                                data_secret=secrets[i], batch_invariant=c.settings.batch_invariant,
                                                                gpu=self.on_gpu(s.worker_id), verify=c.settings.speculative))
                     for i, s in enumerate(stages)]
            results = await asyncio.gather(*loads)
            failed = [f"{s.worker_id}: {r.error}" for s, r in zip(stages, results) if not r.ok]
            if failed:
                raise RuntimeError("plan %d failed to load (%s)" % (dep.plan_id, "; ".join(failed)))
        except BaseException as exc:
            c.emit(S.PrepareFailed(dep.plan_id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, c.clock()))
            raise
        dep = await c.calibrator.time_stages(dep)  # the first plan timed on its own ranges (calibration)
        c.emit(S.Committing(c.clock()))
        moved: dict = {}
        paused_at = c.clock()
        if old is not None:
            self.gate.clear()  # sequences pause between two steps while the plan changes
            try:
                await self.quiesce()
                quiet_at = c.clock()
                moved = await self.migration.migrate(old, dep) if self.migrate_kv else {}
                moved["quiesce_s"] = round(quiet_at - paused_at, 3)
                lost = [s.worker_id for s in stages if s.worker_id not in c.cluster.workers]
                if lost:  # a worker of the new plan died while we switched: do not commit it
                    for rid, q in c.cluster.requests.items():
                        if q.migrated_to == dep.plan_id:
                            c.emit(S.KvMoved(rid, None))
                    why = f"worker {lost[0]} left"
                    c.emit(S.PrepareFailed(dep.plan_id, f"{why} while plan {dep.plan_id} was being committed", c.clock()))
                    raise deploy_error(f"{why} while plan {dep.plan_id} was being committed")
                c.emit(S.Committed(dep, c.clock()))
            finally:
                self.gate.set()
        else:
            if any(s.worker_id not in c.cluster.workers for s in stages):
                c.emit(S.PrepareFailed(dep.plan_id, f"a worker of plan {dep.plan_id} left while it was committed", c.clock()))
                raise deploy_error(f"a worker of plan {dep.plan_id} left while it was committed")
            c.emit(S.Committed(dep, c.clock()))
        for wid in sorted(set(dep.workers) | (set(old.workers) if old else set())):  # which plans each worker keeps
            link = c.links.get(wid)
            if link:
                await _quiet(link.send(Activate([dep.plan_id] if wid in dep.workers else []).to_message()))
        for plan in [p for p in self.secrets if p not in (dep.plan_id, old.plan_id if old else None)]:
            del self.secrets[plan]
        repaired = sorted({f for r in results for f in (r.repaired or [])})
        if repaired:
            c.event("blob_repaired", plan=dep.plan_id, files=repaired)
        fetched = sum(r.fetched_bytes for r in results)
        c.event("up", plan=dep.plan_id, prepare_s=round(c.clock() - t0, 3), paused_s=round(c.clock() - paused_at, 3), fetched_bytes=fetched,
                predicted=dep.predicted, replaced=old.plan_id if old else None, **moved)
        c.spawn(self.prefetch_spare(dep))
        c.spawn(c.calibrator.links.probe_neighbours(dep.stages))  # planned neighbours measure their links (calibration)
        return dep

    async def quiesce(self) -> None:
        """Wait until no step is in the pipeline (its KV is complete and stable)."""
        deadline = self.coord.clock() + QUIESCE_S
        while self.coord.steps.pending and self.coord.clock() < deadline:
            await asyncio.sleep(0.002)

    async def prefetch_spare(self, dep: Deployment) -> None:
        """Fetch the files of the spare plan ahead of a failure (000's shadow assignment)."""
        c = self.coord
        live = {w.id for w in c.cluster.live(c.clock())}
        try:
            stages = c.plan_fn.spare(c.plan_context([w for w in c.workers.values() if w.id in live]), dep)
        except Exception as exc:  # a spare is an optimisation: never let it disturb serving
            c.event("spare_failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if not stages or any(s.worker_id not in c.cluster.workers for s in stages):
            return
        c.emit(S.SpareChosen(tuple(stages)))
        plan_id = -next(self._ids)
        c.checkpoints.spare_chosen(plan_id, stages)
        for i, s in enumerate(stages):
            # warm: build the session too when the worker's budget allows (else it holds the files)
            msg = deploy.load_message(c.package, plan_id, s.start, s.end, self.precision(s.worker_id), {"kind": "coordinator"}, [],
                                      warm=True, batch_invariant=c.settings.batch_invariant, gpu=self.on_gpu(s.worker_id),
                                      verify=c.settings.speculative)
            c.spawn(self._spare_load(plan_id, s.worker_id, msg))
        c.event("spare", stages=[[s.worker_id, s.start, s.end] for s in stages])

    async def _spare_load(self, plan_id: int, worker_id: str, msg) -> None:
        try:
            reply = await self.load(worker_id, msg)
        except Exception:  # noqa: BLE001 - the loss of that worker is handled where it is noticed
            return
        self.coord.checkpoints.spare_loaded(plan_id, worker_id, reply)
        if not reply.ok:  # it holds the files at most: no session built, no KV checkpoints taken
            self.coord.event("spare_unbuilt", worker=worker_id, plan=plan_id, error=reply.error)


def deploy_error(text: str) -> Exception:
    from .steps import PipelineBroken

    return PipelineBroken(text)


async def _quiet(aw) -> bool:
    """Await a send or load whose failure the loss of that worker already handles."""
    try:
        await aw
        return True
    except Exception:
        return False
