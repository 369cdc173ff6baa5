"""The throttling signal of ``/status-env``: pure arithmetic on a snapshot of the store.

An environment asks how much work is queued and how much of the next batches
is its to fill, and slows down or speeds up accordingly. The numbers are the
original's: queue sizes are counted in the asking env's groups, the rest of
the queue is counted as it will pack (whole groups of the largest size), and
what other envs have reserved through ``min_batch_allocation`` is left out of
their share. Nothing here reads a clock or changes state; the store passes
in the envs silent for longer than ``--env-timeout`` and persists the one
change the answer implies (an env's group size that grew).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Dict, Mapping, Sequence

from atroposlib.api.queue import EnvQueueStats
from atroposlib.api.registry import EnvRecord

__all__ = ["MIN_ENV_WEIGHT", "EnvSignal", "env_signal", "unregistered_signal"]

MIN_ENV_WEIGHT = 0.01
"""Floor of the ``env_weight`` that ``/status-env`` reports."""


@dataclass(frozen=True)
class EnvSignal:
    """The answer's numbers and the asking env's group size as the answer counted it."""

    answer: Dict[str, Any]
    group_size: int


def unregistered_signal(step: int) -> Dict[str, Any]:
    """The defined answer before a trainer registered (nothing to throttle against)."""
    return {
        "current_step": step,
        "queue_size": 0,
        "unallocated_fraction": 1.0,
        "self_queue_size": 0,
        "max_group_size": 1,
        "env_weight": 1.0,
        "self_buffered_groups": 0,
    }


def env_signal(
    env_id: int,
    envs: Sequence[EnvRecord],
    per_env: Mapping[int | None, EnvQueueStats],
    max_group_size: int,
    batch_size: int,
    silent: Collection[int],
    step: int,
    self_buffered_groups: int,
) -> EnvSignal:
    """The throttling signal of ``envs[env_id]``, in O(number of envs).

    ``per_env`` and ``max_group_size`` describe the queue, ``silent`` the envs
    that stopped counting for ``min_batch_allocation``. The env's group size
    grows to the largest group of its own on the queue.
    """
    me = envs[env_id]
    connected = [e for e in envs if e.connected]
    total = sum(e.max_context_len * max(0.0, e.weight) for e in connected)
    share = me.max_context_len * me.weight / total if total > 0 else 0.0
    env_weight = max(MIN_ENV_WEIGHT, share)
    allocated = sum(
        e.min_batch_allocation
        for i, e in enumerate(envs)
        if e.connected and e.min_batch_allocation is not None and i not in silent
    )
    unallocated = 1.0 - min(allocated, 1.0)
    max_group = max(1, max_group_size)
    mine = per_env.get(env_id)
    own = mine.sequences if mine else 0
    group_size = max(me.group_size, mine.max_size if mine else 0)
    from_others = 0
    if max_group > 1:
        for other_id, stats in per_env.items():
            if other_id == env_id:
                continue
            packed = math.ceil(stats.sequences / max_group) * max_group
            reserved = 0
            if other_id is not None and 0 <= other_id < len(envs):
                other = envs[other_id]
                if (
                    other.connected
                    and other.min_batch_allocation is not None
                    and other_id not in silent
                ):
                    reserved = int(batch_size * other.min_batch_allocation)
            from_others += max(0, packed - reserved)
    answer = {
        "current_step": step,
        "queue_size": (own + from_others) // group_size,
        "unallocated_fraction": unallocated,
        "self_queue_size": own // group_size,
        "max_group_size": max_group,
        "env_weight": env_weight,
        "self_buffered_groups": self_buffered_groups,
    }
    return EnvSignal(answer, group_size)
