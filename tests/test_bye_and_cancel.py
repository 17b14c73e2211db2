"""A worker that shuts down says so (a final bye) and is dropped at once; a cancelled request lets go.

The coordinator runs in process over ``net.channel.memory_pair`` with a scripted worker end
(the simulation's fake package: no model); the worker side is the real ``Worker``, in process
and as a real ``edgepipe worker`` process stopped by SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgepipe.cluster.shells.coordinator import Coordinator, CoordinatorSettings
from edgepipe.cluster.simulation.sim import FakePackage
from edgepipe.net.channel import ChannelClosed, memory_pair
from edgepipe.net.messages import Bye, Token
from edgepipe.net.protocol import Message, MessageType as T, decode, encode

HELLO = {"name": "leaver", "token": None, "protocol": 1, "kind": "native", "memory_bytes": 1 << 30, "threads": 1,
         "data_url": "ws://127.0.0.1:9/", "held": []}


async def joined_worker(coord: Coordinator):
    """A scripted worker end that joined ``coord``: (its channel, its id)."""
    mine, theirs = memory_pair("worker", "coordinator")
    coord.spawn(coord.attach(theirs))
    await mine.send(encode(Message(T.HELLO, HELLO)))
    welcome = decode(await asyncio.wait_for(mine.recv(), 5))
    assert welcome.type is T.WELCOME
    return mine, welcome["worker_id"]


async def gone_within(coord: Coordinator, wid: str, seconds: float) -> bool:
    for _ in range(int(seconds / 0.01)):
        if wid not in coord.links and wid not in coord.cluster.workers:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.parametrize("final", [True, False])
def test_a_bye_drops_the_worker_at_once_and_a_final_one_is_no_failure(final):
    async def main():
        # Timeouts far beyond the test: only the bye can take the worker out.
        coord = Coordinator(FakePackage(), CoordinatorSettings(min_workers=5, calibrate=False, dead_after_s=60, lose_after_s=600))
        await coord.start()
        try:
            mine, wid = await joined_worker(coord)
            assert wid in coord.cluster.workers
            await asyncio.sleep(0.1)
            assert wid in coord.cluster.workers  # silence alone does not drop it this soon
            await mine.send(encode(Bye(final=True if final else None).to_message()))
            assert await gone_within(coord, wid, 1.0), "the bye did not drop the worker"
            leave = [e for e in coord.events if e["kind"] == "leave" and e["worker"] == wid]
            assert [e["why"] for e in leave] == ["shut down (final bye)" if final else "said bye"]
            assert coord.profile.lives["leaver"].failures == (0 if final else 1)
            with pytest.raises(ChannelClosed):  # the coordinator closed its end
                while True:
                    await asyncio.wait_for(mine.recv(), 1.0)
        finally:
            await coord.stop()

    asyncio.run(main())


def test_a_worker_stopped_in_process_says_a_final_bye(tmp_path):
    from edgepipe.worker import Worker, WorkerSettings

    async def main():
        coordinator_end, worker_end = memory_pair("coordinator", "worker")
        worker = Worker(WorkerSettings(coordinator="http://127.0.0.1:9", name="stopping", cache_dir=tmp_path / "cache"))
        task = asyncio.create_task(worker.run(control=worker_end))
        hello = decode(await asyncio.wait_for(coordinator_end.recv(), 10))
        assert hello.type is T.HELLO
        await coordinator_end.send(encode(Message(T.WELCOME, {"worker_id": "w1-stopping"})))
        await asyncio.sleep(0.2)
        task.cancel()
        bye = decode(await asyncio.wait_for(coordinator_end.recv(), 5))
        assert bye.type is T.BYE and bye.fields == {"final": True}
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_worker_process_stopped_by_sigterm_says_a_final_bye(tmp_path):
    import websockets

    async def main():
        got: asyncio.Queue = asyncio.Queue()

        async def coordinator(ws):
            hello = decode(await ws.recv())
            await got.put(hello)
            await ws.send(encode(Message(T.WELCOME, {"worker_id": "w1-sigterm"})))
            try:
                while True:
                    msg = decode(await ws.recv())
                    if msg.type is not T.PONG:
                        await got.put(msg)
            except websockets.exceptions.ConnectionClosed:
                await got.put(None)

        async with websockets.serve(coordinator, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            env = {**os.environ, "EDGEPIPE_HOME": str(tmp_path)}
            proc = subprocess.Popen([sys.executable, "-m", "edgepipe", "worker", "--coordinator", f"http://127.0.0.1:{port}",
                                     "--name", "sigterm", "--memory", "1GB"], env=env, cwd=Path(__file__).parents[1],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                hello = await asyncio.wait_for(got.get(), 60)
                assert hello.type is T.HELLO and hello["name"] == "sigterm"
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                bye = await asyncio.wait_for(got.get(), 10)
                assert bye is not None and bye.type is T.BYE and bye.get("final") is True
                assert await asyncio.wait_for(got.get(), 10) is None  # then it closes
                assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    asyncio.run(main())


def test_a_request_cancelled_as_its_token_arrives_stops_and_frees_its_kv():
    """Python 3.11's ``asyncio.wait_for`` returns the result when the cancellation and the result
    arrive in the same instant, losing the cancel: the request would run on, holding its slot.
    The token loop must stop anyway, end the request (its reservation) and drop the sequence's KV
    on the workers, although its first step's token had already been taken."""
    from edgepipe.cluster.state.placement import Deployment, StageAssignment
    from edgepipe.runtime.sequence import GenerationParams

    async def main():
        coord = Coordinator(FakePackage(), CoordinatorSettings(min_workers=5, calibrate=False, dead_after_s=60, lose_after_s=600))
        try:
            mine, wid = await joined_worker(coord)
            dep = Deployment(1, (StageAssignment(wid, 0, 8),))

            coord.requests.usable_plan = lambda: dep  # the plan is Up (no planning in this test)
            state = coord.requests.new_sequence([1, 2, 3], GenerationParams(max_tokens=5), lambda ids: "x" * len(ids))
            deltas = []

            async def client():
                async for delta in coord.requests.stream(state, "r1"):
                    deltas.append(delta)

            task = asyncio.create_task(client())
            first = decode(await asyncio.wait_for(mine.recv(), 5))
            assert first.type is T.FORWARD and [b["seq"] for b in first["batch"]] == ["r1.0"]
            assert "r1" in coord.cluster.requests
            coord.steps.tokens(wid, Token(1, first["batch"], [7], []))  # the token arrives ...
            task.cancel()  # ... in the same instant as the client goes
            done, _ = await asyncio.wait({task}, timeout=2)
            assert done and task.cancelled(), "the request ran on after its cancellation"
            assert deltas == []
            assert "r1" not in coord.cluster.requests and not coord.cluster.steps.inflight and coord.steps.waiters == {}
            after = decode(await asyncio.wait_for(mine.recv(), 2))
            assert after.type is T.DROP and after["seq"] == "r1.0", f"{after.type.value} {after.fields}"
        finally:
            await coord.stop()

    asyncio.run(main())
