"""Turning a planner's answer into the coordinator's deployment records.

``Deployment`` is what the coordinator runs: an ordered list of (worker, unit range). The
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
        for a, b in zip(self.stages, self.stages[1:]):
            if a.end != b.start:
                raise ValueError(f"stages of plan {self.plan_id} are not contiguous at unit {a.end}")

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(s.worker_id for s in self.stages)


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
