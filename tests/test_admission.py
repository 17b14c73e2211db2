"""Admission control as plain asyncio: a bounded queue, 429 with Retry-After beyond it."""

from __future__ import annotations

import asyncio

import pytest

from edgepipe.api.admission import Admission
from edgepipe.api.errors import APIError


def test_queue_then_429_and_fifo_handover():
    async def scenario():
        adm = Admission(max_active=2, max_queue=1)
        a, b = await adm.admit(), await adm.admit()
        waiter = asyncio.create_task(adm.admit())
        await asyncio.sleep(0)
        assert adm.queued == 1 and not waiter.done()
        with pytest.raises(APIError) as refused:
            await adm.admit()
        assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
        adm.release(a)
        await asyncio.wait_for(waiter, 1)  # the slot passed to the one in line
        assert adm.active == 2 and adm.queued == 0
        adm.release(b)
        adm.release(waiter.result())
        adm.release(None)  # an unknown ticket changes nothing
        assert adm.active == 0

    asyncio.run(scenario())


def test_kv_capacity_admits_by_positions_and_one_request_always_runs():
    async def scenario():
        adm = Admission(max_active=16, max_queue=4, capacity=lambda: 1000)
        first = await adm.admit(300)
        second = await adm.admit(300)  # 2 x 300 fits
        assert adm.active == 2 and adm.limit == 3
        waiter = asyncio.create_task(adm.admit(400))  # 3 x 400 would not
        await asyncio.sleep(0)
        assert adm.queued == 1 and not waiter.done()
        adm.release(first)
        await asyncio.wait_for(waiter, 1)  # 2 x 400 fits now
        adm.release(second)
        adm.release(waiter.result())
        huge = await adm.admit(5000)  # more than the budget holds: it runs, alone
        assert adm.active == 1
        late = asyncio.create_task(adm.admit(10))
        await asyncio.sleep(0)
        assert not late.done()
        adm.release(huge)
        await asyncio.wait_for(late, 1)
        adm.capacity = lambda: None
        assert adm.limit == 16

    asyncio.run(scenario())


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        adm = Admission(max_active=1, max_queue=2)
        await adm.admit()
        waiter = asyncio.create_task(adm.admit())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert adm.queued == 0

    asyncio.run(scenario())
