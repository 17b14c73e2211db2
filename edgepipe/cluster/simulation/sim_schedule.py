"""Seeded fault schedules for the simulation: what ``simrun.run`` plays.

``Schedule.random(seed)`` draws 1-6 workers (some joining late), a few requests (some with
out-of-range values, prompts often sharing a start so the prefix cache reuses blocks) and up to
four faults from ``sim.FAULTS``; in some, an operator's plan replicates a stage (``replicate``,
drawn last, so the other draws of a seed stay what they were). The same seed draws the same
schedule under any hash seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import sim
from ..rules.profiling import RUNTIME_OVERHEAD_BYTES
from .sim import FAULTS, REQUEST_BOUND_S, UNIT_BYTES, UNIT_KV_ROOM

PER_FAULT_S = 25.0


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float
    worker: int = 0
    seconds: float = 0.0
    factor: float = 1.0


@dataclass(frozen=True)
class Req:
    at: float
    prompt: tuple[int, ...]
    max_tokens: int
    bad: str | None = None  # which value is out of range
    cancel_after: int | None = None  # targeted schedules: the client goes after this many tokens (a cancel mid-run)


@dataclass(frozen=True)
class Schedule:
    seed: int
    memories: tuple[int, ...]
    join_at: tuple[float, ...]
    requests: tuple[Req, ...]
    faults: tuple[Fault, ...]
    replicate: float | None = None  # at this time, a pinned plan that replicates a stage on a worker the plan leaves out
    # workers without the GGUF kernel library (targeted schedules): the package then holds the
    # model in two forms (``sim.TwoFormManifest``), these get the `native` one, the others `gguf`
    kernel_less: tuple[int, ...] = ()
    # per worker, the budget it enforces where it is less than the memory it declares (targeted
    # schedules: a device that overstates its memory refuses a LOAD the planner thought fits)
    budgets: tuple[int | None, ...] = ()
    # targeted schedules: layers split in proportion to memory (``serve --placement memory``), so
    # every live worker takes a stage: a plan that one worker held is split again when another comes
    memory_placement: bool = False
    # targeted schedules: no KV checkpoints to a spare plan (``direct.grant`` keeps a sequence off the
    # direct path while they are copied), so a lone sequence on a plan of several stages runs direct
    kv_checkpoints: bool = True

    @staticmethod
    def random(seed: int) -> "Schedule":
        rng = random.Random(seed)
        n = rng.randint(1, 6)
        memories = tuple(rng.choice((2, 3, 4, 5, 9)) * (UNIT_BYTES + UNIT_KV_ROOM) + RUNTIME_OVERHEAD_BYTES for _ in range(n))
        faults = []
        for _ in range(rng.randint(0, 4)):
            kind = rng.choice(FAULTS)
            faults.append(Fault(kind, round(rng.uniform(0.5, 30), 3), rng.randrange(n), round(rng.uniform(0.5, 9), 3),
                                round(rng.uniform(2, 10), 2)))
        join_at = tuple(next((f.at for f in faults if f.kind == "join_late" and f.worker == i), 0.0) for i in range(n))
        requests = []
        # Prompts often share a start (a system prompt), so the prefix cache reuses blocks.
        stems = [tuple(rng.randrange(sim.VOCAB) for _ in range(rng.randint(2, 7))) for _ in range(2)]
        for _ in range(rng.randint(1, 6)):
            bad = rng.choice(("top_k", "max_tokens", "context")) if any(f.kind == "bad_request" for f in faults) and rng.random() < 0.4 else None
            stem = rng.choice(stems) if rng.random() < 0.7 else ()
            requests.append(Req(round(rng.uniform(0, 30), 3), stem + tuple(rng.randrange(sim.VOCAB) for _ in range(rng.randint(1, 6))),
                                rng.randint(1, 12), bad))
        replicate = round(rng.uniform(0, 20), 3) if n >= 3 and rng.random() < 0.5 else None
        return Schedule(seed, memories, join_at, tuple(sorted(requests, key=lambda r: r.at)), tuple(sorted(faults, key=lambda f: f.at)),
                        replicate)

    @property
    def bound_s(self) -> float:
        return REQUEST_BOUND_S + PER_FAULT_S * len(self.faults)
