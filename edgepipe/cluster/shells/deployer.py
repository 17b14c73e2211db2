"""Carrying out plan changes: re-plan, load stages, swap, move KV, prepare the spare (I/O).

A new plan is prepared in an inactive slot on every worker while the active one keeps serving
(Preparing, when nothing is up), then swapped in between two steps (Committing): sequences
pause at the gate, in-flight steps drain, live sequences' KV is copied (``migration``) where ``deploy.kv_moves``
says (or rebuilt by replay when that is cheaper or a copy fails), and the plan commits only if
none of its workers left meanwhile. Every change of state goes through ``Ports.emit``; the
pause itself is state (``SwitchStarted``/``SwitchEnded``), as are the plans' data-port secrets.
"""

from __future__ import annotations

import asyncio
import itertools

from typing import Callable, Mapping

from ...net import auth
from ...net.messages import Activate, Loaded
from ..rules import deploy
from ..state import state as S
from .calibration import Calibrator
from .migration import KvMigration
from ..state.placement import Deployment, StageAssignment
from ..rules.planning import PlanContext, PlanPolicy
from .ports import Ports
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from ..rules.variant_rules import missing_units
from .views import WorkerView

QUIESCE_S = 30.0
CATCH_UP_S = 5.0  # the next spare waits at most this long for the sequences to be fed on a new plan
DOWN_RETRY_S = 2.0  # with no plan up, a failed plan is retried at least this often


