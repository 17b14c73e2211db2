"""Many seeded schedules at once: ``play(first, count)`` runs them on up to two processes and
sums up what they covered and which seeds failed (``python -m edgepipe.cluster.simulation.simrun --play``)."""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import time

from .simrun import run
from .sim_schedule import Schedule


def _play_one(seed: int) -> tuple:
    logging.disable(logging.CRITICAL)
    r = run(Schedule.random(seed))
    return seed, sorted(set(r.kinds)), r.violations, r.time_to_up, r.worst_error_s, r.worst_ok_s, r.ok, r.errors, r.rejected, r.prefix_hits, r.replicated, r.replica_lost, r.direct, r.direct_first


def play(first: int, count: int) -> dict:
    """Schedules ``first .. first + count - 1`` on up to two processes: what they covered and the
    failing seeds with their violations (a JSON-able summary)."""
    t0 = time.perf_counter()
    procs = min(2, os.cpu_count() or 1)
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        results = pool.map(_play_one, range(first, first + count), chunksize=8)
    kinds = collections.Counter(k for r in results for k in r[1])
    return {
        "schedules": count, "seconds": round(time.perf_counter() - t0, 1), "processes": procs,
        "fault_kinds": dict(sorted(kinds.items())), "without_faults": sum(not r[1] for r in results),
        "worst_time_to_up_s": max((r[3] for r in results if r[3] is not None), default=None),
        "worst_time_to_error_s": max(r[4] for r in results), "worst_time_to_complete_s": max(r[5] for r in results),
        "requests_ok": sum(r[6] for r in results), "requests_failed_clearly": sum(r[7] for r in results),
        "requests_rejected": sum(r[8] for r in results), "prefix_hits": sum(r[9] for r in results),
        "replicated_plans": sum(r[10] for r in results), "replicas_lost": sum(r[11] for r in results),
        "direct_steps": sum(r[12] for r in results),  # decode steps a last stage fed (the direct token path)
        "direct_steps_first": sum(r[13] for r in results),  # of those, fed by a plan of several stages' last stage to its first
        "failing": [[r[0], r[2]] for r in results if r[2]],
    }
