"""The planner: profiles in, plan out (pure; see DESIGN.md "The planner").

`plan()` places a model on a pool of devices for an objective and returns the best plan,
runners-up and how it searched; `evaluate()` is the cost model every search and the runtime's
predicted-vs-measured check share; `switching` decides when and how to move to a new plan;
`fit` turns measurements into device speeds. Nothing here does I/O or reads a clock.
"""

from .devices_file import DevicesFile, DevicesFileError, load_devices, parse_devices
from .fit import RollingMedian, SpeedFit, fit_speed_overhead, mape
from .milp import MilpResult, milp_energy, milp_latency
from .order import plan
from .plan import (
    Objective,
    Plan,
    PlanError,
    PlanRequest,
    PlanResult,
    Prediction,
    Stage,
    evaluate,
    hop_s,
    meets_target,
    objective_key,
    objective_value,
)
from .profiles import (
    COORDINATOR,
    DEFAULT_LINK,
    DeviceProfile,
    LinkProfile,
    ModelProfile,
    NetworkProfile,
    UnitProfile,
    transformer_profile,
)
from .reliability import availability, expected_goodput, failure_rate
from .report import render, to_json
from .switching import (
    Action,
    DropStage,
    FetchUnits,
    LoadStage,
    MoveKV,
    SwitchDecision,
    decay,
    diff,
    should_switch,
    spare_plan,
    switch_cost,
)

__all__ = [
    "availability",
    "expected_goodput",
    "failure_rate",
    "COORDINATOR",
    "DEFAULT_LINK",
    "Action",
    "DeviceProfile",
    "DevicesFile",
    "DevicesFileError",
    "DropStage",
    "FetchUnits",
    "LinkProfile",
    "LoadStage",
    "MilpResult",
    "ModelProfile",
    "MoveKV",
    "NetworkProfile",
    "Objective",
    "Plan",
    "PlanError",
    "PlanRequest",
    "PlanResult",
    "Prediction",
    "RollingMedian",
    "SpeedFit",
    "Stage",
    "SwitchDecision",
    "UnitProfile",
    "decay",
    "diff",
    "evaluate",
    "fit_speed_overhead",
    "hop_s",
    "load_devices",
    "mape",
    "meets_target",
    "milp_energy",
    "milp_latency",
    "objective_key",
    "objective_value",
    "parse_devices",
    "plan",
    "render",
    "to_json",
    "should_switch",
    "spare_plan",
    "switch_cost",
    "transformer_profile",
]
