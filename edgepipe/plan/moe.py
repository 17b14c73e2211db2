"""What a mixture-of-experts layer costs the planner: its memory is every expert, a step reads the routed ones.

Pure arithmetic on a ``UnitProfile`` with ``experts`` > 0 (``model/moe.py`` builds such layers).
A one-row decode step reads the layer's shared weights (attention, router, norms) and the
``k`` experts the row is routed to; a batched step of ``S`` rows reads the union of its rows'
experts, about ``E * (1 - (1 - k / E) ** S)`` of them when rows route independently and
uniformly (DESIGN.md, "Mixture-of-experts layers"). The unit's ``cost`` is its measured one-row
step; decode being memory-bound, a step's cost scales with the bytes it reads, so a batched step
costs ``cost * (bytes_read(S) / bytes_read(1) - 1)`` more than one row does in expert reads
(``extra_cost``), on top of the per-row compute every layer prices with ``row_speed``.
"""

from __future__ import annotations

from .profiles import ModelProfile, UnitProfile


def experts_touched(experts: int, used: int, rows: int) -> float:
    """Expected distinct experts ``rows`` rows read, each routed to ``used`` of ``experts``."""
    if experts <= 0 or rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - used / experts) ** rows)


def bytes_read(unit: UnitProfile, rows: int) -> float:
    """Weight bytes a ``rows``-row step of ``unit`` reads (a dense unit: all of them)."""
    if not unit.experts:
        return float(unit.weight_bytes)
    shared = max(unit.weight_bytes - unit.experts * unit.expert_bytes, 0)
    return shared + experts_touched(unit.experts, unit.experts_used, max(rows, 1)) * unit.expert_bytes


def extra_cost(unit: UnitProfile, rows: int) -> float:
    """Cost units a ``rows``-row step of ``unit`` spends reading experts beyond a one-row step's
    (0 for a dense unit or one row)."""
    if not unit.experts or rows <= 1:
        return 0.0
    one = bytes_read(unit, 1)
    return unit.cost * (bytes_read(unit, rows) - one) / one if one else 0.0


def range_extra_cost(model: ModelProfile, start: int, end: int, rows: int) -> float:
    """``extra_cost`` summed over units ``[start, end)``."""
    return sum(extra_cost(u, rows) for u in model.units[start:end])
