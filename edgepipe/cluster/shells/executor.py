"""The one executor of the coordinator's core (I/O): every ``core.Command`` is carried out here.

``Executor.handle(input)`` asks the core (``core.handle``) from the state now, takes the state it
returns with its events (``carry``: logged and narrated as the coordinator logs every event,
not applied a second time) and carries out each command by a total match over ``core.Command``:
a command type added to the core and not carried out here fails the type check
(``typing.assert_never``) and raises at run time. The shells that meet the core's inputs
(``connections``, ``steps``, ``prefix_cache``, ``admission``) hand them to ``handle``; none
carries out a command of its own.

The commands go to the collaborators that own what they touch, each bound by the coordinator
after it built them (they are built with this executor): the worker channels (``connections``:
a LOAD's waiter, the heartbeat's pings), the futures of steps (``steps``), the prefill frame
that carries a prefix decision (``prefix``), a switch's KV moves (``migration``), the
checkpoints' copies (``checkpoints``), the API's tickets in line (``admission``), taking a
worker out (``lose``, ``quarantine``) and the re-planner and measurements (``ports``). A
command re-entering ``handle`` (a failed plan fails its steps; a ticket handed to a waiter
already gone gives its slot back) asks the core again from the state its predecessor left.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, assert_never

from ..rules import core
from ..state import step_book as SB
from ..state.state import ClusterState


class Executor:
    def __init__(self, state: Callable[[], ClusterState], carry: Callable[[ClusterState, tuple], None], config: core.Config):
        self.state = state  # the cluster state now
        self.carry = carry  # takes the core's result: its state and the events that made it (``Ports.carry``)
        self.config = config
        # the collaborators the commands go to (``Coordinator`` binds them; an admission of its
        # own, before it is bound to a coordinator, has only ``admission``)
        self.ports = None  # ``ports.Ports``: spawn, measure, the re-planner's wake-up, the links, the settings
        self.lose: Callable[[str, str], Awaitable[None]] | None = None
        self.quarantine: Callable[[str, str], Awaitable[None]] | None = None
        self.connections = self.steps = self.prefix = self.migration = self.checkpoints = self.admission = None

    def bind(self, **collaborators) -> None:
        """Give the executor the collaborators its commands go to, by the names above."""
        for name, collaborator in collaborators.items():
            if not hasattr(self, name) or name in ("state", "carry", "config"):
                raise TypeError(f"the executor has no collaborator {name!r}")
            setattr(self, name, collaborator)

    def handle(self, given: core.Input) -> core.Handled:
        """Ask the core about ``given`` and carry out what it decided; returns what it decided."""
        handled = core.handle(self.state(), given, self.config)
        self.carry_out(handled)
        return handled

    def carry_out(self, handled: core.Handled) -> None:
        """Adopt the state the core returned (with its events), then carry out every command."""
        self.carry(handled.state, handled.events)
        for command in handled.commands:
            self._do(command)
        if self.steps is not None:  # a step that ended unsettled (timed out, given up): nobody waits for it any more
            for event in handled.events:
                if isinstance(event, SB.StepEnded):
                    self.steps.forget(event.step_id)

    def _do(self, command: core.Command) -> None:
        p = self.ports
        match command:
            case core.LoseWorker(wid, why):
                p.spawn(self.lose(wid, why))
            case core.FailPlan(plan, why):
                self.steps.lost(plan, why)
            case core.Replan():
                p.replan_wanted.set()
            case core.PingAll(now):
                p.spawn(self.connections.ping_all(now))
            case core.Measure(m):
                p.measure(m)
            case core.CarryPrefix(rid, decision):
                self.prefix.carry(rid, decision)
            case core.AnswerLoad(wid, reply):
                self.connections.answer_load(wid, reply)
            case core.AckKvMove(reply):
                self.migration.moved(reply)
            case core.AckCheckpointCopy(reply):
                self.checkpoints.moved(reply)
            case core.StartRequest(ticket):
                self.admission.start(ticket)
            case core.RefuseRequest(ticket, why, retry_after_s):
                self.admission.refuse(ticket, why, retry_after_s)
            case core.SettleStep(step_id, result):
                self.steps.settle(step_id, result)
            case core.FailStep(step_id, why, final):
                self.steps.fail(step_id, why, final)
            case core.Quarantine(wid, why):
                p.spawn(self.quarantine(wid, why))
            case core.ArmLane(index, departure):
                expired = SB.LaneExpired(index, departure)
                asyncio.get_running_loop().call_later(p.settings.lane_wait_s, lambda: self.handle(expired))
            case core.SendBatch(step_ids):
                self.steps.send_batch(step_ids)
            case _:
                assert_never(command)