class Deployer:
    """Carries plan changes out. It is given the coordinator's ``Ports`` and, by name, what it
    needs of the others: the calibrator (settling, timing a first plan's stages, probing planned
    neighbours), the plan policy and its context, the worker views, the requests' capacity check
    and whether steps are in flight; ``migration`` (KV moves) is attached by the coordinator.
    The switch's pause is state (``SwitchStarted``/``SwitchEnded``): the coordinator's gate,
    which sequences wait on, mirrors ``deploy.steps_may_start``."""

    def __init__(self, ports: Ports, calibrator: Calibrator, plan_fn: PlanPolicy, plan_context: Callable[[list], PlanContext],
                 views: Callable[[], Mapping[str, WorkerView]], lacking: Callable[[], str | None], steps_in_flight: Callable[[], bool]):
        self.ports, self.calibrator = ports, calibrator
        self.plan_fn, self.plan_context, self.views = plan_fn, plan_context, views
        self.lacking, self.steps_in_flight = lacking, steps_in_flight
        self.lock = asyncio.Lock()
        self.migrate_kv = True
        self.migration: KvMigration | None = None
        self._plan_ids = itertools.count(1)
        self._ids = itertools.count(1)

    @property
    def secrets(self) -> Mapping[int, Mapping[str, str]]:
        """plan -> worker -> its data-port secret (``net.auth``), as the state keeps them."""
        return self.ports.state().secrets

    # -- values ----------------------------------------------------------------------------------
    def precision(self, worker_id: str) -> str | None:
        """The weight variant the worker is sent (``deploy.precision_of``: `gguf` or the
        MatMulNBits fallback by whether it has the kernel library; None: the package's own)."""
        p = self.ports
        return deploy.precision_of(p.state(), worker_id, p.package.manifest, p.settings.precision)

    def form(self, worker_id: str) -> deploy.StageForm:
        """The graph form the worker's stages are sent (its variant, GPU, verify: ``deploy.stage_form``)."""
        p = self.ports
        return deploy.stage_form(p.state(), worker_id, p.package.manifest, p.settings)

    def kv_capacity(self) -> int | None:
        p = self.ports
        return deploy.kv_capacity(p.state(), p.package.manifest, lambda w: self.precision(w.id), RUNTIME_OVERHEAD_BYTES)

    def kv_plan_positions(self) -> int:
        return deploy.kv_plan_positions(self.ports.state(), self.ports.profile.context_tokens)

    # -- re-planning -----------------------------------------------------------------------------
    async def replanner(self) -> None:
        p = self.ports
        failures = 0  # plans that failed in a row
        while True:
            try:
                await asyncio.wait_for(p.replan_wanted.wait(), timeout=p.settings.replan_every_s)
            except asyncio.TimeoutError:
                pass  # the periodic check: measured speeds may have drifted
            await asyncio.sleep(0.05)  # let a burst of joins/leaves settle
            p.replan_wanted.clear()
            if p.state().active is not None:  # when down, recover with who is ready now
                await self.calibrator.settled()
            try:
                await self.replan()
                failures = 0
            except Exception as exc:  # a failed plan must not stop future re-planning
                p.emit(S.PlanFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
                # back off: 0.5 s, then twice as long after each failure in a row, at most the periodic
                # check while a plan serves (DOWN_RETRY_S while none does: getting up again comes first)
                await asyncio.sleep(retry_after_s(failures, p.settings.replan_every_s if p.state().active is not None else DOWN_RETRY_S))
                failures += 1
                p.replan_wanted.set()

    async def replan(self, force: bool = False) -> Deployment | None:
        p = self.ports
        async with self.lock:
            views, cluster = self.views(), p.state()
            workers = [views[w.id] for w in deploy.plannable(cluster, p.clock()) if w.id in views]
            if len(workers) < p.settings.min_workers and not cluster.ever_up:
                return None  # min_workers gates only the first plan; later, serve with who is left
            if not workers:
                return None
            lacking = self.lacking()
            if lacking is not None:  # no plan can fit: say so instead of trying plans that cannot load
                p.emit(S.PlanFailed(lacking, attempted=False))
                return None
            spare = deploy.recovery_plan(cluster, {w.id for w in workers})
            if spare is not None:
                # Down: the spare plan's files (and sessions, where budgets allowed) are already in
                # place, so it is up fastest; the policy may move to a better plan once serving.
                stages, reason, predicted = list(spare), "spare plan (recovery)", {}
                p.replan_wanted.set()
            else:
                stages, reason, predicted = self.plan_fn(self.plan_context(workers))
            if not stages:
                # before the first plan is up, devices are still arriving: no line until one could serve
                p.emit(S.PlanFailed(reason, attempted=cluster.ever_up))
                return None
            cluster = p.state()
            current = cluster.active
            kept = predicted.get("kept")
            if not force and current is not None and deploy.repeats_failure(cluster, stages, p.clock()):
                kept = f"keeping plan {current.plan_id}: the plan that just failed to prepare is not tried again for {deploy.FAILED_PLAN_HOLD_S:.0f} s"
                stages = list(current.stages)
            if kept and kept != cluster.last_failure:  # said once, not at every check
                p.emit(S.PlanFailed(kept, attempted=False))
                p.note(S.NoteKind.PLAN_KEPT, plan=current.plan_id if current else None, why=kept)
            if not force and deploy.stay_reason(current, stages, cluster.pinned(p.clock()), predicted.get("switch")) is not None:
                return current
            try:
                return await self._deploy(stages, reason, {k: v for k, v in predicted.items() if k not in ("switch", "kept")})
            except Exception:
                if spare is not None:
                    p.emit(S.SpareChosen(None))  # the next attempt asks the planner
                raise

    # -- deploying -------------------------------------------------------------------------------
    async def load(self, worker_id: str, msg) -> Loaded:
        return await self.ports.load(worker_id, msg)

    async def deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None,
                     pin_s: float = 0.0) -> Deployment:
        """Prepare ``stages`` beside the active plan, then swap it in (after any change under way:
        two plans prepared at once would each move KV from a plan the other replaced). With
        ``pin_s`` the re-planner keeps it that long, unless one of its workers is lost."""
        async with self.lock:
            dep = await self._deploy(stages, reason, predicted)
            self.ports.emit(S.Pinned(dep.plan_id if pin_s > 0 else None, self.ports.clock() + pin_s))
            return dep

    async def _deploy(self, stages: list[StageAssignment], reason: str = "", predicted: dict | None = None) -> Deployment:
        p = self.ports
        settings = p.settings
        dep = Deployment(next(self._plan_ids), tuple(stages), reason, predicted or {})
        t0 = p.clock()
        p.emit(S.Preparing(dep, t0))
        old = p.state().active
        keep = [dep.plan_id] + ([old.plan_id] if old else [])
        try:
            workers = p.state().workers
            if any(s.worker_id not in workers for s in stages):
                raise deploy_error(f"worker {next(s.worker_id for s in stages if s.worker_id not in workers)} left before deployment")
            secrets = auth.plan_secrets(len(stages)) if settings.issue_data_secrets else [None] * len(stages)
            feed_secret = auth.plan_secrets(1)[0] if settings.issue_data_secrets and len(stages) > 1 else None  # the direct path's, last to first
            p.emit(S.SecretsIssued(dep.plan_id, {s.worker_id: secret for s, secret in zip(stages, secrets) if secret}))
            for s in stages:  # a stage in a variant the package lacks for its units (a tab's fp32): those units are built now
                await self.calibrator.variants.ensure(self.precision(s.worker_id), s.start, s.end, s.worker_id)
            loads = [self.load(s.worker_id, deploy.load_message(p.package, dep.plan_id, s.start, s.end, self.form(s.worker_id),
                                                                deploy.next_hop(stages, i, workers, secrets), keep,
                                                                data_secret=secrets[i],
                                                                feed=deploy.feed_fields(stages, i, workers, feed_secret)))
                     for i, s in enumerate(stages)]
            results = await asyncio.gather(*loads)
            failed = [f"{s.worker_id}: {r.error}" for s, r in zip(stages, results) if not r.ok]
            for s, r in zip(stages, results):
                if not r.ok and r.needed_bytes is not None and r.budget_bytes is not None:  # over its budget: priced with it from now on
                    p.emit(S.LoadRefused(s.worker_id, dep.plan_id, s.start, s.end, r.needed_bytes, r.free_bytes or 0, r.budget_bytes,
                                         old.plan_id if old else None, p.clock()))
            if failed:
                raise RuntimeError("plan %d failed to load (%s)" % (dep.plan_id, "; ".join(failed)))
        except BaseException as exc:
            p.emit(S.PrepareFailed(dep.plan_id, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, p.clock()))
            raise
        dep = await self.calibrator.time_stages(dep)  # the first plan timed on its own ranges (calibration)
        p.emit(S.Committing(p.clock()))
        moved: dict = {}
        paused_at = p.clock()
        if old is not None:
            p.emit(S.SwitchStarted(dep.plan_id, paused_at))  # sequences pause between two steps while the plan changes
            try:
                await self.quiesce()
                quiet_at = p.clock()
                moved = await self.migration.migrate(old, dep) if self.migrate_kv else {}
                moved["quiesce_s"] = round(quiet_at - paused_at, 3)
                lost = [s.worker_id for s in stages if s.worker_id not in p.state().workers]
                if lost:  # a worker of the new plan died while we switched: do not commit it
                    for rid, q in p.state().requests.items():
                        if q.migrated_to == dep.plan_id:
                            p.emit(S.KvMoved(rid, None))
                    why = f"worker {lost[0]} left"
                    p.emit(S.PrepareFailed(dep.plan_id, f"{why} while plan {dep.plan_id} was being committed", p.clock()))
                    raise deploy_error(f"{why} while plan {dep.plan_id} was being committed")
                p.emit(S.Committed(dep, p.clock(), self._timings(t0, paused_at, results, old, moved)))
            finally:
                p.emit(S.SwitchEnded(dep.plan_id, p.clock()))
        else:
            if any(s.worker_id not in p.state().workers for s in stages):
                p.emit(S.PrepareFailed(dep.plan_id, f"a worker of plan {dep.plan_id} left while it was committed", p.clock()))
                raise deploy_error(f"a worker of plan {dep.plan_id} left while it was committed")
            p.emit(S.Committed(dep, p.clock(), self._timings(t0, paused_at, results, old, moved)))
        for wid in sorted(set(dep.workers) | (set(old.workers) if old else set())):  # which plans each worker keeps
            if wid in p.links():
                await _quiet(p.send(wid, Activate([dep.plan_id] if wid in dep.workers else []).to_message()))
        repaired = sorted({f for r in results for f in (r.repaired or [])})
        if repaired:
            p.note(S.NoteKind.BLOB_REPAIRED, plan=dep.plan_id, files=repaired)
        p.spawn(self._after_catching_up(dep, self.prefetch_spare(dep)))
        p.spawn(self._after_catching_up(dep, self.calibrator.probe_neighbours(dep.stages)))  # planned neighbours measure their links
        return dep

    def _timings(self, t0: float, paused_at: float, results, old: Deployment | None, moved: dict) -> S.UpTimings:
        """What the plan change took (the dashboard's "up" line, read from its ``Committed``)."""
        now = self.ports.clock()
        return S.UpTimings(round(now - t0, 3), round(now - paused_at, 3), sum(r.fetched_bytes or 0 for r in results),
                           old.plan_id if old else None, dict(moved))

    async def _after_catching_up(self, dep: Deployment, work, most_s: float = CATCH_UP_S) -> None:
        """Run ``work`` (the next spare's loads, link probes) once every running sequence took a
        step on ``dep``: after a recovery, replays would otherwise share the workers' cores with
        building the next spare's sessions (at most ``most_s``: a sequence may be stuck elsewhere)."""
        p = self.ports
        deadline = p.clock() + most_s
        while p.clock() < deadline and deploy.catching_up(p.state(), dep.plan_id):
            await asyncio.sleep(0.05)
        await work

    async def quiesce(self) -> None:
        """Wait until no step is in the pipeline (its KV is complete and stable)."""
        deadline = self.ports.clock() + QUIESCE_S
        while self.steps_in_flight() and self.ports.clock() < deadline:
            await asyncio.sleep(0.002)

    async def prefetch_spare(self, dep: Deployment) -> None:
        """Fetch the files of the spare plan ahead of a failure (000's shadow assignment)."""
        p = self.ports
        live = {w.id for w in p.state().live(p.clock()) if not w.hello.drafter}  # a drafter holds no stage, spare ones neither
        try:
            stages = self.plan_fn.spare(self.plan_context([w for w in self.views().values() if w.id in live]), dep)
        except Exception as exc:  # a spare is an optimisation: never let it disturb serving
            p.note(S.NoteKind.SPARE_FAILED, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return
        if not stages or any(s.worker_id not in p.state().workers for s in stages):
            return
        p.emit(S.SpareChosen(tuple(stages)))
        plan_id = -next(self._ids)
        for i, s in enumerate(stages):
            if missing_units(p.package.manifest, self.precision(s.worker_id), s.start, s.end):
                continue  # a spare is an optimisation: a variant's units are built when a plan needs them, not for a spare
            # warm: build the session too when the worker's budget allows (else it holds the files)
            msg = deploy.load_message(p.package, plan_id, s.start, s.end, self.form(s.worker_id), {"kind": "coordinator"}, [],
                                      warm=True)
            p.spawn(self._spare_load(plan_id, tuple(stages), s.worker_id, msg))

    async def _spare_load(self, plan_id: int, stages: tuple[StageAssignment, ...], worker_id: str, msg) -> None:
        """A spare stage's LOAD: whether its session was built is state (``SpareLoaded``: a
        worker that built it takes KV checkpoints, ``checkpoints``)."""
        p = self.ports
        try:
            reply = await self.load(worker_id, msg)
        except Exception:  # noqa: BLE001 - the loss of that worker is handled where it is noticed
            return
        # not ok: it holds the files at most, no session built, no KV checkpoints taken (its line: narrate.entry)
        p.emit(S.SpareLoaded(plan_id, stages, worker_id, bool(reply.ok and not reply.prefetched),
                             None if reply.ok else reply.error or "not loaded"))


def retry_after_s(failures: int, most_s: float) -> float:
    """Seconds before re-planning after ``failures`` + 1 plans failed in a row: 0.5 s, doubling, at most ``most_s``."""
    return min(max(most_s, 0.5), 0.5 * 2 ** min(failures, 16))


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
