"""``AsyncSemWithAdaptiveWeight``: the slot semaphore of a server, whose usable capacity the
environment's weight scales."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Callable


class AsyncSemWithAdaptiveWeight:
    """An asyncio semaphore whose usable capacity is about ``max_val * weight``.

    ``acquire`` blocks while ``_value <= min_val()`` where ``min_val() = max_val *
    (1 - weight)``; one request is always allowed when nothing is in flight, so a
    weight near zero throttles but never deadlocks. Waiters are served FIFO.
    ``add_listener`` registers a callback run after every release (the
    ``ServerManager`` uses it to hand out freed slots without polling).
    """

    def __init__(self, value: int = 1):
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self.max_val = value
        self._value = value
        self.weight = 1.0
        self._min = 0.0  # cached min_val(), recomputed when the weight changes
        self._waiters: deque[asyncio.Future[bool]] = deque()
        self._listeners: list[Callable[[], None]] = []

    def min_val(self) -> float:
        """The value below which ``acquire`` blocks."""
        return self._min

    def in_use(self) -> int:
        """Slots currently held."""
        return self.max_val - self._value

    def _can_acquire(self) -> bool:
        value = self._value
        return value > self._min or (value >= self.max_val > 0)

    def available(self) -> float:
        """Free capacity right now (0 when callers are queued); hot path of the router."""
        if self._waiters:
            return 0.0
        value = self._value
        free = value - self._min
        if free > 0:
            return free
        return 1.0 if value >= self.max_val > 0 else 0.0

    def free_slots(self) -> int:
        """Slots that could be acquired right now without waiting."""
        return math.ceil(self.available())

    def locked(self) -> bool:
        """True when ``acquire`` would block."""
        return not self._can_acquire() or bool(self._waiters)

    def try_acquire(self) -> bool:
        """Take a slot if one is free now (no waiting); return whether it did."""
        if self._waiters or not self._can_acquire():
            return False
        self._value -= 1
        return True

    async def acquire(self) -> bool:
        """Wait for a slot and take it."""
        if self.try_acquire():
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was granted just before the cancellation
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise
        return True

    def release(self) -> None:
        """Give a slot back and wake the next waiter(s) that fit."""
        if self._value >= self.max_val:
            raise ValueError("AsyncSemWithAdaptiveWeight released more times than acquired")
        self._value += 1
        if self._waiters:
            self._wake()
        for listener in self._listeners:
            listener()

    def _wake(self) -> None:
        while self._waiters and self._can_acquire():
            fut = self._waiters.popleft()
            if fut.done():
                continue
            self._value -= 1
            fut.set_result(True)

    def update_weight(self, weight: float) -> None:
        """Set the share of ``max_val`` that may be in use (``weight`` >= 0)."""
        self.weight = max(float(weight), 0.0)
        self._min = self.max_val * (1.0 - self.weight)
        self._wake()
        for listener in self._listeners:
            listener()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever slots may have become free."""
        self._listeners.append(callback)

    async def __aenter__(self) -> AsyncSemWithAdaptiveWeight:
        await self.acquire()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
