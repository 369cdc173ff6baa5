"""The ``APIServer`` base class (server configs and the adaptive semaphore are importable from
here too; they live in ``server_config`` and ``adaptive_semaphore``).

``APIServer`` owns the request path shared by every backend: a background health
check, train/eval semaphores, retries (one tenacity policy, :meth:`APIServer.retrying`), attempt
counting, and request timings kept in rolling buffers of ``rolling_buffer_length``.
A backend implements the ``_*_wrapper`` coroutines and, optionally, ``_probe_health``.

Failure handling: a request that cannot reach its server (connection refused,
timeout) marks the server unhealthy at once, so a ``ServerManager`` moves traffic to
the other servers without waiting for the next health probe; the background probe
(every second while healthy, every quarter second while not) lets it rejoin.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import numpy as np
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from atroposlib.envs.server_handling.adaptive_semaphore import AsyncSemWithAdaptiveWeight
from atroposlib.envs.server_handling.errors import (
    ServerTLSError,
    ServerUnavailableError,
    is_retryable,
    is_transport_error,
)
from atroposlib.envs.server_handling.sampling_record import note_request
from atroposlib.envs.server_handling.server_config import (  # noqa: F401 - original import path
    _CONFIG_DEFAULTS,
    EFFORT_TO_MAX_TOKENS,
    REASONING_EFFORTS,
    VALID_REASONING_EFFORTS,
    APIServerConfig,
    OpenaiConfig,
    ReasoningConfig,
    ServerBaseline,
    ServerType,
    config_value,
    invalid_effort_message,
    is_official_openai,
)
from atroposlib.utils.aio import cancel_and_wait, within

logger = logging.getLogger(__name__)

CLOSE_RECANCEL_S = 0.5
"""How long :meth:`APIServer.close` waits for the cancelled health loop before cancelling again."""

if sys.version_info >= (3, 11):

    def _deadline(seconds: float):
        return asyncio.timeout(seconds)

else:  # pragma: no cover - Python 3.10

    @asynccontextmanager
    async def _deadline(seconds: float) -> AsyncIterator[None]:
        task = asyncio.current_task()
        handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
        try:
            yield
        except asyncio.CancelledError as e:
            raise asyncio.TimeoutError() from e
        finally:
            handle.cancel()


_WRAPPERS = {
    "chat": "_chat_completion_wrapper",
    "completion": "_completion_wrapper",
    "tokens": "_tokens_and_logprobs_completion_wrapper",
    "logprobs": "_get_logprobs_wrapper",
}
# The original's per-kind entry points (training, eval): one request with its retries.
# Every request goes through them, so a subclass that overrides one changes every caller.
_ENTRIES = {
    ("chat", True): "_chat_comp",
    ("chat", False): "_chat_eval",
    ("completion", True): "_comp",
    ("completion", False): "_comp_eval",
    ("tokens", True): "_tokens_and_logprobs_comp",
    ("tokens", False): "_tokens_and_logprobs_comp_eval",
    ("logprobs", True): "_logprobs",
    ("logprobs", False): "_logprobs_eval",
}


class APIServer(ABC):
    """Base class of an inference server backend.

    Subclasses implement ``_chat_completion_wrapper``, ``_completion_wrapper`` and,
    where the backend can, ``_tokens_and_logprobs_completion_wrapper`` and
    ``_get_logprobs_wrapper``. ``_probe_health`` says whether the server is up.
    """

    retry_attempts: int = 3
    retry_multiplier: float = 1.0
    retry_max_wait: float = 10.0
    transport_has_timeout: bool = False
    """True when the backend's client enforces ``config.timeout`` itself (HTTP backends);
    otherwise every attempt runs under an asyncio deadline of ``config.timeout``."""
    healthy_probe_interval: float = 1.0
    unhealthy_probe_interval: float = 0.25
    last_health_error: BaseException | None = None
    """The last health probe's failure (None once a probe answered): what
    ``ServerUnavailableError`` reports when waiting for a healthy server runs out."""

    def __init__(self, config: ServerBaseline, reasoning_config: ReasoningConfig | None = None):
        self.config = config
        self.reasoning_config = reasoning_config
        self.sem = AsyncSemWithAdaptiveWeight(config_value(config, "num_max_requests_at_once"))
        self.eval_sem = AsyncSemWithAdaptiveWeight(config_value(config, "num_requests_for_eval"))
        n = config_value(config, "rolling_buffer_length")
        self.request_timings: deque[float] = deque(maxlen=n)
        self.attempts_list: deque[int] = deque(maxlen=n)
        self.eval_request_timings: deque[float] = deque(maxlen=n)
        self.eval_attempts_list: deque[int] = deque(maxlen=n)
        self.check_task: asyncio.Task[None] | None = None
        self.initialized = False
        self._server_healthy = True
        self._health_listeners: list[Callable[[], None]] = []
        self._healthy_waiters: list[asyncio.Future[None]] = []
        self._health_enabled = self._health_check_enabled()

    # ----------------------------------------------------------------- identity and health
    @property
    def name(self) -> str:
        """A readable identifier: the base URL, or the class name when there is none."""
        return str(getattr(self.config, "base_url", "") or type(self).__name__)

    @property
    def server_healthy(self) -> bool:
        """Whether the server is believed to be up."""
        return self._server_healthy

    @server_healthy.setter
    def server_healthy(self, value: bool) -> None:
        changed = bool(value) != self._server_healthy
        self._server_healthy = bool(value)
        if changed:
            logger.info("server %s is now %s", self.name, "healthy" if value else "unhealthy")
            if value:
                for fut in self._healthy_waiters:
                    if not fut.done():
                        fut.set_result(None)
                self._healthy_waiters.clear()
            for listener in self._health_listeners:
                listener()

    def add_health_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` whenever the health flag changes."""
        self._health_listeners.append(callback)

    def mark_unhealthy(self, cause: BaseException | None = None) -> None:
        """Take the server out of rotation until the health probe sees it again.

        Without health checks nothing could bring it back, so the server stays in
        rotation (the original's "assumed healthy") and only the failure is logged.
        """
        if not self._health_enabled:
            logger.warning(
                "request to %s failed (no health checks, kept in rotation): %r", self.name, cause
            )
            return
        if self._server_healthy:
            logger.warning("marking server %s unhealthy: %r", self.name, cause)
        self.server_healthy = False
        self.start_health_check()

    def _health_check_enabled(self) -> bool:
        return bool(getattr(self.config, "health_check", False)) and bool(
            getattr(self.config, "base_url", None)
        )

    def start_health_check(self) -> None:
        """Start the background health loop (once) when health checks are on."""
        if not self._health_enabled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self.check_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        # A fresh context: the loop outlives the request that started it, and its probes
        # must not carry that request's session (``session_affinity.CURRENT_SESSION``).
        self.check_task = loop.create_task(
            self.check_server_status_task(), context=contextvars.Context()
        )

    async def _probe_health(self) -> bool:
        """Whether the server answers; backends override this. The default assumes yes."""
        return True

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        """Background loop that keeps ``server_healthy`` up to date."""
        while True:
            try:
                healthy = await self._probe_health()
                self.last_health_error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed probe means unhealthy, never a dead loop
                if isinstance(e, ServerTLSError) and not isinstance(
                    self.last_health_error, ServerTLSError
                ):  # a configuration error, not an outage: say it once, loudly
                    logger.warning("health probe of %s: %s", self.name, e)
                else:
                    logger.debug("health probe of %s failed: %r", self.name, e)
                self.last_health_error = e
                healthy = False
            self.server_healthy = healthy
            await asyncio.sleep(
                self.healthy_probe_interval if healthy else self.unhealthy_probe_interval
            )

    async def wait_until_healthy(self, timeout: float) -> None:
        """Wait until the server is healthy, or raise ``ServerUnavailableError``."""
        if self._server_healthy:
            return
        self.start_health_check()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._healthy_waiters.append(fut)
        try:
            await within(fut, timeout)
        except asyncio.TimeoutError as e:
            # The probe's own failure (a refused connection, a certificate that does not
            # verify) says more than that the wait ran out.
            cause = self.last_health_error or e
            raise ServerUnavailableError(self.name, cause) from cause

    async def close(self) -> None:
        """Stop the health loop and release backend resources."""
        task, self.check_task = self.check_task, None
        if task is None or task.done():
            return
        await cancel_and_wait(task, CLOSE_RECANCEL_S)  # a probe may swallow one cancellation
        if not task.cancelled() and task.exception() is not None:
            logger.debug("health loop of %s ended with %r", self.name, task.exception())

    # ----------------------------------------------------------------- weights and metrics
    async def update_weight(self, weight: float) -> None:
        """Scale both semaphores' usable capacity by ``weight`` (a coroutine, as the original's)."""
        self.sem.update_weight(weight)
        self.eval_sem.update_weight(weight)

    async def wandb_metrics(
        self, metrics_dict: dict[str, Any] | None = None, server_name: str | None = None
    ) -> dict[str, Any]:
        """Add timing and retry metrics of the recent requests to ``metrics_dict``."""
        metrics = {} if metrics_dict is None else metrics_dict
        name = server_name or "server"
        for prefix, timings in (("", self.request_timings), ("eval_", self.eval_request_timings)):
            if timings:
                arr = np.asarray(timings, dtype=float)
                metrics[f"server/{name}_{prefix}request_time_avg"] = float(arr.mean())
                metrics[f"server/{name}_{prefix}request_time_std"] = float(arr.std())
                metrics[f"server/{name}_{prefix}request_time_99p"] = float(np.percentile(arr, 99))
        if self.attempts_list:
            metrics[f"server/{name}_average_num_attempts"] = float(np.mean(self.attempts_list))
        if self.eval_attempts_list:
            metrics[f"server/{name}_eval_retry_rate"] = float(np.mean(self.eval_attempts_list))
        return metrics

    # ----------------------------------------------------------------- request path
    def prepare_kwargs(self, kind: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Pop the routing keys (``split``, ``skip_reasoning``), set the model, inject reasoning.

        Returns the backend kwargs and whether the request is a training request.
        """
        kwargs = dict(kwargs)
        is_train = kwargs.pop("split", "train") != "eval"
        skip_reasoning = bool(kwargs.pop("skip_reasoning", False))
        kwargs["model"] = config_value(self.config, "model_name")
        if kind == "chat" and self.reasoning_config is not None and not skip_reasoning:
            kwargs = self._inject_reasoning_kwargs(kwargs)
        return kwargs, is_train

    def _inject_reasoning_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with the reasoning ``extra_body`` merged in (official OpenAI also gets
        temperature 1.0 and ``max_completion_tokens``); unchanged when reasoning is off."""
        base_url = getattr(self.config, "base_url", None)
        extra = self.reasoning_config.build_extra_body(base_url) if self.reasoning_config else None
        if not extra:
            return kwargs
        kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), **extra}
        if is_official_openai(base_url):
            kwargs["temperature"] = 1.0
            if "max_tokens" in kwargs:
                kwargs["max_completion_tokens"] = kwargs.pop("max_tokens")
        return kwargs

    async def run_request(
        self,
        kind: str,
        kwargs: dict[str, Any],
        *,
        slot_held: bool = False,
        fail_fast: bool = False,
    ) -> Any:
        """Run one request of ``kind`` (chat, completion, tokens, logprobs) with retries.

        ``slot_held``: the caller (the ``ServerManager``) already holds a semaphore slot.
        ``fail_fast``: raise ``ServerUnavailableError`` on a transport failure instead of
        waiting for this server to come back (the caller will try another server).
        """
        kwargs, is_train = self.prepare_kwargs(kind, kwargs)
        if is_train and kind != "logprobs":
            note_request(kwargs)  # the group's generation_params (sampling_record)
        stat_dict = {"attempts": 0, "slot_held": slot_held, "fail_fast": fail_fast}
        return await getattr(self, _ENTRIES[kind, is_train])(stat_dict, **kwargs)

    def retrying(self) -> AsyncRetrying:
        """The retry policy of one request: at most ``retry_attempts`` attempts, random
        exponential backoff (``retry_multiplier`` doubling per attempt, at most
        ``retry_max_wait`` seconds), only for errors another attempt could fix
        (:func:`~.errors.is_retryable`); the last error is raised as it is."""
        return AsyncRetrying(
            stop=stop_after_attempt(self.retry_attempts),
            wait=wait_random_exponential(multiplier=self.retry_multiplier, max=self.retry_max_wait),
            retry=retry_if_exception(is_retryable),
            before_sleep=self._log_retry,
            reraise=True,
        )

    def _log_retry(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        logger.info("request to %s failed (attempt %d): %r", self.name, state.attempt_number, error)

    async def _run_prepared(
        self, kind: str, kwargs: dict[str, Any], is_train: bool, stat_dict: dict[str, Any]
    ) -> Any:
        """Run prepared ``kwargs`` against the backend under :meth:`retrying`.

        ``stat_dict`` is the original's per-request record: ``start`` (first attempt's
        ``time.time()``) and ``attempts`` are filled in; ``slot_held`` and ``fail_fast``
        (see :meth:`run_request`) are read from it.
        """
        if self._health_enabled and self.check_task is None:
            self.start_health_check()
        self.initialized = True
        started: list[float] = []  # monotonic time of the first attempt's start
        attempts = 1
        stat_dict["attempts"] = int(stat_dict.get("attempts") or 0) + 1
        try:
            # The first attempt runs outside the policy: nearly every request ends here, and
            # the policy's bookkeeping (tens of microseconds and reference cycles for the
            # garbage collector, per request) would be paid for nothing. A failure is handed
            # to the policy as its attempt 1, so it alone decides what happens next.
            result = await self._attempt(kind, kwargs, is_train, stat_dict, started)
        except Exception as first:
            failed: list[BaseException] = [first]
            try:
                async for attempt in self.retrying():
                    with attempt:
                        if failed:
                            raise failed.pop()
                        attempts += 1
                        stat_dict["attempts"] += 1
                        result = await self._attempt(kind, kwargs, is_train, stat_dict, started)
            except Exception:
                (self.attempts_list if is_train else self.eval_attempts_list).append(attempts)
                raise
        self._record(is_train, time.monotonic() - started[0], attempts)
        return result

    async def _attempt(
        self,
        kind: str,
        kwargs: dict[str, Any],
        is_train: bool,
        stat_dict: dict[str, Any],
        started: list[float],
    ) -> Any:
        """One attempt: a slot (unless the caller holds one), the backend call, and a server
        that cannot be reached marked unhealthy (``ServerUnavailableError`` with
        ``fail_fast``, so the caller moves to another server). The first attempt's start,
        once it has its slot, goes into ``started`` and ``stat_dict["start"]``."""
        slot_held = bool(stat_dict.get("slot_held", False))
        fail_fast = bool(stat_dict.get("fail_fast", False))
        sem = self.sem if is_train else self.eval_sem
        if not slot_held:
            if not self._server_healthy:
                if fail_fast:
                    raise ServerUnavailableError(self.name)
                await self.wait_until_healthy(config_value(self.config, "timeout"))
            await sem.acquire()
        if not started:
            started.append(time.monotonic())
            stat_dict.setdefault("start", time.time())
        try:
            wrapper = getattr(self, _WRAPPERS[kind])
            if self.transport_has_timeout:
                return await wrapper(**kwargs)
            async with _deadline(config_value(self.config, "timeout")):
                return await wrapper(**kwargs)
        except Exception as e:
            if is_transport_error(e):
                self.mark_unhealthy(e)
                if fail_fast:
                    raise ServerUnavailableError(self.name, e) from e
            raise
        finally:
            if not slot_held:
                sem.release()

    # The original's entry points: ``stat_dict`` as in :meth:`_run_prepared`, ``kwargs``
    # already prepared (model set, reasoning injected, ``split`` removed).
    async def _chat_comp(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One training chat completion, with retries, on the training semaphore."""
        return await self._run_prepared("chat", kwargs, True, stat_dict)

    async def _chat_eval(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One eval chat completion, with retries, on the eval semaphore."""
        return await self._run_prepared("chat", kwargs, False, stat_dict)

    async def _comp(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One training completion, with retries."""
        return await self._run_prepared("completion", kwargs, True, stat_dict)

    async def _comp_eval(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One eval completion, with retries."""
        return await self._run_prepared("completion", kwargs, False, stat_dict)

    async def _tokens_and_logprobs_comp(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One training tokens-and-logprobs completion, with retries."""
        return await self._run_prepared("tokens", kwargs, True, stat_dict)

    async def _tokens_and_logprobs_comp_eval(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One eval tokens-and-logprobs completion, with retries."""
        return await self._run_prepared("tokens", kwargs, False, stat_dict)

    async def _logprobs(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One training prompt-logprobs request, with retries."""
        return await self._run_prepared("logprobs", kwargs, True, stat_dict)

    async def _logprobs_eval(self, stat_dict: dict[str, Any], **kwargs: Any) -> Any:
        """One eval prompt-logprobs request, with retries."""
        return await self._run_prepared("logprobs", kwargs, False, stat_dict)

    def _record(self, is_train: bool, elapsed: float, attempts: int) -> None:
        if is_train:
            self.request_timings.append(elapsed)
            self.attempts_list.append(attempts)
        else:
            self.eval_request_timings.append(elapsed)
            self.eval_attempts_list.append(attempts)

    async def chat_completion(self, **kwargs: Any) -> Any:
        """An OpenAI ``ChatCompletion`` for ``messages`` (``split="eval"`` uses eval slots)."""
        return await self.run_request("chat", kwargs)

    async def completion(self, **kwargs: Any) -> Any:
        """An OpenAI ``Completion`` for ``prompt`` (no reasoning injection)."""
        return await self.run_request("completion", kwargs)

    async def tokens_and_logprobs_completion(
        self, **kwargs: Any
    ) -> tuple[list[int], list[list[int]], list[list[float]], list[str]]:
        """``(prompt_tokens, output_tokens_list, output_logprobs_list, finish_reasons)``."""
        return await self.run_request("tokens", kwargs)

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Top-k prompt logprobs: ``prompt_tokens``, ``prompt_topk_token_ids``, ``prompt_topk_logprobs``."""
        return await self.run_request("logprobs", kwargs)

    # ----------------------------------------------------------------- backend hooks
    @abstractmethod
    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        """Send a chat completion request to the backend."""

    @abstractmethod
    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        """Send a completion request to the backend."""

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not return tokens and logprobs")

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not return prompt logprobs")
