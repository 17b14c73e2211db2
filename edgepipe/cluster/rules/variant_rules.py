"""What building weight variants costs, pure: which units lack a form, what a build adds on disk,
and why one is refused (one line) — the rules ``variants`` (the shell that builds them) and the
planner's pricing (``profiling``) both read."""

from __future__ import annotations

from . import deploy


def own_forms(manifest) -> frozenset[str]:
    """The forms that are the package's own model (not counted against the budget)."""
    own = manifest.precision
    return frozenset({own, deploy.KERNEL_FORM, deploy.FALLBACK_FORM}) if own in (deploy.KERNEL_FORM, deploy.FALLBACK_FORM) else frozenset({own})


def missing_units(manifest, precision: str | None, start: int, end: int) -> tuple[int, ...]:
    """Units of ``[start, end)`` that lack ``precision``'s variant (None: the package's own, never missing)."""
    if precision is None:
        return ()
    return tuple(u.index for u in manifest.units[start:end] if precision not in u.variants)


def added_bytes(manifest) -> int:
    """Weight bytes the variants beyond the package's own forms hold (a tied table counted by both units that use it)."""
    own = own_forms(manifest)
    return sum(v.weight_bytes for u in manifest.units for p, v in u.variants.items() if p not in own)


def estimated_bytes(manifest, precision: str, units) -> int:
    """What building ``precision`` for ``units`` adds (``importer.estimated_weight_bytes``; a
    precision it cannot size: the package's own unit sizes)."""
    sizes = unit_sizes(manifest, precision)
    return sum(sizes[u] for u in units)


def unit_sizes(manifest, precision: str) -> tuple[int, ...]:
    """Per unit, ``precision``'s weight bytes: as built, else as estimated (else the package's own)."""
    from ...model.config import ModelConfig
    from ...model.importer import estimated_weight_bytes

    try:
        estimate = estimated_weight_bytes(ModelConfig.from_dict(manifest.config), precision)
    except (TypeError, KeyError, AttributeError):  # a manifest without a full config (the simulation's)
        estimate = None
    out = []
    for u in manifest.units:
        if precision in u.variants:
            out.append(manifest.variant(u.index, precision).weight_bytes)
        elif estimate is not None:
            out.append(estimate[u.index])
        else:
            out.append(manifest.variant(u.index).weight_bytes)
    return tuple(out)


def budget_problem(manifest, precision: str, units, budget_bytes: int, free_bytes: int | None) -> str | None:
    """One line saying why building ``precision`` for ``units`` is refused, or None: a variant
    beyond the package's own forms may add at most ``budget_bytes`` in all, and no build may take
    the disk's last ``free_bytes``."""
    need = estimated_bytes(manifest, precision, units)
    what = f"the {precision} variant of {len(units)} unit{'s' if len(units) != 1 else ''} ({_span(units)}) needs ~{_mb(need)} on disk"
    if precision not in own_forms(manifest):
        used = added_bytes(manifest)
        if used + need > budget_bytes:
            return (f"{what}, beyond the {_mb(budget_bytes)} the browser variants may take ({_mb(used)} built already; "
                    f"serve --variant-disk sets it)")
    if free_bytes is not None and need > free_bytes:
        return f"{what}, but only {_mb(free_bytes)} is free there"
    return None


def _span(units) -> str:
    """``units [1, 5)``, or ``units [0, 1) + [5, 30)`` where units between are built already."""
    runs: list[list[int]] = []
    for u in sorted(units):
        if runs and runs[-1][1] == u:
            runs[-1][1] = u + 1
        else:
            runs.append([u, u + 1])
    return "units " + " + ".join(f"[{a}, {b})" for a, b in runs)


def _mb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
