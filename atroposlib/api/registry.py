"""The env registry of the rollout API: registered environments and when each last posted.

Env ids are list positions and never reused (a disconnected env keeps its
record). An env that has not posted for ``--env-timeout`` seconds stops
counting for ``min_batch_allocation`` until it posts again; time is read from
an injected clock (``time.monotonic`` by default), so tests move it by hand.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List

from atroposlib.api.errors import UnknownEnvError
from atroposlib.api.models import RegisterEnv

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_ENV_TIMEOUT", "Clock", "EnvRecord", "EnvRegistry"]

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic`` unless a test passes its own)."""

DEFAULT_ENV_TIMEOUT = 300.0
"""Seconds of silence after which an env stops counting for ``min_batch_allocation``."""


@dataclass
class EnvRecord:
    """A registered environment (ids are list positions, never reused)."""

    max_context_len: int
    weight: float
    desired_name: str
    real_name: str
    registered_id: int
    last_update: float
    connected: bool
    min_batch_allocation: float | None
    group_size: int


class EnvRegistry:
    """The registered envs and their activity (silent for longer than ``env_timeout``)."""

    def __init__(self, env_timeout: float = DEFAULT_ENV_TIMEOUT, clock: Clock = time.monotonic):
        self.env_timeout = env_timeout
        self.clock = clock
        self.envs: List[EnvRecord] = []
        self._last_seen: Dict[int, float] = {}
        self._inactive: set[int] = set()

    def __len__(self) -> int:
        return len(self.envs)

    def clear(self) -> None:
        """Forget every env (a new trainer registration or a reset)."""
        self.envs = []
        self._last_seen.clear()
        self._inactive.clear()

    def restore(self, records: Iterable[Dict[str, Any]] | None) -> None:
        """Take the records read back after a restart (None: keep the current ones); every
        env counts as just seen."""
        if records is not None:
            self.envs = [EnvRecord(**r) for r in records]
        now = self.clock()
        self._last_seen = {i: now for i in range(len(self.envs))}

    def get(self, env_id: Any) -> EnvRecord:
        """The record of ``env_id``; :class:`UnknownEnvError` when there is none."""
        if (
            not isinstance(env_id, int)
            or isinstance(env_id, bool)
            or not 0 <= env_id < len(self.envs)
        ):
            raise UnknownEnvError(env_id)
        return self.envs[env_id]

    def add(self, req: RegisterEnv) -> EnvRecord:
        """Register an env under the next id, named ``<desired_name>_<n>`` (``n``: how many
        envs asked for that name before)."""
        same_name = sum(1 for e in self.envs if e.desired_name == req.desired_name)
        record = EnvRecord(
            max_context_len=req.max_token_length,
            weight=req.weight,
            desired_name=req.desired_name,
            real_name=f"{req.desired_name}_{same_name}",
            registered_id=len(self.envs),
            last_update=time.time(),  # a wall-clock stamp, as the original's records carry
            connected=True,
            min_batch_allocation=req.min_batch_allocation,
            group_size=req.group_size,
        )
        self.envs.append(record)
        self._last_seen[record.registered_id] = self.clock()
        return record

    def disconnect(self, env_id: int) -> None:
        """Mark an env disconnected (its record and id stay)."""
        self.get(env_id).connected = False
        self._inactive.discard(env_id)

    def grow_group_size(self, env_id: int, size: int) -> bool:
        """Raise the env's group size to ``size`` when larger; True when it changed."""
        record = self.envs[env_id]
        if size <= record.group_size:
            return False
        record.group_size = size
        return True

    def seen(self, env_id: int) -> None:
        """Note a post from ``env_id`` (it counts for ``min_batch_allocation`` again)."""
        self._last_seen[env_id] = self.clock()
        if env_id in self._inactive:
            self._inactive.discard(env_id)
            logger.info("env %d posted again: it counts for min_batch_allocation again", env_id)

    def inactive(self) -> List[int]:
        """Connected envs silent for more than ``env_timeout`` s. Logs each change."""
        if self.env_timeout <= 0:
            return []
        now = self.clock()
        silent: List[int] = []
        for i, e in enumerate(self.envs):
            quiet_for = now - self._last_seen.get(i, now)
            if e.connected and quiet_for > self.env_timeout:
                silent.append(i)
                if i not in self._inactive:
                    self._inactive.add(i)
                    logger.warning(
                        "env %d (%s) has not posted for %.0f s (--env-timeout): it no longer "
                        "counts for min_batch_allocation until it posts again",
                        i,
                        e.real_name,
                        quiet_for,
                    )
        return silent
