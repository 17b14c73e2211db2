"""Plain-text rendering of a planning result: the best plan's stages and the runners-up.

This module owns only formatting (text, and the JSON document of `edgepipe plan --json`);
it computes nothing the plan does not already carry.
Emulated devices are labelled as such, as every report must (DESIGN.md, emulation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .plan import Plan, PlanResult, device_map
from .profiles import DeviceProfile

MIB = 1024 * 1024


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def render(
    result: PlanResult | Plan,
    devices: Iterable[DeviceProfile] | Mapping[str, DeviceProfile] | None = None,
) -> str:
    """A fixed-width text report: stages of the best plan, then every plan in one line each."""
    if isinstance(result, PlanResult):
        plans = (result.best, *result.runners_up)
        searched = f"search: {result.searched}"
        if result.lower_bound is not None:
            searched += f"; lower bound {_ms(result.lower_bound)} ms ring time"
        if result.best.complete and result.gap is not None:
            searched += f"; gap to bound {result.gap * 100:.3f}%"
        searched += "; proven optimal" if result.optimal else ""
    else:
        plans, searched = (result,), ""
    devs = device_map(devices) if devices is not None else {}
    best = plans[0]
    lines = [f"objective: {best.objective.value}" + (f" ({searched})" if searched else ""), best.reason]
    if not best.complete:
        lines.insert(1, "PARTIAL PLAN: the model is not fully placed")
    if best.predicted is not None:
        p = best.predicted
        memory = dict(p.memory_bytes)
        rows = []
        for index, stage in enumerate(best.stages):
            names = []
            for device_id in stage.device_ids:
                device = devs.get(device_id)
                label = device_id + (" (emulated)" if device is not None and device.emulated else "")
                if device is not None and device.kind == "gpu":
                    label += f" [gpu{': ' + device.adapter if device.adapter else ''}]"
                names.append(label)
            mem = " / ".join(
                f"{memory[d] / MIB:.0f}" + (f" of {devs[d].memory_bytes / MIB:.0f}" if d in devs else "")
                for d in stage.device_ids
            )
            rows.append(
                [str(index), "+".join(names), f"[{stage.start}, {stage.end})", _ms(p.stage_times_s[index]),
                 _ms(p.hop_times_s[index]), mem]
            )
        rows.append(["", "-> coordinator", "", "", _ms(p.hop_times_s[-1]), ""])
        lines.append("")
        lines += _table(["stage", "devices", "units", "time ms", "hop-in ms", "memory MiB"], rows, {3, 4})
    summary = []
    for rank, plan in enumerate(plans):
        if plan.predicted is None or not plan.complete:
            continue  # a partial plan produces no tokens: no throughput, energy or TTFT
        p = plan.predicted
        layout = " | ".join(f"{'+'.join(s.device_ids)} [{s.start},{s.end})" for s in plan.stages)
        target = "" if plan.meets_target is None else ("yes" if plan.meets_target else "no")
        summary.append(
            [str(rank), _ms(p.tpot_s), _ms(p.ttft_s), f"{p.throughput_tok_s:.2f}",
             f"{p.energy_j_per_token:.4f}", target, layout]
        )
    if summary:
        lines.append("")
        lines += _table(
            ["rank", "tpot ms", "ttft ms", "tok/s", "J/token", "target", "stages"], summary, {1, 2, 3, 4}
        )
    return "\n".join(lines) + "\n"


def to_json(result: PlanResult) -> dict[str, Any]:
    """The planning result as plain JSON values (seconds, joules, bytes; stages as ranges).

    A partial plan carries its stages and reason but no prediction of tokens (it makes none)."""

    def plan_dict(plan: Plan) -> dict[str, Any]:
        out: dict[str, Any] = {
            "complete": plan.complete,
            "reason": plan.reason,
            "stages": [{"devices": list(s.device_ids), "start": s.start, "end": s.end} for s in plan.stages],
        }
        p = plan.predicted
        if p is not None and plan.complete:
            out["predicted"] = {
                "tpot_s": p.tpot_s,
                "ttft_s": p.ttft_s,
                "throughput_tok_s": p.throughput_tok_s,
                "energy_j_per_token": p.energy_j_per_token,
                "ring_s": p.ring_s,
                "bottleneck_s": p.bottleneck_s,
                "stage_times_s": list(p.stage_times_s),
                "hop_times_s": list(p.hop_times_s),
                "memory_bytes": dict(p.memory_bytes),
            }
            out["meets_target"] = plan.meets_target
        elif p is not None:
            out["memory_bytes"] = dict(p.memory_bytes)
        return out

    return {
        "objective": result.best.objective.value,
        "search": result.searched,
        "optimal": result.optimal,
        "lower_bound_ring_s": result.lower_bound,
        "bound": result.bound,
        "gap": result.gap if result.best.complete else None,
        "best": plan_dict(result.best),
        "runners_up": [plan_dict(p) for p in result.runners_up],
    }
