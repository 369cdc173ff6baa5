"""A task that swallows one cancellation, as ``asyncio.wait_for`` before Python 3.12 does when
a cancellation lands just as its call finishes: for tests of code that must stop such tasks
(:func:`atroposlib.utils.aio.cancel_and_wait`)."""

from __future__ import annotations

import asyncio
from typing import List


async def swallow_one_cancellation(turns: List[int]) -> None:
    """Loop until cancelled twice (the first cancellation is swallowed); each turn appends to
    ``turns``, so a test can see the loop went on after the first one."""
    swallowed = False
    while True:
        try:
            turns.append(1)
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed = True
