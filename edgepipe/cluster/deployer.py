"""Carrying out plan changes: re-plan, load stages, swap, move KV, prepare the spare (I/O).

A new plan is prepared in an inactive slot on every worker while the active one keeps serving
(Preparing, when nothing is up), then swapped in between two steps (Committing): sequences
pause at the gate, in-flight steps drain, live sequences' KV is copied where ``deploy.kv_moves``
says (or rebuilt by replay when that is cheaper or a copy fails), and the plan commits only if
none of its workers left meanwhile. Every change of state goes through ``Coordinator.emit``.
"""

from __future__ import annotations

import asyncio
import itertools

from ..net import auth
from ..net.messages import Activate, KvExport, Loaded
from . import deploy, state as S
from .placement import Deployment, StageAssignment
from .profiling import RUNTIME_OVERHEAD_BYTES

MOVE_TIMEOUT_S = 10.0  # KV moves still missing after this (plus 3x their predicted time) are rebuilt by replay
MOVE_TIMEOUT_MAX_S = 120.0
QUIESCE_S = 30.0


class Deployer:
    def __init__(self, coord):
        self.coord = coord
        self.lock = asyncio.Lock()
        self.gate = asyncio.Event()  # cleared while a new plan is committed (no new steps)
        self.gate.set()
        self.migrate_kv = True
        self.moves: dict[int, asyncio.Future] = {}
        self.secrets: dict[int, dict[str, str]] = {}  # plan -> worker -> its data-port secret (net.auth)
        self._plan_ids = itertools.count(1)
        self._ids = itertools.count(1)

    # -- values ----------------------------------------------------------------------------------
    def precision(self, worker_id: str) -> str | None:
        w = self.coord.cluster.workers.get(worker_id)
        return (w.hello.get("precision") if w else None) or self.coord.settings.precision

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
                stages, reason, predicted = c.plan_fn(c, workers)
            if not stages:
                c.emit(S.PlanFailed(reason))
                c.event("plan_failed", error=reason)
                return None
            current = c.cluster.active
            if current and not force:
                if [(s.worker_id, s.start, s.end) for s in current.stages] == [(s.worker_id, s.start, s.end) for s in stages]:
                    return current
                decision = predicted.get("switch")
                if decision is not None and not decision["switch"]:
                    return current  # not worth its switch cost yet (hysteresis)
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

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None) -> Deployment:
        """Prepare ``stages`` beside the active plan, then swap it in (after any change under way:
        two plans prepared at once would each move KV from a plan the other replaced)."""
        async with self.lock:
            return await self._deploy(stages, reason, predicted)

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
                                                                data_secret=secrets[i]))
                     for i, s in enumerate(stages)]
            results = await asyncio.gather(*loads)
            failed = [f"{s.worker_id}: {r.error}" for s, r in zip(stages, results) if not r.ok]
            if failed:
                raise RuntimeError("plan %d failed to load (%s)" % (dep.plan_id, "; ".join(failed)))
        except BaseException as exc:
            c.emit(S.PrepareFailed(dep.plan_id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, c.clock()))
            raise
        await c.calibrator.time_stages(dep)  # the first plan timed on its own ranges (calibration)
        c.emit(S.Committing(c.clock()))
        moved: dict = {}
        paused_at = c.clock()
        if old is not None:
            self.gate.clear()  # sequences pause between two steps while the plan changes
            try:
                await self.quiesce()
                quiet_at = c.clock()
                moved = await self.migrate(old, dep) if self.migrate_kv else {}
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
        c.spawn(c.calibrator.probe_neighbours(dep.stages))  # planned neighbours measure their links (calibration)
        return dep

    async def quiesce(self) -> None:
        """Wait until no step is in the pipeline (its KV is complete and stable)."""
        deadline = self.coord.clock() + QUIESCE_S
        while self.coord.steps.pending and self.coord.clock() < deadline:
            await asyncio.sleep(0.002)

    async def migrate(self, old: Deployment, new: Deployment) -> dict:
        """Move live sequences' KV from the old stages to the new ones, worker to worker.

        Each sequence moves when that is predicted cheaper than rebuilding it by replay on the
        new plan; otherwise, or if a move fails, it is rebuilt by replay."""
        c = self.coord
        live = {rid: q for rid, q in sorted(c.cluster.requests.items()) if q.plan == old.plan_id and q.kv_len > 0}
        if not live:
            return {}
        infos = c.cluster.workers
        if any(w not in infos or infos[w].relay for w in set(old.workers) | set(new.workers)):
            return {"kv_recomputed": len(live)}
        kv_per_unit = [u.kv_bytes_per_token for u in c.manifest.units]
        copies = deploy.kv_moves(old, new, c.n_units, kv_per_unit)
        loop = asyncio.get_running_loop()
        futures: dict[str, list[asyncio.Future]] = {}
        moved_bytes, recompute = 0, []
        for rid, q in live.items():
            if not copies or not self._move_is_cheaper(old, new, q.kv_len):
                recompute.append(rid)
                continue
            for copy in copies:
                move = next(self._ids)
                fut = self.moves[move] = loop.create_future()
                futures.setdefault(rid, []).append(fut)
                moved_bytes += q.kv_len * sum(kv_per_unit[copy.start:copy.end])
                link = c.links.get(copy.src)
                msg = KvExport(q.seq, old.plan_id, copy.start, copy.end, new.plan_id, infos[copy.dst].hello.get("data_url"), move,
                               secret=self.secrets.get(new.plan_id, {}).get(copy.dst),
                               fingerprint=infos[copy.dst].hello.get("data_fingerprint"))
                if link is None or not await _quiet(link.send(msg.to_message())):
                    fut.cancel()
        # All moves run at once; whatever has not arrived within the bound is rebuilt by replay.
        everything = [f for futs in futures.values() for f in futs]
        if everything:
            await asyncio.wait(everything, timeout=self._move_timeout(old, moved_bytes))
        ok = 0
        for rid, futs in futures.items():
            if all(f.done() and not f.cancelled() and f.exception() is None and f.result().ok for f in futs):
                c.emit(S.KvMoved(rid, new.plan_id))
                ok += 1
            else:
                recompute.append(rid)
        for f in everything:
            if not f.done():
                f.cancel()
        for move in [m for m, f in self.moves.items() if f.done()]:
            del self.moves[move]
        return {"kv_moved": ok, "kv_moved_bytes": moved_bytes, "kv_recomputed": len(recompute)}

    def _move_timeout(self, old: Deployment, moved_bytes: int) -> float:
        """How long all moves may take: 10 s plus three times their predicted transfer time (the
        slowest sender's link carrying every byte), at most two minutes."""
        bandwidth = min(self.coord.profile.link_of(w)[1] for w in old.workers)
        return min(MOVE_TIMEOUT_S + 3 * moved_bytes / max(bandwidth, 1.0), MOVE_TIMEOUT_MAX_S)

    def _move_is_cheaper(self, old: Deployment, new: Deployment, length: int) -> bool:
        p = self.coord.profile
        kv_bytes = length * sum(u.kv_bytes_per_token for u in self.coord.manifest.units)
        # a speed of 0 comes from a package imported without unit costs: no estimate, replay
        stage_s = [p.unit_cost(s.start, s.end) / max(p.of(s.worker_id).speed, 1e-9) for s in new.stages]
        return deploy.move_is_cheaper(kv_bytes, min(p.link_of(w)[1] for w in old.workers), max(p.link_of(w)[0] for w in old.workers),
                                      stage_s, length)

    def moved(self, reply: Loaded) -> None:
        fut = self.moves.pop(reply.kv_received, None)
        if fut and not fut.done():
            fut.set_result(reply)

    def abort_moves(self, exc: Exception) -> None:
        for fut in self.moves.values():
            if not fut.done():
                fut.set_exception(exc)
        self.moves.clear()

    async def prefetch_spare(self, dep: Deployment) -> None:
        """Fetch the files of the spare plan ahead of a failure (000's shadow assignment)."""
        c = self.coord
        spare = getattr(c.plan_fn, "spare", None)
        if spare is None:
            return
        try:
            stages = spare(c, dep)
        except Exception as exc:  # a spare is an optimisation: never let it disturb serving
            c.event("spare_failed", error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if not stages or any(s.worker_id not in c.cluster.workers for s in stages):
            return
        c.emit(S.SpareChosen(tuple(stages)))
        plan_id = -next(self._ids)
        for i, s in enumerate(stages):
            # warm: build the session too when the worker's budget allows (else it holds the files)
            msg = deploy.load_message(c.package, plan_id, s.start, s.end, self.precision(s.worker_id), {"kind": "coordinator"}, [],
                                      warm=True)
            c.spawn(_quiet(self.load(s.worker_id, msg)))
        c.event("spare", stages=[[s.worker_id, s.start, s.end] for s in stages])


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
