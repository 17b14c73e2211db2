"""Deterministic simulation of the control plane: the shipped coordinator and worker shells on fake
ports, seeded fault schedules, and the invariants checked after each."""
