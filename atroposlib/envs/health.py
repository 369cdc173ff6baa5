"""When an environment should wait, and when it should give up.

Two failure modes would keep an environment busy doing nothing: a
``collect_trajectories``/``get_next_item`` that always raises, retried at once and
forever; and an inference server that was never started (or went away), leaving the
env silent for the request timeout and then failing item after item.

- :class:`FailureTracker` counts consecutive failures. A transient one
  (connection error, timeout, HTTP 5xx or 429) delays new work with exponential
  backoff and jitter; any kind counts toward ``max_consecutive_failures``, after
  which :class:`TooManyFailuresError` carries the last traceback to the CLI, which
  exits non-zero. A 4xx from a server is not transient: retrying cannot fix it.
- :func:`probe_servers` asks every inference server for any HTTP answer (5 s
  each, concurrently). The CLI uses it before starting: none answers → exit 2
  with the URL, the reason and how to start one.
- :class:`ServerWatch` probes during the run. While every server is down it logs
  one status line a minute, and after ``max_server_downtime`` seconds it stops
  the env with :class:`ServersDownError`. Failures while all servers are down are
  the watch's business, not the failure count's: an outage gets its own budget.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence

from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.envs.server_handling.errors import causes, is_transient, status_code
from atroposlib.utils.aio import cancel_and_wait

__all__ = [
    "FailureTracker",
    "NoServerReachableError",
    "ProbeResult",
    "ServerWatch",
    "ServersDownError",
    "TooManyFailuresError",
    "bounded",
    "is_transient",
    "probe_servers",
    "probe_url",
    "server_urls",
    "status_code",
    "unreachable_message",
]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
WATCH_INTERVAL_S = 5.0
STATUS_EVERY_S = 60.0
START_HINT = (
    "start one with `atropos-serve-model MODEL_DIR --port 9001` (an offline tiny model: "
    "`atropos-tiny-model --out DIR`), or point --openai.base_url at a running server"
)


class TooManyFailuresError(RuntimeError):
    """Raised after ``max_consecutive_failures`` failures in a row; holds the last one."""

    def __init__(self, count: int, where: str, last: BaseException, last_traceback: str) -> None:
        self.count = count
        self.where = where
        self.last = last
        self.last_traceback = last_traceback
        super().__init__(
            f"{count} consecutive failures; stopping (last, in {where}: "
            f"{type(last).__name__}: {_one_line(last)})"
        )


class ServersDownError(RuntimeError):
    """Every inference server stayed unreachable for longer than ``max_server_downtime``."""


class NoServerReachableError(RuntimeError):
    """No inference server answered the start-up probe."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""


class FailureTracker:
    """Consecutive-failure counter with exponential backoff for transient errors.

    ``record_failure`` raises :class:`TooManyFailuresError` on the failure that
    reaches the limit (``max_failures <= 0`` disables the limit). New work should
    start only when :meth:`ready` is True (or after :meth:`wait_ready`).
    """

    def __init__(self, max_failures: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures = max_failures
        self.consecutive = 0
        self.total = 0
        self.resume_at = 0.0
        self.fatal: BaseException | None = None
        self._clock = clock
        self._transient_run = 0

    def record_success(self) -> None:
        """Work succeeded: the count and the backoff start over."""
        self.consecutive = 0
        self._transient_run = 0
        self.resume_at = 0.0

    def record_failure(self, err: BaseException, where: str, count: bool = True) -> float:
        """Count ``err``; return the delay before new work may start.

        ``count=False`` backs off without counting (used while every server is down).
        """
        self.total += 1
        delay = 0.0
        if is_transient(err):
            self._transient_run += 1
            ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (self._transient_run - 1))
            delay = ceiling * random.uniform(0.5, 1.0)
            self.resume_at = max(self.resume_at, self._clock() + delay)
        if not count:
            return delay
        self.consecutive += 1
        if self.max_failures > 0 and self.consecutive >= self.max_failures:
            tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            self.fatal = TooManyFailuresError(self.consecutive, where, err, tb)
            raise self.fatal
        return delay

    def ready(self) -> bool:
        """True when no backoff is pending."""
        return self._clock() >= self.resume_at

    async def wait_ready(self) -> None:
        """Sleep out the pending backoff, if any."""
        remaining = self.resume_at - self._clock()
        if remaining > 0:
            await asyncio.sleep(remaining)


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of probing one server: ``reason`` is empty when it answered."""

    url: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        """True when the server gave any HTTP answer."""
        return not self.reason


def _reason(err: BaseException, timeout: float) -> str:
    for cause in causes(err):
        if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
            return "connection refused"
    if isinstance(err, TimeoutError):
        return f"no answer within {timeout:g} s"
    text = _one_line(err.__cause__ or err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


async def probe_url(url: str, timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """GET ``url`` over the inference client's transport; any HTTP status means the server
    is there."""
    transport = JsonTransport(timeout=timeout)
    try:
        await transport.get_status(url)
    except (OSError, ValueError) as err:  # unreachable (mapped), or not an http(s) URL
        return ProbeResult(url, _reason(err, timeout))
    finally:
        await transport.close()
    return ProbeResult(url)


async def probe_servers(urls: Sequence[str], timeout: float = PROBE_TIMEOUT_S) -> List[ProbeResult]:
    """Probe every URL concurrently (each at most ``timeout`` seconds)."""
    return list(await asyncio.gather(*(probe_url(u, timeout) for u in urls)))


def server_urls(server_manager: Any) -> List[str]:
    """The HTTP base URLs of a ``ServerManager``'s servers (none for mock/testing servers)."""
    urls: List[str] = []
    for server in getattr(server_manager, "servers", None) or []:
        url = str(getattr(getattr(server, "config", None), "base_url", None) or "")
        if url.startswith(("http://", "https://")) and url not in urls:
            urls.append(url)
    return urls


