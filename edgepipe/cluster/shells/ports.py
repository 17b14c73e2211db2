"""What the coordinator lends a collaborator instead of itself.

The deployer, the calibrator, the link prober, the connections, the requests, the KV migration,
the prefix cache, the KV checkpoints and the drafter workers are given a ``Ports``: read the state, change it (``emit``), add a
measurement (``measure``), note a dashboard line (``note``), read the clock, start a background
task, send a frame to a worker or ask it and await the reply (``ask``), and wake the re-planner. They reach no other collaborator through it: what one needs of another
(the calibrator's timing, the requests' capacity check) is passed to it by name.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Mapping

from ...net.protocol import Message
from ..state.events import Event
from ..state.measurements import Measurement
from ..state.settings import CoordinatorSettings
from ..state.state import ClusterState
from .views import Link


@dataclass(frozen=True)
class Ports:
    state: Callable[[], ClusterState]  # the cluster state now
    emit: Callable[[Event], ClusterState]  # the one way the state changes
    measure: Callable[[Measurement], None]  # the one way the profile changes
    note: Callable[..., None]  # note(kind, **fields): a dashboard line that changes no state (kind: a ``NoteKind``)
    clock: Callable[[], float]
    spawn: Callable[[Coroutine], asyncio.Task]  # a background task the coordinator keeps (and cancels when it stops)
    links: Callable[[], Mapping[str, Link]]  # the workers' channels and the replies they owe
    replan_wanted: asyncio.Event  # set: the re-planner looks again
    settings: CoordinatorSettings  # read only
    package: Any  # the model package (its manifest: ``package.manifest``)
    profile: Any  # profiling.ClusterProfile: read here, changed only through ``measure``
    # adopt(state, events): the state ``core.handle`` returned from the state now, with the events it
    # applied, logged as ``emit`` logs them and not applied again (None: each event through ``emit``)
    adopt: Callable[[ClusterState, tuple], None] | None = None

    def carry(self, state: ClusterState, events: tuple) -> None:
        """Take the events of a ``core.handle`` whose result is ``state`` (computed from the state now)."""
        if self.adopt is not None:
            self.adopt(state, events)
        else:
            for event in events:
                self.emit(event)

    async def send(self, worker_id: str, message: Message) -> None:
        """A frame on the worker's control channel (``KeyError``: it is not connected)."""
        await self.links()[worker_id].send(message)

    async def load(self, worker_id: str, msg):
        """Send a LOAD and await the worker's LOADED (``load_timeout_s``; a worker not connected:
        ``PipelineBroken``, as for one lost meanwhile)."""
        if worker_id not in self.links():
            from .steps import PipelineBroken

            raise PipelineBroken(f"worker {worker_id} left before deployment")
        return await self.ask(worker_id, "loads", msg.plan, msg.to_message(), self.settings.load_timeout_s)

    async def ask(self, worker_id: str, table: str, key: int, message: Message, timeout_s: float):
        """Send ``message`` and await the reply the worker owes under ``key`` in its link's
        ``table`` (``loads`` by plan, ``probes`` by probe number); a lost worker's owed replies
        fail with ``PipelineBroken`` (``Coordinator.lose``)."""
        link = self.links()[worker_id]
        owed = getattr(link, table)
        fut = owed[key] = asyncio.get_running_loop().create_future()
        try:
            await link.send(message)
            return await asyncio.wait_for(fut, timeout=timeout_s)
        finally:
            owed.pop(key, None)
