"""``within`` and ``cancel_and_wait``: bounded awaits and stopping tasks without ever losing a
cancellation (``asyncio.wait_for`` before Python 3.12 can swallow one)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from atroposlib.testing.aio import swallow_one_cancellation
from atroposlib.utils.aio import cancel_and_wait, within


async def test_within_gives_the_result_in_time():
    assert await within(asyncio.sleep(0, result=7), 5) == 7
    assert await within(asyncio.sleep(0, result=8), None) == 8


async def test_within_raises_timeout_and_cancels_what_it_awaited():
    inner_cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    with pytest.raises(asyncio.TimeoutError):
        await within(slow(), 0.01)
    assert inner_cancelled.is_set()


async def _cancelled_as_it_finishes(bound: Callable[[Awaitable[int], float], Awaitable[int]]):
    """Cancel a task in the same loop turn as the future it awaits gets its result; what
    the task's await gave: the result (the cancellation swallowed) or CancelledError."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()

    async def waiter() -> int:
        return await bound(fut, 10)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task now waits on fut
    fut.set_result(1)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_a_cancellation_arriving_as_the_awaited_thing_finishes_is_never_swallowed():
    assert await _cancelled_as_it_finishes(within) == "cancelled"


async def test_cancel_and_wait_ends_a_task_that_swallows_a_cancellation():
    ticks: list[int] = []
    task = asyncio.create_task(swallow_one_cancellation(ticks))
    await asyncio.sleep(0.005)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.01), 30)  # hang guard only
    assert task.cancelled() and len(ticks) > 1


async def test_cancel_and_wait_consumes_an_error_and_accepts_a_finished_task():
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert isinstance(task.exception(), RuntimeError)
    await cancel_and_wait(task)  # already done: returns at once
