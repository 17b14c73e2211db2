"""What the coordinator shows: a worker as the planner and HTTP views see it, and ``status``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ...net.channel import Channel
from ...net.protocol import Message, encode
from ..rules import replicas
from ..state.state import WorkerInfo


@dataclass
class Link:
    """The I/O side of one worker: its channel and the replies it owes."""

    channel: Channel
    loads: dict[int, asyncio.Future] = field(default_factory=dict)
    probes: dict[int, asyncio.Future] = field(default_factory=dict)

    async def send(self, msg: Message) -> None:
        await self.channel.send(encode(msg))


class WorkerView:
    """A worker as the planner and the HTTP views see it: its state plus its link (read-only)."""

    def __init__(self, info: WorkerInfo, link: Link):
        self.info, self.link = info, link

    def __getattr__(self, name):
        return getattr(self.info, name)

    @property
    def channel(self) -> Channel:
        return self.link.channel

    async def send(self, msg: Message) -> None:
        await self.link.send(msg)



def _quarantine_left(cluster, w, now: float) -> float | None:
    q = cluster.quarantine.get(w.identity)
    return round(q.until - now, 1) if q is not None and q.until > now else None


def _profile(coord, worker_id: str) -> dict | None:
    """What the planner currently believes of a worker (speed relative to the import's unit costs)."""
    m = coord.profile.devices.get(worker_id)
    if m is None or not m.calibrated:
        return None
    return {"speed": round(m.speed, 4), "overhead_ms": round(m.overhead_s * 1e3, 3),
            "row_speed": None if m.row_speed is None else round(m.row_speed, 4)}


def _stage_weights(coord, dep, worker_id: str) -> int | None:
    """Bytes of the weights the worker's stage in the active plan holds (None: no stage)."""
    stage = next((s for s in dep.stages if s.worker_id == worker_id), None) if dep else None
    if stage is None:
        return None
    precision = coord.deployer.precision(worker_id)
    try:
        return sum(coord.manifest.variant(u, precision).weight_bytes for u in range(stage.start, stage.end))
    except KeyError:  # the variant is still being added
        return None


def replica_fields(dep, requests, worker_id: str) -> dict:
    """A worker of a replicated stage: ``replica`` [k, of n] and the sequences routed through it."""
    group = next(g for g in dep.groups if any(s.worker_id == worker_id for s in g))
    if len(group) == 1:
        return {}
    k = [s.worker_id for s in group].index(worker_id)
    routed = sum(1 for rid in requests if worker_id in (replicas.routed(requests, dep, rid) or ()))
    return {"replica": [k + 1, len(group)], "sequences": routed}


def status(coord) -> dict:
    """The cluster at a glance (``GET /v1/cluster/status``)."""
    dep = coord.cluster.active
    return {
        "state": coord.cluster.phase.value,
        "model": coord.manifest.name,
        "context": coord.manifest.max_context,  # the longest sequence served (serve --context)
        "n_units": coord.n_units,
        "units": [{"index": u.index, "name": u.name, "kind": u.kind} for u in coord.manifest.units],
        "plan": None if dep is None else {
            "id": dep.plan_id, "reason": dep.reason, "predicted": dep.predicted,
            "stages": [{"worker": s.worker_id, "start": s.start, "end": s.end,
                        "precision": coord.deployer.precision(s.worker_id) or coord.manifest.precision,
                        **replica_fields(dep, coord.cluster.requests, s.worker_id)} for s in dep.stages],
            "replicated": dep.replicated,
            "pinned_s": round(coord.cluster.pin[1] - coord.clock(), 1) if coord.cluster.pinned(coord.clock()) else None,
            # where speculative decoding's draft model runs: "coordinator" or a drafter worker's id (cluster.draft_placement)
            "draft": None if coord.speculation is None else coord.drafting.placed.site if coord.drafting is not None else "coordinator",
        },
        "workers": [{
            "id": w.id, "name": w.name, "kind": w.hello.kind, "role": w.hello.role or "stage", "memory_bytes": w.memory_bytes,
            "device": w.hello.device or "cpu", "device_kind": w.caps.kind.name, "adapter": w.hello.adapter, "device_note": w.hello.device_note,
            "data_url": w.hello.data_url, "pid": w.hello.pid,
            "native_kernel": w.hello.native_kernel, "native_kernel_note": w.hello.native_kernel_note,
            "rtt_ms": None if w.rtt_s is None else round(w.rtt_s * 1e3, 2),
            # emulation is what --slowdown, --roofline and link shaping inject; a --memory budget is a budget
            "emulation": w.hello.declared_emulation, "emulated": w.hello.emulated, "memory_budget": w.hello.memory_budget,
            "suspected": w.suspected_since is not None, "stats": dict(w.stats),
            "quarantined_s": _quarantine_left(coord.cluster, w, coord.clock()),
            "units": next(([s.start, s.end] for s in dep.stages if s.worker_id == w.id), None) if dep else None,
            **(replica_fields(dep, coord.cluster.requests, w.id) if dep is not None and w.id in dep.workers else {}),
            "weights_bytes": _stage_weights(coord, dep, w.id),
            "profile": _profile(coord, w.id),
        } for w in coord.cluster.workers.values()],
        "requests_in_flight": coord.requests_in_flight,
        "last_failure": coord.cluster.last_failure,
        "capacity": coord.requests.lacking(),
        "state_seconds": {k: round(v, 3) for k, v in coord.state_durations().items()},
        "speculation": None if coord.speculation is None else coord.speculation.view(coord.drafting),
        "prefix_cache": coord.prefix.view(),
    }
