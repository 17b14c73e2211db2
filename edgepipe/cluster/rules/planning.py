"""The coordinator's use of the planner: profiles from measurements, plan, switch or stay.

``PlannerPolicy`` is a plan function for the coordinator. It asks ``edgepipe.plan`` for the
best placement under the current objective, prices the running plan with the same cost
model, and lets ``should_switch`` (margin, switch cost amortised over a horizon, penalty
decaying with time since the last switch) decide whether the change is worth making.
Once devices have been seen to leave, the throughput plan is weighed against the plan over
the fewest devices (the latency plan) by expected goodput (``plan.reliability``): under
churn, every extra device a plan relies on is one more way for it to go down. Throughput plans
may replicate a stage over several workers (``cluster.replicas`` runs them), unless a worker
relays through the coordinator (a browser's hops are not routed per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from ...plan import (Objective, Plan, PlanError, PlanRequest, Stage, evaluate, expected_goodput, objective_value, plan, should_switch,
                    spare_plan, switch_cost)
from ...plan.plan import replica_sequences
from ..state.placement import Deployment, StageAssignment, proportional_split, stage_groups
from .profiling import ClusterProfile
from ..state.state import ClusterState


@dataclass(frozen=True)
class PlanContext:
    """What a plan function decides from: the cluster state, the measured profile, the workers a
    new plan may use (views: what they declared, their links), the time, and two figures the
    coordinator derives from its state (the KV the running sequences need, a typical outage)."""

    state: ClusterState
    profile: ClusterProfile
    workers: list  # cluster.views.WorkerView
    now: float
    kv_positions: int  # deploy.kv_plan_positions: what the running sequences may grow to
    recovery_s: float  # median seconds from losing the running plan to the next one up
    kv_form: str | None = None  # the form whose KV a plan budgets (deploy.budget_form; None: the package's own)
    forms: Mapping[str, str | None] = field(default_factory=dict)  # worker -> the form it runs (deploy.worker_forms): its own bytes
    room: Mapping[str, int] = field(default_factory=dict)  # worker -> memory for a new stage beside the running one (deploy.new_stage_room)

    @property
    def sequences(self) -> int:
        return len(self.state.requests)


class PlanPolicy:
    """A plan function: ``policy(ctx) -> (stages, reason, predicted)``; ``predicted["switch"]``,
    where present, is its switch-or-stay verdict (``deploy.stay_reason``). ``spare`` proposes
    a fallback plan for recovery (None: none), ``running_prediction`` prices the live plan."""

    running_prediction: dict | None = None

    def __call__(self, ctx: PlanContext) -> tuple[list[StageAssignment], str, dict]:
        raise NotImplementedError

    def spare(self, ctx: PlanContext, dep: Deployment) -> list[StageAssignment] | None:
        return None


class MemoryProportional(PlanPolicy):
    """Layers in proportion to each worker's declared memory, in join order (no measurements)."""

    def __call__(self, ctx: PlanContext):
        n_units = len(ctx.profile.manifest.units)
        stages = proportional_split(n_units, [(w.id, w.memory_bytes) for w in sorted(ctx.workers, key=lambda w: w.joined_at)])
        return stages, "layers split in proportion to declared memory", {}


