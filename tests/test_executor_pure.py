"""The coordinator's one executor (``shells.executor``): every command type of the core is carried
out, each by exactly the collaborator that owns what it touches; a command type it does not know
raises; the state the core returned is adopted as it is (its events are not applied again)."""

from __future__ import annotations

import asyncio
import dataclasses
import typing

import pytest

from edgepipe.cluster.rules import core
from edgepipe.cluster.shells.executor import Executor
from edgepipe.cluster.state import admission_book as AB, state as S

pytestmark = pytest.mark.pure  # no process, no model: the shell with recording collaborators

COMMANDS = typing.get_args(core.Command)


class Recorder:
    """Any method called on it is recorded as (its name, the method, its arguments)."""

    def __init__(self, name: str, calls: list):
        self._name, self._calls = name, calls

    def __getattr__(self, method: str):
        if method.startswith("__"):
            raise AttributeError(method)
        return lambda *args: self._calls.append((self._name, method, args))


class Ports:
    def __init__(self, calls: list):
        self.calls = calls
        self.replan_wanted = Recorder("replan_wanted", calls)
        self.settings = type("Settings", (), {"lane_wait_s": 0.0})()

    def spawn(self, coro):
        self.calls.append(("ports", "spawn", (coro.__qualname__,)))
        coro.close()

    def measure(self, m):
        self.calls.append(("ports", "measure", (m,)))


def _placeholder(cls):
    """An instance of a command dataclass with a placeholder in every field."""
    return cls(**{f.name: f"<{f.name}>" for f in dataclasses.fields(cls)})


def _executor(calls: list) -> Executor:
    executor = Executor(S.ClusterState, lambda state, events: calls.append(("carry", "carry", (state, events))), core.Config())

    async def lose(wid, why):
        pass

    async def quarantine(wid, why):
        pass

    class Connections(Recorder):
        async def ping_all(self, now):
            pass

    executor.bind(ports=Ports(calls), lose=lose, quarantine=quarantine, connections=Connections("connections", calls),
                  **{name: Recorder(name, calls) for name in ("steps", "prefix", "migration", "checkpoints", "admission")})
    return executor


def test_every_command_type_of_the_core_is_carried_out_by_one_collaborator():
    assert len(COMMANDS) >= 16  # the union is flat: every command type, the step path's included
    owner = {core.LoseWorker: ("ports", "spawn"), core.FailPlan: ("steps", "lost"), core.Replan: ("replan_wanted", "set"),
             core.PingAll: ("ports", "spawn"), core.Measure: ("ports", "measure"), core.CarryPrefix: ("prefix", "carry"),
             core.AnswerLoad: ("connections", "answer_load"), core.AckKvMove: ("migration", "moved"),
             core.AckCheckpointCopy: ("checkpoints", "moved"), core.StartRequest: ("admission", "start"),
             core.RefuseRequest: ("admission", "refuse"), core.SettleStep: ("steps", "settle"), core.FailStep: ("steps", "fail"),
             core.Quarantine: ("ports", "spawn"), core.SendBatch: ("steps", "send_batch")}

    async def carried(command):
        calls: list = []
        _executor(calls).carry_out(core.Handled(S.ClusterState(), (), (command,)))
        await asyncio.sleep(0)  # a lane's timer (``ArmLane``) fires and asks the core again
        return calls

    for cls in COMMANDS:
        if cls is core.ArmLane:
            calls = asyncio.run(carried(core.ArmLane(0, 1)))
            assert [c[:2] for c in calls] == [("carry", "carry"), ("carry", "carry")]  # its LaneExpired went to the core
            continue
        calls = asyncio.run(carried(_placeholder(cls)))
        assert calls[0][:2] == ("carry", "carry") and [c[:2] for c in calls[1:]] == [owner[cls]], cls


def test_a_command_type_the_executor_does_not_know_raises():
    @dataclasses.dataclass(frozen=True)
    class Unheard:
        pass

    with pytest.raises(AssertionError):
        _executor([]).carry_out(core.Handled(S.ClusterState(), (), (Unheard(),)))


def test_the_state_the_core_returned_is_adopted_with_its_events():
    calls: list = []
    executor = _executor(calls)
    handled = executor.handle(core.AdmitAsked(1, 10, None, AB.Limits()))
    (carry, *rest) = calls
    assert carry[2] == (handled.state, (AB.Admitted(1, 10),)) and handled.state.admission.running == {1: 10}
    assert [c[:3] for c in rest] == [("admission", "start", (1,))]
