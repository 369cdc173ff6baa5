"""``ServerRouter``: how a ``ServerManager`` places each request on its pool of servers.

Every request goes to the healthy server with the most free slots (ties to the lowest
index); the slot is taken atomically with the choice, and callers that find none wait in
a FIFO queue served whenever a slot is released or a server's health changes. A failed
attempt is classified (retry elsewhere, or raise) and retried up to the servers'
``timeout``, then ``NoHealthyServerError`` names the servers. A request of a session goes
to the server the session is pinned to while that one is healthy.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from typing import Any, Sequence

from atroposlib.envs.server_handling.errors import (
    NoHealthyServerError,
    ServerUnavailableError,
    is_client_error,
)
from atroposlib.envs.server_handling.server_baseline import APIServer, ServerBaseline
from atroposlib.envs.server_handling.session_affinity import CURRENT_SESSION, MAX_PINNED_SESSIONS

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = ServerBaseline.model_fields["timeout"].default
_NO_EXCLUDE: frozenset[int] = frozenset()


class ServerRouter:
    """Slot routing, waiting and failover over ``self.servers`` (the base of
    ``ServerManager``, which builds the servers and offers the public calls)."""

    servers: list[APIServer]

    sweep_interval: float = 0.1
    """Seconds between checks for callers whose wait deadline passed."""

    _sweeper: asyncio.Task[None] | None = None
    _timeout_cache: float | None = None
    _health_loop: asyncio.AbstractEventLoop | None = None

    def _init_routing(self) -> None:
        """Create the wait queues and subscribe to the servers' slot and health changes."""
        self._waiters: dict[bool, deque[tuple[asyncio.Future[int], frozenset[int], float]]] = {
            True: deque(),
            False: deque(),
        }
        self._affinity: dict[str, int] = {}  # session id -> index of its server
        for server in self.servers:
            for sem in (getattr(server, "sem", None), getattr(server, "eval_sem", None)):
                add_listener = getattr(sem, "add_listener", None)
                if add_listener is not None:
                    add_listener(self._dispatch)
            add_health_listener = getattr(server, "add_health_listener", None)
            if add_health_listener is not None:
                add_health_listener(self._dispatch)

    # ----------------------------------------------------------------- slot routing
    @staticmethod
    def _free_slots(server: APIServer, is_train: bool) -> float:
        if not is_train:
            return server.eval_sem.available()
        free = server.sem.available()
        eval_sem = server.eval_sem
        if eval_sem._value < eval_sem.max_val:  # eval in progress: leave its share
            free -= eval_sem.available()
        return free

    def _pick(self, is_train: bool, exclude: frozenset[int] = frozenset()) -> int | None:
        best, best_slots = None, 0.0
        free_slots = self._free_slots
        for i, server in enumerate(self.servers):
            if not server._server_healthy or (exclude and i in exclude):
                continue
            slots = free_slots(server, is_train)
            if slots > best_slots:
                best, best_slots = i, slots
        return best

    def _take(self, idx: int, is_train: bool) -> bool:
        server = self.servers[idx]
        return (server.sem if is_train else server.eval_sem).try_acquire()

    def _release(self, idx: int, is_train: bool) -> None:
        server = self.servers[idx]
        (server.sem if is_train else server.eval_sem).release()

    def _dispatch(self) -> None:
        """Hand free slots to queued callers, FIFO, eval first."""
        waiters = self._waiters
        if not (waiters[True] or waiters[False]):
            return
        for is_train in (False, True):
            queue = self._waiters[is_train]
            while queue:
                fut, exclude, _ = queue[0]
                if fut.done():
                    queue.popleft()
                    continue
                idx = self._pick(is_train, exclude)
                if idx is None or not self._take(idx, is_train):
                    break
                queue.popleft()
                fut.set_result(idx)

    def _start_health_checks(self) -> None:
        loop = asyncio.get_running_loop()
        if self._health_loop is loop:
            return
        self._health_loop = loop
        for server in self.servers:
            server.start_health_check()

    async def _acquire_slot(self, is_train: bool, exclude: frozenset[int], timeout: float) -> int:
        """Take a slot on the best server, waiting FIFO up to ``timeout`` seconds.

        Waiters carry their deadline and one sweeper task expires them, so waiting
        costs no timer per request.
        """
        queue = self._waiters[is_train]
        if not queue:
            idx = self._pick(is_train, exclude)
            if idx is not None and self._take(idx, is_train):
                return idx
        if timeout <= 0:
            raise asyncio.TimeoutError()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        entry = (fut, exclude, loop.time() + timeout)
        queue.append(entry)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep_expired(), context=contextvars.Context())
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), is_train)  # granted just before we were cancelled
            try:
                queue.remove(entry)
            except ValueError:
                pass
            raise

    async def _sweep_expired(self) -> None:
        """Fail waiters whose deadline passed (runs while anyone waits)."""
        loop = asyncio.get_running_loop()
        while any(self._waiters.values()):
            await asyncio.sleep(self.sweep_interval)
            now = loop.time()
            for queue in self._waiters.values():
                if not queue:
                    continue
                expired = [e for e in queue if e[2] <= now or e[0].done()]
                for entry in expired:
                    queue.remove(entry)
                    if not entry[0].done():
                        entry[0].set_exception(asyncio.TimeoutError())

    def _wait_timeout(self) -> float:
        if self._timeout_cache is None:
            self._timeout_cache = float(
                max(getattr(s.config, "timeout", DEFAULT_TIMEOUT) for s in self.servers)
            )
        return self._timeout_cache

    def _describe(self, tried: Sequence[int] = ()) -> list[str]:
        """Every server with its health, marking those this request tried."""
        out = []
        for i, server in enumerate(self.servers):
            state = "healthy" if server.server_healthy else "unhealthy"
            mark = f", tried {tried.count(i)}x" if i in tried else ", not tried"
            out.append(f"{server.name} ({state}{mark})")
        return out

    async def _call(self, kind: str, kwargs: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        if self._health_loop is not loop:
            self._start_health_checks()
        is_train = kwargs.get("split", "train") != "eval"
        started = loop.time()
        session = CURRENT_SESSION.get()
        if session is not None:
            return await self._call_session(kind, kwargs, is_train, started, session)
        # Fast path: a slot is free now and nobody is queued.
        first: tuple[int, BaseException] | None = None
        if not self._waiters[is_train]:
            idx = self._pick(is_train)
            if idx is not None and self._take(idx, is_train):
                try:
                    return await self.servers[idx].run_request(
                        kind, kwargs, slot_held=True, fail_fast=True
                    )
                except Exception as e:  # classified by _call_with_failover
                    first = (idx, e)
                finally:
                    self._release(idx, is_train)
        return await self._call_with_failover(kind, kwargs, is_train, started, first)

    async def _call_session(
        self, kind: str, kwargs: dict[str, Any], is_train: bool, started: float, session: str
    ) -> Any:
        """A request of ``session``: on its pinned server while that one is healthy (waiting
        for a slot there), else fail over and re-pin to the server that answers."""
        idx = self._affinity.get(session)
        first: tuple[int, BaseException] | None = None
        if idx is not None and idx < len(self.servers) and self.servers[idx]._server_healthy:
            held = self._take(idx, is_train)
            if not held:
                others = frozenset(i for i in range(len(self.servers)) if i != idx)
                try:
                    await self._acquire_slot(is_train, others, self._wait_timeout())
                    held = True
                except asyncio.TimeoutError:
                    pass  # its server stayed busy or went down: any server will do
            if held:
                try:
                    return await self.servers[idx].run_request(
                        kind, kwargs, slot_held=True, fail_fast=True
                    )
                except Exception as e:  # classified by _call_with_failover
                    first = (idx, e)
                finally:
                    self._release(idx, is_train)
        return await self._call_with_failover(kind, kwargs, is_train, started, first, session)

    def _pin(self, session: str, idx: int) -> None:
        affinity = self._affinity
        if affinity.get(session) == idx:
            return
        if session not in affinity and len(affinity) >= MAX_PINNED_SESSIONS:
            affinity.pop(next(iter(affinity)))  # the oldest pin
        affinity[session] = idx

    def _on_failure(self, idx: int, error: BaseException, exclude: set[int]) -> None:
        """Decide whether a failed attempt may be retried elsewhere; raise ``error`` if not."""
        server = self.servers[idx]
        if isinstance(error, ServerUnavailableError):
            if not server._health_enabled:
                exclude.add(idx)  # stays "healthy" without probes; do not retry it for this call
            logger.warning("request failed on %s, trying another server: %s", server.name, error)
            return
        if is_client_error(error) or isinstance(error, (NotImplementedError, KeyError, ValueError)):
            raise error
        exclude.add(idx)
        if not any(s.server_healthy and i not in exclude for i, s in enumerate(self.servers)):
            raise error
        logger.warning("request failed on %s, retrying on another server: %r", server.name, error)

    async def _call_with_failover(
        self,
        kind: str,
        kwargs: dict[str, Any],
        is_train: bool,
        started: float,
        first: tuple[int, BaseException] | None,
        session: str | None = None,
    ) -> Any:
        loop = asyncio.get_running_loop()
        deadline = started + self._wait_timeout()
        tried: list[int] = []
        exclude: set[int] = set()
        last_error: BaseException | None = None
        max_tries = 2 * len(self.servers) + 2
        if first is not None:
            tried.append(first[0])
            last_error = first[1]
            self._on_failure(first[0], first[1], exclude)
        while True:
            if len(tried) >= max_tries:
                raise NoHealthyServerError(
                    self._describe(tried), loop.time() - started, last_error
                ) from last_error
            try:
                # Past the deadline only servers not yet failed may be tried, without waiting.
                if tried and loop.time() >= deadline:
                    skip = frozenset(exclude | set(tried))
                else:
                    skip = frozenset(exclude) if exclude else _NO_EXCLUDE
                idx = await self._acquire_slot(is_train, skip, deadline - loop.time())
            except asyncio.TimeoutError:
                names = self._describe(tried)
                raise NoHealthyServerError(names, loop.time() - started, last_error) from last_error
            tried.append(idx)
            try:
                result = await self.servers[idx].run_request(
                    kind, kwargs, slot_held=True, fail_fast=True
                )
                if session is not None:
                    self._pin(session, idx)
                return result
            except Exception as e:
                last_error = e
                self._on_failure(idx, e, exclude)
            finally:
                self._release(idx, is_train)