@dataclass
class PlannerPolicy(PlanPolicy):
    objective: Objective = Objective.LATENCY
    tpot_target_s: float | None = None
    horizon_tokens: int = 2000
    throughput_above: int = 2  # sequences in flight at which the throughput objective takes over
    last_result: object = None
    running_prediction: dict | None = None  # the live plan priced with today's profiles (a view)

    def request(self, ctx: PlanContext) -> PlanRequest:
        objective = self.objective
        sequences = max(1, ctx.sequences)
        if objective is Objective.LATENCY and sequences >= self.throughput_above:
            objective = Objective.THROUGHPUT
        replicate = objective is Objective.THROUGHPUT and not any(w.relay for w in ctx.workers)
        return PlanRequest(objective=objective, sequences=sequences, tpot_target_s=self.tpot_target_s, replicas=replicate)

    def model(self, ctx: PlanContext):
        """The model profile with KV sized for what is running (``PlanContext.kv_positions``),
        spread over the sequences the request counts: not every sequence at full context."""
        sequences = self.request(ctx).sequences
        return ctx.profile.model_profile(context_tokens=-(-ctx.kv_positions // sequences), kv_form=ctx.kv_form, forms=ctx.forms.values())

    def __call__(self, ctx: PlanContext):
        prof, workers = ctx.profile, ctx.workers
        model = self.model(ctx)
        current = ctx.state.active
        running = set(current.workers) if current is not None else set()
        # a device that refused a LOAD while running nothing of the live plan holds what it reported
        # (``deploy.new_stage_room``); one running a stage may keep it, so it is checked below instead
        devices = [replace(d, memory_bytes=min(d.memory_bytes, ctx.room[d.id])) if d.id in ctx.room and d.id not in running else d
                   for d in prof.device_profiles(workers, ctx.forms)]
        network = prof.network_profile(workers)
        request = self.request(ctx)
        result = plan(model, devices, network, request)
        self.last_result = (result, model, devices, network, request)
        best = result.best
        alive = {d.id for d in devices}
        serving = current is not None and set(current.workers) <= alive  # the running plan may stay
        if best.complete and serving and ctx.room:
            best, why = loadable_beside(best, current, model, devices, network, request, ctx.room)
            if best is None:  # nothing better loads beside it: it keeps serving (``deploy.stay_reason``: same plan)
                return list(current.stages), f"keeping plan {current.plan_id}: {why}", {"kept": f"keeping plan {current.plan_id}: {why}"}
        if not best.complete:
            if serving:
                why = f"keeping plan {current.plan_id}: no other complete plan ({best.reason})"
                return list(current.stages), why, {"kept": why}
            return [], best.reason, {}
        rates = {w.id: prof.failure_rate(w.name, ctx.now) for w in workers}
        if request.objective is Objective.THROUGHPUT and any(rates.values()):
            weighed = self._weigh_churn(best, model, devices, network, request, rates, ctx.recovery_s)
            # the fewer-devices plan, only where it loads beside the running one too
            if not (serving and ctx.room and beside_running(weighed.stages, current, model, devices, request.sequences, ctx.room)):
                best = weighed
        stages = assignments(best.stages)
        predicted = prediction_dict(best)
        if serving:
            running = running_plan(current, model, request)
            try:
                running_pred = evaluate(running.stages, model, devices, network, request)
            except PlanError:  # the running plan no longer fits (e.g. more sequences now): it must go
                return stages, f"{request.objective.value}: {best.reason} (running plan no longer fits)", predicted
            unit_bytes = [u.weight_bytes for u in model.units]
            bandwidths = {d.id: prof.link_of(d.id)[1] for d in devices}
            cost_s = switch_cost(running, best, devices, unit_bytes, bandwidths) + self._kv_pause_s(ctx, running, best, bandwidths)
            decision = should_switch(objective_value(running_pred, request), objective_value(best.predicted, request), cost_s,
                                     ctx.now - ctx.state.last_switch, self.horizon_tokens)
            predicted["switch"] = {"switch": decision.switch, "reason": decision.reason, "switch_cost_s": cost_s,
                                   "running_tpot_s": running_pred.tpot_s}
            self.running_prediction = {"tpot_s": running_pred.tpot_s, "stage_times_s": list(running_pred.stage_times_s),
                                        "hop_times_s": list(running_pred.hop_times_s), "energy_j_per_token": running_pred.energy_j_per_token}
        return stages, f"{request.objective.value}: {best.reason}", predicted


    @staticmethod
    def _kv_pause_s(ctx: PlanContext, running: Plan, best: Plan, bandwidths: dict) -> float:
        """Seconds every sequence pauses while the KV of the layers that change hands moves (the
        deploy itself runs beside the live plan; this does not): 16 long streams make a switch
        cost seconds, so a noisy small gain is not worth it."""
        before = {u: d for s in running.stages for d in s.device_ids for u in range(s.start, s.end)}
        after = {u: d for s in best.stages for d in s.device_ids for u in range(s.start, s.end)}
        per_token = sum(ctx.profile.manifest.kv_bytes_per_token(u, ctx.kv_form) for u in after if before.get(u) != after[u])
        positions = sum(q.kv_len for q in ctx.state.requests.values())
        slowest = min((bandwidths[d] for d in set(before.values()) if d in bandwidths), default=0.0)
        return per_token * positions / slowest if slowest > 0 else 0.0

    def _weigh_churn(self, best: Plan, model, devices, network, request: PlanRequest, rates: dict, recovery_s: float) -> Plan:
        """The throughput plan or the fewest-devices plan, whichever delivers more once downtime counts."""
        try:
            lean = plan(model, devices, network, replace(request, objective=Objective.LATENCY)).best
            if not lean.complete:
                return best
            lean_throughput = evaluate(lean.stages, model, devices, network, request).throughput_tok_s
        except PlanError:
            return best
        ids = lambda p: [d for s in p.stages for d in s.device_ids]  # noqa: E731
        spread = expected_goodput(best.predicted.throughput_tok_s, ids(best), rates, recovery_s)
        compact = expected_goodput(lean_throughput, ids(lean), rates, recovery_s)
        if compact <= spread:
            return best
        return replace(lean, objective=Objective.THROUGHPUT, predicted=evaluate(lean.stages, model, devices, network, request),
                       reason=f"{len(lean.stages)} device(s) instead of {len(best.stages)}: expected {compact:.1f} vs "
                              f"{spread:.1f} tok/s with churn (recovery {recovery_s:.2f} s)")

    def spare(self, ctx: PlanContext, dep: Deployment) -> list[StageAssignment] | None:
        """A complete plan to fall back on, avoiding the running plan's devices where possible
        (then any single failure leaves it intact), over as few devices as the latency
        objective needs: a spare is for getting back up fast."""
        workers = ctx.workers
        if len(workers) < 2:
            return None
        prof = ctx.profile
        model, devices, network = self.model(ctx), prof.device_profiles(workers, ctx.forms), prof.network_profile(workers)
        request = replace(self.request(ctx), objective=Objective.LATENCY)
        running = running_plan(dep, model, request)
        spare = spare_plan(model, devices, network, request, running, set(dep.workers))
        if spare is None:
            return None
        return assignments(spare.stages)


def beside_running(stages, current: Deployment, model, devices, sequences: int, room: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(device, bytes needed, room) of every stage of ``stages`` that its device cannot load beside
    the running plan ``current``: a range other than the one it runs now, needing more than its
    ``room`` (``deploy.new_stage_room``; a range it runs now is reused, it needs nothing more)."""
    devs = {d.id: d for d in devices}
    running = {(s.worker_id, s.start, s.end) for s in current.stages}
    over = []
    for stage in stages:
        for d in stage.device_ids:
            if d not in room or (d, stage.start, stage.end) in running:
                continue
            need = model.stage_bytes(stage.start, stage.end, replica_sequences(sequences, len(stage.device_ids)), devs[d].precision)
            if need > room[d]:
                over.append((d, need, room[d]))
    return over


def loadable_beside(best: Plan, current: Deployment, model, devices, network, request: PlanRequest,
                    room: Mapping[str, int]) -> tuple[Plan | None, str]:
    """The best plan whose stages load beside the running plan (``beside_running``): each device
    that could not load its stage is planned again with only its room, until a plan loads (or
    none is complete: None and why, in one line). Pure, and at most one search per device."""
    capped: dict[str, int] = {}
    sized, why = list(devices), ""
    for _ in range(len(devices) + 1):
        if not best.complete:
            return None, why or best.reason
        over = beside_running(best.stages, current, model, sized, request.sequences, room)
        if not over:
            return best, ""
        why = "no other plan loads beside it (" + "; ".join(f"{d} would need {need / 1e6:.0f} MB, {free / 1e6:.0f} MB free"
                                                            for d, need, free in over) + ")"
        capped.update({d: free for d, _, free in over})
        sized = [replace(d, memory_bytes=min(d.memory_bytes, capped[d.id])) if d.id in capped else d for d in devices]
        best = plan(model, sized, network, request).best
    return None, why


def assignments(stages) -> list[StageAssignment]:
    """A planner plan's stages as the deployment's assignments (a replica each, in plan order)."""
    return [StageAssignment(d, s.start, s.end) for s in stages for d in s.device_ids]


def running_plan(dep, model, request) -> Plan:
    """The coordinator's deployment as a planner ``Plan`` (to price it with the same model)."""
    stages = tuple(Stage(tuple(s.worker_id for s in g), g[0].start, g[0].end) for g in stage_groups(dep.stages))
    return Plan(stages=stages, objective=request.objective, complete=True, predicted=None, reason="running", units=model.n_units)


def prediction_dict(p: Plan) -> dict:
    pr = p.predicted
    return {"objective": p.objective.value, "tpot_s": pr.tpot_s, "ttft_s": pr.ttft_s, "throughput_tok_s": pr.throughput_tok_s,
            "energy_j_per_token": pr.energy_j_per_token, "stage_times_s": list(pr.stage_times_s), "hop_times_s": list(pr.hop_times_s),
            "memory_bytes": dict(pr.memory_bytes), "meets_target": p.meets_target}
