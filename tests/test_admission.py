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
        adm.release(None)
        assert adm.active == 0

    asyncio.run(scenario())


def test_capacity_from_kv_budgets_lowers_the_limit():
    adm = Admission(max_active=16, max_queue=4, capacity=lambda: 3)
    assert adm.limit == 3
    adm.capacity = lambda: None
    assert adm.limit == 16


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
