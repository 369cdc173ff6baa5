"""Pieces of the ``serve`` mode that hold no state of their own.

The serve loop itself, and everything it keeps while it runs, belong to
:class:`atroposlib.envs.runner.EnvRunner`. Here: its timing constants, the
``/register-env`` body of an env, a rate-limited "still waiting" log line, and the
SIGINT/SIGTERM routing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Callable

logger = logging.getLogger(__name__)

STATUS_POLL_S = 0.1
MAINLOOP_TICK_S = 0.1
WAITING_NOTICE_S = 30.0


class Notice:
    """Logs a waiting message once, then again every ``every`` seconds."""

    def __init__(self, every: float = WAITING_NOTICE_S) -> None:
        self.every = every
        self._last: float | None = None

    def __call__(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every:
            self._last = now
            logger.info(message, *args)


def registration_payload(env: Any) -> dict[str, Any]:
    """The ``/register-env`` body of ``env`` (a ``BaseEnv``): its config's limits and name."""
    return {
        "max_token_length": env.config.max_token_length,
        "desired_name": env.config.wandb_name or env.name or type(env).__name__,
        "weight": env.config.inference_weight,
        "min_batch_allocation": env.config.min_batch_allocation,
        "group_size": env.config.group_size,
    }


def install_stop_signals(callback: Callable[[], None]) -> Callable[[], None]:
    """Route SIGINT/SIGTERM to ``callback`` while serving; returns the undo function."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signal support on this platform

    def uninstall() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return uninstall