def unreachable_message(results: Sequence[ProbeResult]) -> str:
    """The start-up error: every URL with its reason, then how to start a server."""
    listed = "; ".join(f"{r.url} ({r.reason})" for r in results)
    return f"no inference server reachable: {listed}\n{START_HINT}"


class ServerWatch:
    """Probes the inference servers in the background while an environment runs.

    ``all_down`` is True while the latest probe found no server answering. After
    ``max_downtime`` seconds of that, ``on_fatal`` is called with a
    :class:`ServersDownError` (``max_downtime <= 0`` never gives up).
    """

    def __init__(
        self,
        urls: Sequence[str],
        max_downtime: float,
        on_fatal: Callable[[BaseException], None],
        interval: float = WATCH_INTERVAL_S,
        status_every: float = STATUS_EVERY_S,
    ) -> None:
        self.urls = list(urls)
        self.max_downtime = max_downtime
        self.on_fatal = on_fatal
        self.interval = interval
        self.status_every = status_every
        self.all_down = False
        self.down_since: float | None = None
        self._last_status = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start probing (no-op without URLs)."""
        if self.urls and self._task is None:
            self._task = asyncio.create_task(self._run(), name="atropos-server-watch")

    async def stop(self) -> None:
        """Stop probing."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def check_once(self) -> None:
        """Probe every server once and act on the result."""
        results = await probe_servers(self.urls, timeout=min(PROBE_TIMEOUT_S, self.interval))
        now = time.monotonic()
        if any(r.ok for r in results):
            if self.down_since is not None:
                logger.warning(
                    "inference server back after %.0f s: %s",
                    now - self.down_since,
                    ", ".join(r.url for r in results if r.ok),
                )
            self.all_down, self.down_since = False, None
            return
        self.all_down = True
        first = self.down_since is None
        if first:
            self.down_since, self._last_status = now, 0.0
        down_for = now - self.down_since
        if now - self._last_status >= self.status_every:
            self._last_status = now
            limit = f"; giving up after {self.max_downtime:g} s" if self.max_downtime > 0 else ""
            logger.warning(
                "no inference server answering for %.0f s (%s); retrying%s%s",
                down_for,
                "; ".join(f"{r.url}: {r.reason}" for r in results),
                limit,
                f"\n{START_HINT}" if first else "",
            )
        if self.max_downtime > 0 and down_for >= self.max_downtime:
            self.on_fatal(
                ServersDownError(
                    f"every inference server has been unreachable for {down_for:.0f} s "
                    f"(--env.max_server_downtime {self.max_downtime:g}): "
                    + "; ".join(f"{r.url} ({r.reason})" for r in results)
                )
            )

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the watch must never die silently
                logger.exception("server watch probe failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))


async def bounded(coro: Any, what: str, timeout_s: float = 15.0) -> None:
    """Await ``coro`` for at most ``timeout_s``: shutting down must not hang the env.

    ``asyncio.wait`` (not ``wait_for``) so a callee that is slow to honour the
    cancellation cannot hold the caller either.
    """
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        logger.warning("%s took more than %.0f s; going on without waiting", what, timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        logger.warning("%s failed: %r", what, task.exception())
