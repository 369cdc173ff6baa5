"""Delivery of scored groups to the rollout API without losing any (docs/design.md, "Delivery guarantee").

Workers hand their groups to :meth:`GroupSender.send` and wait for the outcome.
One pump task posts them in arrival order; groups that arrive while a POST is in
flight are coalesced into the next ``/scored_data_list`` request, so a busy
environment makes few requests and the API sees groups in the order they were made.

- 200: delivered.
- 503/429: the API is full; wait ``Retry-After`` and re-send the same groups, for
  up to ``busy_wait_s`` seconds, then hand them to the outbox.
- Connection errors and other 5xx: retried with random exponential backoff;
  still failing → outbox.
- Other 4xx: the API refuses the data. A coalesced request is split and re-sent
  group by group so only the offending group is refused; it is logged with the
  reason and counted.

The outbox is drained in order by a second task; while it holds anything, new
groups queue behind it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Tuple

from atroposlib.envs.api_client import PostResult, RolloutAPIClient
from atroposlib.envs.outbox import Outbox
from atroposlib.utils.aio import cancel_and_wait

logger = logging.getLogger(__name__)

MAX_GROUPS_PER_POST = 64
MAX_TOKENS_PER_POST = 2_000_000


def _backoff(attempt: int, cap: float = 10.0) -> float:
    return random.uniform(0, min(cap, 0.5 * 2**attempt))


def _token_count(group: Any) -> int:
    try:
        return sum(map(len, group.get("tokens") or []))
    except (AttributeError, TypeError):
        return 0


@dataclass
class _Pending:
    """Groups of one ``send`` call and the future its caller waits on."""

    groups: List[Any]
    done: asyncio.Future = field(repr=False)


class GroupSender:
    """Sends scored-data payloads, coalescing them, with a durable outbox as fallback.

    ``rejected`` counts refused groups per reason (``http_422`` ...);
    ``delivered``, ``outboxed`` and ``posts`` count groups, groups and requests;
    ``degraded`` is True while the API is failing or full (the serve loop then
    starts no new work).
    """

    def __init__(
        self,
        client: RolloutAPIClient,
        outbox: Outbox,
        *,
        attempts: int = 3,
        busy_wait_s: float = 60.0,
        max_groups_per_post: int = MAX_GROUPS_PER_POST,
    ) -> None:
        self.client = client
        self.outbox = outbox
        self.attempts = attempts
        self.busy_wait_s = busy_wait_s
        self.max_groups_per_post = max_groups_per_post
        # Workers block on their own delivery only past this many waiting groups. It
        # must cover several POST round trips' worth of groups: a lower mark makes
        # workers wait on the API at every POST at high rates, which idles their slots.
        self.high_water = max(4, 4 * max_groups_per_post)
        self.degraded = False
        self.rejected: Counter[str] = Counter()
        self.delivered = 0
        self.outboxed = 0
        self.posts = 0
        self._queue: Deque[_Pending] = deque()
        self._queued_groups = 0  # groups in _queue, kept so send() need not sum the queue
        self._in_flight = 0
        self._queued = asyncio.Event()
        self._wake_flusher = asyncio.Event()
        self._pump: asyncio.Task | None = None
        self._flusher: asyncio.Task | None = None

    def start(self) -> None:
        """Start the pump and the task that drains the outbox."""
        if self._pump is None:
            self._pump = asyncio.create_task(self._pump_loop(), name="atropos-sender")
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop(), name="atropos-outbox-flusher")
            if len(self.outbox):
                self._wake_flusher.set()

    def tasks(self) -> List[Tuple[asyncio.Task, str]]:
        """The running background tasks with their names (``sender``, ``outbox-flusher``)."""
        named = ((self._pump, "sender"), (self._flusher, "outbox-flusher"))
        return [(task, what) for task, what in named if task is not None]

    async def send(self, payload: Any, wait: bool = True) -> bool | None:
        """Hand ``payload`` (a group or a list of groups) over for delivery.

        With ``wait`` (the default) it returns True when the API acknowledged all of
        it, False when some was refused or parked in the outbox (re-sent later).
        With ``wait=False`` it returns None as soon as the groups are queued, unless
        ``high_water`` groups are already waiting or the API is failing: then it waits
        for its own delivery, which is the backpressure a busy API exerts on workers.
        Either way the sender owns the groups from here on.
        """
        groups = list(payload) if isinstance(payload, list) else [payload]
        if not groups:
            return True
        self.start()
        backlog = self._queued_groups
        pending = _Pending(groups, asyncio.get_running_loop().create_future())
        self._queue.append(pending)
        self._queued_groups += len(groups)
        self._queued.set()
        if not wait and backlog < self.high_water and not self.degraded:
            return None
        return await asyncio.shield(pending.done)

    # ------------------------------------------------------------- pump

    def _take_batch(self) -> List[_Pending]:
        batch: List[_Pending] = []
        n_groups = tokens = 0
        while self._queue:
            nxt = self._queue[0]
            size = sum(_token_count(g) for g in nxt.groups)
            if batch and (
                n_groups + len(nxt.groups) > self.max_groups_per_post
                or tokens + size > MAX_TOKENS_PER_POST
            ):
                break
            batch.append(self._queue.popleft())
            self._queued_groups -= len(nxt.groups)
            n_groups += len(nxt.groups)
            tokens += size
        return batch

    async def _pump_loop(self) -> None:
        while True:
            if not self._queue:
                self._queued.clear()
                await self._queued.wait()
                continue
            batch = self._take_batch()
            self._in_flight = len(batch)
            try:
                await self._send_batch(batch)
                self._in_flight = 0
            except asyncio.CancelledError:
                self._in_flight = 0
                for pending in batch:
                    self._park(pending.groups, "sender stopped")
                    _resolve(pending, False)
                raise

    async def _send_batch(self, batch: List[_Pending]) -> None:
        if len(self.outbox):
            for pending in batch:
                self._park(pending.groups, "outbox not empty")
                _resolve(pending, False)
            return
        groups = [g for pending in batch for g in pending.groups]
        # A list the API refuses as too big for its free space may never fit while
        # less than a batch is queued, so several groups get no busy wait: on 503
        # they are split and sent one by one (each with the full busy wait).
        result = await self._deliver(
            _as_payload(groups), self.busy_wait_s if len(groups) == 1 else 0.0
        )
        if result.ok:
            self.delivered += len(groups)
            for pending in batch:
                _resolve(pending, True)
            return
        if len(groups) > 1 and (result.rejected or result.status in (429, 503)):
            for pending in batch:  # one by one: find the offending group(s), fit the space left
                ok = True
                for group in pending.groups:
                    ok = await self._send_one(group) and ok
                _resolve(pending, ok)
            return
        for pending in batch:
            if result.rejected:
                self._reject(result, len(pending.groups))
            else:
                self._park(pending.groups, f"status {result.status} {result.detail[:200]}")
            _resolve(pending, False)

    async def _send_one(self, group: Any) -> bool:
        if len(self.outbox):
            self._park([group], "outbox not empty")
            return False
        result = await self._deliver(group, self.busy_wait_s)
        if result.ok:
            self.delivered += 1
            return True
        if result.rejected:
            self._reject(result, 1)
        else:
            self._park([group], f"status {result.status} {result.detail[:200]}")
        return False

    async def _deliver(self, payload: Any, busy_wait_s: float) -> PostResult:
        failures = 0
        deadline = time.monotonic() + busy_wait_s
        while True:
            self.posts += 1
            result = await self.client.post_scored(payload)
            self.degraded = not (result.ok or result.rejected)
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

    def _reject(self, result: PostResult, n_groups: int) -> None:
        reason = f"http_{result.status}"
        self.rejected[reason] += n_groups
        logger.warning("rollout API rejected %d group(s) (%s): %s", n_groups, reason, result.detail)

    def _park(self, groups: List[Any], why: str) -> None:
        key = self.outbox.put(_as_payload(groups))
        self.outboxed += len(groups)
        logger.warning(
            "%d group(s) parked in outbox %s/%s (%s)", len(groups), self.outbox.directory, key, why
        )
        self._wake_flusher.set()

    # ----------------------------------------------------------- outbox

    async def _flush_loop(self) -> None:
        failures = 0
        while True:
            if not len(self.outbox):
                self._wake_flusher.clear()
                await self._wake_flusher.wait()
                continue
            head = self.outbox.peek()
            if head is None:
                continue
            key, payload = head
            n_groups = len(payload) if isinstance(payload, list) else 1
            result = await self._deliver(payload, busy_wait_s=5.0 if n_groups == 1 else 0.0)
            if result.ok:
                self.outbox.remove(key)
                self.delivered += n_groups
                failures = 0
            elif n_groups > 1 and (result.rejected or result.status in (429, 503)):
                self.outbox.split(key, list(payload))  # one entry per group, same place in line
            elif result.rejected:
                self.outbox.remove(key)
                self._reject(result, n_groups)
            else:
                failures += 1
                await asyncio.sleep(_backoff(failures, cap=5.0))

    @property
    def idle(self) -> bool:
        """True when nothing waits to be posted and the outbox is empty."""
        return not self._queue and not self._in_flight and not len(self.outbox)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Try to deliver everything for up to ``drain_timeout_s``, then stop the tasks.

        Anything still undelivered stays on disk and is reported in the log. (A POST
        cut off by the timeout is kept too, although the API may have taken it.)
        """
        deadline = time.monotonic() + drain_timeout_s
        while (
            not self.idle
            and time.monotonic() < deadline
            and self._pump is not None
            and not self._pump.done()  # a pump that died delivers nothing more
        ):
            await asyncio.sleep(0.05)
        for task in (self._pump, self._flusher):
            if task is not None:
                await cancel_and_wait(task)
        self._pump = self._flusher = None
        while self._queue:
            pending = self._queue.popleft()
            self._queued_groups -= len(pending.groups)
            self._park(pending.groups, "sender stopped")
            _resolve(pending, False)
        if len(self.outbox):
            logger.error(
                "%d entries could not be delivered; they are kept in %s",
                len(self.outbox),
                self.outbox.directory,
            )


def _as_payload(groups: List[Any]) -> Any:
    return groups[0] if len(groups) == 1 else groups


def _resolve(pending: _Pending, value: bool) -> None:
    if not pending.done.done():
        pending.done.set_result(value)
