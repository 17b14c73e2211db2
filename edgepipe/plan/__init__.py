"""The planner: profiles in, plan out (pure; see DESIGN.md "The planner")."""

from .milp import MilpResult, milp_latency
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
    DeviceProfile,
    LinkProfile,
    ModelProfile,
    NetworkProfile,
    UnitProfile,
    transformer_profile,
)
