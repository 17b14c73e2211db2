"""Plans under churn: what a device that keeps leaving costs a plan that relies on it.

A plan is down whenever one of its devices has failed and the cluster has not yet recovered.
With failure rates ``λ_d`` (per second of a device's life) and a mean recovery time ``R``,
the renewal argument gives the fraction of time a plan over devices ``D`` is up:

    availability = 1 / (1 + R · Σ_{d in D} λ_d)

so spreading a model over more devices than it needs multiplies its exposure. The expected
goodput of a plan is its predicted throughput times that fraction; the coordinator's policy
compares plans by it once it has seen devices leave (with no failures seen it changes nothing).
"""

from __future__ import annotations

from typing import Iterable, Mapping

PRIOR_LIFE_S = 600.0  # a device is assumed to have lived this long without failing before we saw it


def failure_rate(failures: int, alive_s: float, prior_life_s: float = PRIOR_LIFE_S) -> float:
    """Failures per second of life, shrunk toward zero by a failure-free prior life."""
    if failures < 0 or alive_s < 0:
        raise ValueError(f"failures and alive time must be >= 0, got {failures}, {alive_s}")
    return failures / (alive_s + prior_life_s)


def availability(rates: Iterable[float], recovery_s: float) -> float:
    """Fraction of time a plan whose devices fail at ``rates`` is up (see the module docstring)."""
    if recovery_s < 0:
        raise ValueError(f"recovery time must be >= 0, got {recovery_s}")
    return 1.0 / (1.0 + recovery_s * sum(rates))


def expected_goodput(throughput_tok_s: float, device_ids: Iterable[str], rates: Mapping[str, float], recovery_s: float) -> float:
    """Tokens/s a plan delivers on average once its downtime under churn is counted."""
    return throughput_tok_s * availability((rates.get(d, 0.0) for d in set(device_ids)), recovery_s)
