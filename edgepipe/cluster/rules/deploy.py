"""Deployment decisions, pure: what to send to carry a plan change out (``deployer`` sends it).

``kv_moves`` takes the change as ``plan.switching.diff`` states it and returns the KV copies
the runtime needs: diff's ``MoveKV`` actions (from another device) plus, for a device whose
range changed, the overlap with its own old range (this runtime builds a new session per
range, so "its own" KV does not stay in place unless the range is unchanged). A plan with
replicated stages (``placement.stage_groups``) holds each sequence's KV on its route's replicas
only: its copies go from the replicas of its route on the old plan to those of its route on the
new one (``cluster.replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from ...native import FALLBACK_FORM, KERNEL_FORM
from ...net.capabilities import capabilities
from ...net.messages import Hello, Load, NextHop
from ...plan import Plan, Stage
from ...plan.switching import LoadStage, MoveKV, diff
from . import replicas
from ..state.placement import Deployment, StageAssignment, stage_groups
from ..state.state import ClusterState, WorkerInfo


@dataclass(frozen=True)
class KvCopy:
    """Copy the KV of units [start, end) of every moving sequence from ``src`` to ``dst``."""

    src: str
    dst: str
    start: int
    end: int


def as_plan(dep: Deployment | Sequence[StageAssignment], n_units: int) -> Plan:
    stages = dep.stages if isinstance(dep, Deployment) else tuple(dep)
    from ...plan import Objective

    return Plan(stages=tuple(Stage(tuple(s.worker_id for s in g), g[0].start, g[0].end) for g in stage_groups(stages)), objective=Objective.LATENCY,
                complete=True, predicted=None, reason="deployment", units=n_units)


def kv_moves(old: Deployment, new: Deployment, n_units: int, kv_per_unit: Sequence[int],
             old_route: replicas.Route | None = None, new_route: replicas.Route | None = None) -> list[KvCopy]:
    """The KV copies that carry live sequences from ``old`` to ``new`` (only units that have KV).
    Where a plan replicates a stage, the copies of one sequence: from its route on ``old`` to its
    route on ``new`` (none without both routes: it is replayed)."""
    if old.replicated or new.replicated:
        if (old.replicated and old_route is None) or (new.replicated and new_route is None):
            return []
        old = Deployment(old.plan_id, replicas.path(old, old_route or replicas.plain_route(old)))
        new = Deployment(new.plan_id, replicas.path(new, new_route or replicas.plain_route(new)))
    actions = diff(as_plan(old, n_units), as_plan(new, n_units))
    before = {s.worker_id: (s.start, s.end) for s in old.stages}
    copies = [KvCopy(a.src, a.dst, a.start, a.end) for a in actions if isinstance(a, MoveKV)]
    for a in actions:
        if isinstance(a, LoadStage) and a.device in before:
            lo, hi = max(a.start, before[a.device][0]), min(a.end, before[a.device][1])
            if lo < hi:
                copies.append(KvCopy(a.device, a.device, lo, hi))
    out = []
    for c in sorted(copies, key=lambda c: (c.start, c.src, c.dst)):
        units = [u for u in range(c.start, c.end) if kv_per_unit[u]]
        if units:
            out.append(KvCopy(c.src, c.dst, units[0], units[-1] + 1))
    return out


def move_is_cheaper(kv_bytes: int, bandwidth: float, latency_s: float, stage_s: Sequence[float], length: int) -> bool:
    """Moving ``kv_bytes`` beats rebuilding ``length`` tokens by replay (003 table 4.1).

    An exact rebuild replays each token as a decode step; the stages do so as a pipeline."""
    move_s = kv_bytes / bandwidth + latency_s
    recompute_s = sum(stage_s) + (length - 1) * max(stage_s)
    return move_s < recompute_s


def stay_reason(current: Deployment | None, stages: Sequence[StageAssignment], pinned: bool, decision: Mapping | None) -> str | None:
    """Why the running plan stays instead of switching to ``stages`` (None: switch).

    ``decision`` is the plan function's switch verdict (``planning.PlannerPolicy``: margin, switch
    cost over a horizon, hysteresis), absent for plan functions that do not weigh one."""
    if current is None:
        return None
    if pinned:
        return "pinned"  # an operator's plan (POST /v1/cluster/rebalance with pin_s)
    if [(s.worker_id, s.start, s.end) for s in current.stages] == [(s.worker_id, s.start, s.end) for s in stages]:
        return "same plan"
    if decision is not None and not decision["switch"]:
        return f"not worth its switch cost yet: {decision.get('reason', '')}".rstrip(": ")
    return None


def next_hop(stages: Sequence[StageAssignment], i: int, workers: Mapping[str, WorkerInfo],
             secrets: Sequence[str] | None = None) -> dict:
    """Where stage assignment ``i`` sends its output, with the next stage's data-port secret
    (``net.auth``). When the next stage is replicated, the other replicas are ``replicas``: each
    frame goes to the one on its route (``cluster.replicas``)."""
    targets = replicas.next_workers(stages, i)
    if not targets:
        return {"kind": "coordinator"}
    index = {s.worker_id: k for k, s in enumerate(stages)}

    def hop_to(wid: str) -> dict:
        nxt = workers[wid]
        hop = {"kind": "worker", "id": nxt.id, "url": nxt.hello.data_url, "relay": nxt.relay or workers[stages[i].worker_id].relay}
        if secrets is not None and secrets[index[wid]]:
            hop["secret"] = secrets[index[wid]]
        if nxt.hello.data_fingerprint:
            hop["fingerprint"] = nxt.hello.data_fingerprint
        return hop

    first = hop_to(targets[0])
    return {**first, "replicas": [hop_to(w) for w in targets[1:]]} if len(targets) > 1 else first


def feed_fields(stages: Sequence[StageAssignment], i: int, workers: Mapping[str, WorkerInfo], feed_secret: str | None = None) -> dict:
    """The LOAD fields of stage assignment ``i`` for the direct token path on a plan of several
    stages (``rules.direct``): the last stage's ``first`` (the first stage's data port, with the
    secret it takes a feed with), the first stage's ``fed_by`` (the one peer it takes token ids
    from) and ``feed_secret``. None for a plan of one stage (its stage feeds itself), one with
    replicated stages (the coordinator routes each step), or one with a stage on a relay (a
    browser tab: no data port to feed, and its worker keeps no book of what a run computed past
    a DROP): every token then goes through the coordinator."""
    groups = stage_groups(stages)
    if len(groups) < 2 or len(groups) != len(stages):
        return {}
    head, tail = stages[0], stages[-1]
    if any(workers[s.worker_id].relay for s in stages) or not workers[head.worker_id].hello.data_url:
        return {}
    if i == len(stages) - 1:
        hop = {"kind": "worker", "id": head.worker_id, "url": workers[head.worker_id].hello.data_url, "relay": False}
        if feed_secret:
            hop["secret"] = feed_secret
        if workers[head.worker_id].hello.data_fingerprint:
            hop["fingerprint"] = workers[head.worker_id].hello.data_fingerprint
        return {"first": hop}
    if i == 0:
        return {"fed_by": tail.worker_id, **({"feed_secret": feed_secret} if feed_secret else {})}
    return {}




def has_gguf_kernel(hello: Hello) -> bool:
    """Whether a worker can run the `gguf` form: its kernel library loaded and its kind runs ONNX
    Runtime's CPU provider (the WebGPU provider has no custom ops; a browser never has the
    library): ``net.capabilities``."""
    return capabilities(hello).gguf_kernel


def _everywhere(manifest, precision: str) -> bool:
    return all(precision in getattr(u, "variants", ()) for u in manifest.units)


def worker_variant(hello: Hello, manifest, serving: str | None) -> str | None:
    """The weight variant a worker is sent: the one it asks for, else the one the cluster serves
    (``serving``; None: the package's own). Where that is the file's own model (`native` or
    `gguf`) and the package carries both forms, a worker with the kernel library on the CPU gets
    `gguf` and every other worker the MatMulNBits `native` form (the fallback)."""
    if hello.precision:
        return hello.precision
    if (serving or manifest.precision) not in (KERNEL_FORM, FALLBACK_FORM) or not (
            _everywhere(manifest, KERNEL_FORM) and _everywhere(manifest, FALLBACK_FORM)):
        return serving
    return KERNEL_FORM if has_gguf_kernel(hello) else FALLBACK_FORM


def form_to_add(hello: Hello, manifest, serving: str | None) -> str | None:
    """The variant the package lacks before this worker can get its form of the file's own model
    (``worker_variant``): `gguf` for a worker with the kernel where the package holds `native`
    only, `native` for one without where it holds `gguf` only; None when nothing is missing."""
    if hello.precision or (serving or manifest.precision) not in (KERNEL_FORM, FALLBACK_FORM):
        return None
    wanted = KERNEL_FORM if has_gguf_kernel(hello) else FALLBACK_FORM
    return None if _everywhere(manifest, wanted) else wanted


@dataclass(frozen=True)
class StageForm:
    """The graph a worker's stage is sent: its weight variant (``precision``; None: the package's
    own), the GPU form where its kind computes on a GPU (``graphs.gpu_form``), the verify form
    where the cluster decodes speculatively (``graphs.verify_form``), and batch-invariant products."""

    precision: str | None = None
    gpu: bool = False
    verify: bool = False
    batch_invariant: bool = False


def stage_form(state: ClusterState, worker_id: str, manifest, settings) -> StageForm:
    """The form of ``worker_id``'s stages on this cluster: its capabilities and the settings'
    (``precision``, ``speculative``, ``batch_invariant``)."""
    w = state.workers.get(worker_id)
    return StageForm(precision=precision_of(state, worker_id, manifest, settings.precision), gpu=bool(w and w.caps.gpu),
                     verify=bool(settings.speculative), batch_invariant=bool(settings.batch_invariant))


def load_message(package, plan_id: int, start: int, end: int, form: StageForm | str | None, nxt: dict, keep: list[int],
                 warm: bool | None = None, data_secret: str | None = None, feed: dict | None = None) -> Load:
    """The LOAD frame of a stage in ``form`` (a bare precision: that variant's plain CPU form)."""
    if not isinstance(form, StageForm):
        form = StageForm(precision=form)
    precision, manifest = form.precision, package.manifest
    graph = package.stage_graph(start, end, precision, form.batch_invariant, form.gpu, verify=True) if form.verify else \
        package.stage_graph(start, end, precision, form.batch_invariant, form.gpu)
    return Load(plan=plan_id, start=start, end=end, graph=graph,
                files=list(manifest.stage_files(start, end, precision)), next=nxt, keep=keep, max_context=manifest.max_context,
                kv_bytes_per_token=sum(manifest.kv_bytes_per_token(u, precision) for u in range(start, end)), warm=warm,
                data_secret=data_secret, matmul_bytes=sum(manifest.variant(u.index, precision).weight_bytes
                                                          for u in manifest.units[start:end] if u.kind != "embedding"),
                head_bytes=sum(manifest.variant(u.index, precision).weight_bytes for u in manifest.units[start:end] if u.kind == "head"),
                first=NextHop.of(feed["first"]) if feed and feed.get("first") else None, fed_by=(feed or {}).get("fed_by"),
                feed_secret=(feed or {}).get("feed_secret"))


def kv_capacity(state: ClusterState, manifest, precision_of, overhead_bytes: int) -> int | None:
    """KV positions (summed over sequences) the active plan's declared budgets hold at the
    tightest stage (None: no budget declared, the hosts' RAM bounds it). A replicated stage
    holds its replicas' shares: as many times its tightest replica as it has replicas (the
    routes balance the sequences over them)."""
    dep = state.active
    if dep is None:
        return None
    caps = []
    for group in dep.groups:
        mine = []
        for s in group:
            w = state.workers.get(s.worker_id)
            if w is None or not w.hello.memory_budget:
                continue
            units = manifest.units[s.start:s.end]
            weights = sum(manifest.variant(u.index, precision_of(w)).weight_bytes for u in units)
            per_position = sum(manifest.kv_bytes_per_token(u.index, precision_of(w)) for u in units)
            if per_position:
                mine.append(max(0, w.memory_bytes - weights - overhead_bytes) // per_position)
        if mine:
            caps.append(min(mine) * len(group))
    return min(caps) if caps else None


def kv_plan_positions(state: ClusterState, full_context: int) -> int:
    """KV positions a plan must hold: one request at full context, or what the running
    requests may grow to (a stage's pool is sequences x the longest), whichever is more."""
    if not state.requests:
        return full_context
    return max(full_context, len(state.requests) * max(q.positions for q in state.requests.values()))


def catching_up(state: ClusterState, plan_id: int) -> bool:
    """Whether some running sequence has not yet been fed on ``plan_id`` (still the active
    plan): it is being replayed or resumed there."""
    return state.active is not None and state.active.plan_id == plan_id and any(q.plan != plan_id for q in state.requests.values())


def recovery_plan(state: ClusterState, ready: set[str]) -> tuple[StageAssignment, ...] | None:
    """When down: the spare plan, if all its workers are still here (its files are in place)."""
    if state.active is None and state.ever_up and state.spare and {s.worker_id for s in state.spare} <= ready:
        return state.spare
    return None


def precision_of(state: ClusterState, worker_id: str, manifest, serving: str | None) -> str | None:
    """The weight variant a worker of the state is sent (``worker_variant``; a worker no longer
    known gets the cluster's own, ``serving``)."""
    w = state.workers.get(worker_id)
    return serving if w is None else worker_variant(w.hello, manifest, serving)


def kv_bytes_per_unit(manifest, form: str | None) -> list[int]:
    """KV bytes per position of every unit as ``form``'s variant keeps it (``Manifest.kv_bytes_per_token``:
    the gguf form's cache is fp16, half the fp32 one of the others; None: the package's own form)."""
    return [manifest.kv_bytes_per_token(u.index, form) for u in manifest.units]


def worker_kv_bytes(state: ClusterState, manifest, serving: str | None) -> Callable[[str], list[int]]:
    """A worker id -> ``kv_bytes_per_unit`` in the form that worker is sent (``precision_of``): what
    a copy of KV from it carries."""
    return lambda worker_id: kv_bytes_per_unit(manifest, precision_of(state, worker_id, manifest, serving))


def budget_form(state: ClusterState, manifest, serving: str | None, worker_ids: Iterable[str]) -> str | None:
    """The form whose KV a budget over ``worker_ids`` counts: the one they are all sent; where they
    get different forms, the one that keeps the most KV per position (the budget then holds on
    each of them); no worker: the cluster's own (``serving``)."""
    forms = {precision_of(state, w, manifest, serving) for w in worker_ids} or {serving}
    return max(sorted(forms, key=str), key=lambda form: sum(kv_bytes_per_unit(manifest, form)))


def plannable(state: ClusterState, now: float) -> list[WorkerInfo]:
    """The workers a new plan may use: live (not suspected, not quarantined), in join order, not
    held by the calibrator (a worker being timed would be planned on guessed figures), and not
    drafters (``--role drafter``: they run the draft model, never a stage)."""
    return [w for w in state.live(now) if not w.calibrating and not w.hello.drafter]


def steps_may_start(state: ClusterState) -> bool:
    """Sequences step only while no plan is being swapped in (the deployer's gate is open)."""
    return state.switching is None


def worker_forms(state: ClusterState, manifest, serving: str | None, worker_ids: Iterable[str]) -> dict[str, str | None]:
    """Worker id -> the form it is sent (``precision_of``): the planner prices each device with
    its own form's weights and KV, so a joining device of another form (a tab, a worker without
    the kernel library) leaves the others' figures as they were."""
    return {w: precision_of(state, w, manifest, serving) for w in worker_ids}


# Where a new plan may load beside the running one (``load_room``), as deploy.X for the deployer and planner.
from .load_room import FAILED_PLAN_HOLD_S, new_stage_room, repeats_failure  # noqa: E402,F401
