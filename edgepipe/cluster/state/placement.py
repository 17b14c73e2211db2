"""Turning a planner's answer into the coordinator's deployment records.

``Deployment`` is what the coordinator runs: an ordered list of (worker, unit range); a stage
replicated over several workers (data-parallel replicas, the throughput objective's plans)
appears as consecutive assignments of the same range, one per replica (``groups``). The
fallback ``proportional_split`` cuts layers in proportion to declared memory — how exo and
llama.cpp place layers — and is also a baseline in the placement benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageAssignment:
    worker_id: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage on {self.worker_id}: bad unit range [{self.start}, {self.end})")


@dataclass(frozen=True)
class Deployment:
    plan_id: int
    stages: tuple[StageAssignment, ...]
    reason: str = ""
    predicted: dict = field(default_factory=dict)  # tpot_s, ttft_s, ... from the planner

    def __post_init__(self) -> None:
        check_stages(self.stages, f"plan {self.plan_id}")

    @property
    def workers(self) -> tuple[str, ...]:
        """Every worker of the plan, replicas included."""
        return tuple(s.worker_id for s in self.stages)

    @property
    def groups(self) -> tuple[tuple[StageAssignment, ...], ...]:
        return stage_groups(self.stages)

    @property
    def replicated(self) -> bool:
        return len(self.groups) != len(self.stages)


def stage_groups(stages) -> tuple[tuple[StageAssignment, ...], ...]:
    """The pipeline's stages in order, each as the tuple of its replicas (one for most stages)."""
    groups: list[list[StageAssignment]] = []
    for s in stages:
        if groups and (groups[-1][0].start, groups[-1][0].end) == (s.start, s.end):
            groups[-1].append(s)
        else:
            groups.append([s])
    return tuple(tuple(g) for g in groups)


def check_stages(stages, what: str) -> None:
    """Contiguous ranges (a replica repeats its stage's range); no worker twice."""
    for a, b in zip(stages, stages[1:]):
        if a.end != b.start and (a.start, a.end) != (b.start, b.end):
            raise ValueError(f"stages of {what} are not contiguous at unit {a.end}")
    seen = [s.worker_id for s in stages]
    if len(set(seen)) != len(seen):
        raise ValueError(f"stages of {what} use worker {next(w for w in seen if seen.count(w) > 1)} twice")


def proportional_split(n_units: int, weights: list[tuple[str, float]]) -> list[StageAssignment]:
    """Contiguous ranges sized in proportion to ``weights`` (e.g. memory); every worker gets >= 1 unit."""
    weights = [(w, max(v, 1e-9)) for w, v in weights][:n_units]
    total = sum(v for _, v in weights)
    stages, start, acc = [], 0, 0.0
    for i, (worker, v) in enumerate(weights):
        acc += v
        left = len(weights) - i - 1
        end = n_units if left == 0 else min(max(start + 1, round(n_units * acc / total)), n_units - left)
        stages.append(StageAssignment(worker, start, end))
        start = end
    return stages


def equal_split(n_units: int, workers: list[str]) -> list[StageAssignment]:
    return proportional_split(n_units, [(w, 1.0) for w in workers])
