"""Delivery of scored groups to the rollout API without losing any (D7, D10).

- 200: delivered.
- 503/429: the API is full; wait ``Retry-After`` and re-send the same group, for
  up to ``busy_wait_s`` seconds in the worker, then hand it to the outbox.
- Connection errors and other 5xx: retried with random exponential backoff;
  still failing → outbox.
- Other 4xx: the API refuses this data; logged with the reason and counted.

The outbox is drained in order by one background task; while it holds anything,
new groups queue behind it so the API sees groups in the order they were made.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any, Optional

from atroposlib.envs.api_client import PostResult, RolloutAPIClient
from atroposlib.envs.outbox import Outbox

logger = logging.getLogger(__name__)


def _backoff(attempt: int, cap: float = 10.0) -> float:
    return random.uniform(0, min(cap, 0.5 * 2**attempt))


class GroupSender:
    """Sends scored-data payloads, falling back to a durable outbox.

    ``rejected`` counts refused payloads per reason (``http_422`` ...);
    ``delivered`` and ``outboxed`` count payloads.
    """

    def __init__(
        self,
        client: RolloutAPIClient,
        outbox: Outbox,
        *,
        attempts: int = 3,
        busy_wait_s: float = 60.0,
    ) -> None:
        self.client = client
        self.outbox = outbox
        self.attempts = attempts
        self.busy_wait_s = busy_wait_s
        self.rejected: Counter[str] = Counter()
        self.delivered = 0
        self.outboxed = 0
        self._wake = asyncio.Event()
        self._flusher: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Start the background task that drains the outbox."""
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="atropos-outbox-flusher")
            if len(self.outbox):
                self._wake.set()

    async def send(self, payload: Any) -> bool:
        """Deliver ``payload``; False when it was rejected or parked in the outbox."""
        if len(self.outbox):
            self._park(payload, "outbox not empty")
            return False
        result = await self._deliver(payload, self.busy_wait_s)
        if result.ok:
            self.delivered += 1
            return True
        if result.rejected:
            self._reject(result)
            return False
        self._park(payload, f"status {result.status} {result.detail[:200]}")
        return False

    async def _deliver(self, payload: Any, busy_wait_s: float) -> PostResult:
        failures = 0
        deadline = time.monotonic() + busy_wait_s
        while True:
            result = await self.client.post_scored(payload)
            if result.ok or result.rejected:
                return result
            if result.status in (429, 503):
                if time.monotonic() >= deadline:
                    return result
                wait = result.retry_after if result.retry_after is not None else 1.0
                logger.info("rollout API busy (%s); re-sending in %.2fs", result.status, wait)
                await asyncio.sleep(min(max(wait, 0.05), max(0.0, deadline - time.monotonic())))
                continue
            failures += 1
            if failures >= self.attempts:
                return result
            await asyncio.sleep(_backoff(failures))

    def _reject(self, result: PostResult) -> None:
        reason = f"http_{result.status}"
        self.rejected[reason] += 1
        logger.warning("rollout API rejected a group (%s): %s", reason, result.detail)

    def _park(self, payload: Any, why: str) -> None:
        key = self.outbox.put(payload)
        self.outboxed += 1
        logger.warning("group parked in outbox %s/%s (%s)", self.outbox.directory, key, why)
        self._wake.set()

    async def _flush_loop(self) -> None:
        failures = 0
        while True:
            if not len(self.outbox):
                self._wake.clear()
                await self._wake.wait()
                continue
            head = self.outbox.peek()
            if head is None:
                continue
            key, payload = head
            result = await self._deliver(payload, busy_wait_s=5.0)
            if result.ok:
                self.outbox.remove(key)
                self.delivered += 1
                failures = 0
            elif result.rejected:
                self.outbox.remove(key)
                self._reject(result)
            else:
                failures += 1
                await asyncio.sleep(_backoff(failures, cap=5.0))

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Try to drain the outbox for up to ``drain_timeout_s``, then stop the flusher.

        Anything still undelivered stays on disk and is reported in the log.
        """
        deadline = time.monotonic() + drain_timeout_s
        while len(self.outbox) and time.monotonic() < deadline and self._flusher is not None:
            await asyncio.sleep(0.1)
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
            self._flusher = None
        if len(self.outbox):
            logger.error(
                "%d groups could not be delivered; they are kept in %s",
                len(self.outbox),
                self.outbox.directory,
            )
