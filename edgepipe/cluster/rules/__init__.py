"""The coordinator's decisions, pure: functions of the state (``core.handle`` and the rules it reads:
membership, admission, the step path, deploy, KV moves, load room, replicas, calibration, planning).
No I/O, no clock; reads ``state`` only."""
