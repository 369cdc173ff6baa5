"""Timeouts and cancellation that never lose a cancellation.

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result (or raises its error)
when a cancellation of the caller arrives just as the awaited thing finishes: the
cancellation is swallowed, and a task told to stop goes on. A loop that retries on errors
(a status poll, a health probe) then never ends, and whoever waits for it hangs.
:func:`within` bounds an await without that race, and :func:`cancel_and_wait` stops a task
even if some library inside it swallows one cancellation.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Awaitable, TypeVar

T = TypeVar("T")

__all__ = ["cancel_and_wait", "within"]

RECANCEL_S = 1.0
"""How long :func:`cancel_and_wait` waits before cancelling again."""


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``await awaitable`` for at most ``seconds`` (None: no bound); ``asyncio.TimeoutError``
    when the time runs out (the awaitable is cancelled, as ``asyncio.wait_for`` does).

    A cancellation of the caller always propagates, however close it comes to the
    awaitable finishing (``asyncio.timeout`` on Python 3.11+; on 3.10 a timer that cancels
    the caller and turns its own cancellation into the timeout).
    """
    if seconds is None:
        return await awaitable
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    task = asyncio.current_task()
    assert task is not None, "within() runs inside a task"
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(max(0.0, seconds), expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if expired:
            raise asyncio.TimeoutError(f"no result within {seconds} s") from None
        raise
    finally:
        timer.cancel()


async def cancel_and_wait(task: asyncio.Future, recancel_s: float | None = None) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again every ``recancel_s``
    seconds (default :data:`RECANCEL_S`) should something inside it have swallowed the
    cancellation. Its outcome (cancelled, a result or an error) is consumed, not raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S if recancel_s is None else recancel_s)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
