"""Pure scheduling arithmetic of the serve loop (docs/design.md, "Throttling and scheduling").

Kept free of I/O so the throttling rules can be unit- and property-tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


class BadStatusAnswer(ValueError):
    """A ``/status-env`` answer whose fields are not what the route returns (a failed poll)."""


_INT_FIELDS = ("current_step", "queue_size", "self_queue_size", "max_group_size")
_FLOAT_FIELDS = ("unallocated_fraction", "env_weight")


def _field(payload: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    value = payload.get(key)
    if value is None:
        return default
    try:
        if isinstance(value, (bool, list, dict)):
            raise TypeError(type(value).__name__)
        number = kind(value)
        if kind is float and not math.isfinite(number):
            raise ValueError("not finite")
    except (TypeError, ValueError, OverflowError):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise BadStatusAnswer(
            f"/status-env answer: {key} is {shown}, expected {'an integer' if kind is int else 'a finite number'}"
        ) from None
    return number


@dataclass(frozen=True)
class EnvStatus:
    """The fields of ``GET /status-env`` the loop uses (queue sizes in this env's groups)."""

    current_step: int = 0
    queue_size: int = 0
    self_queue_size: int = 0
    unallocated_fraction: float = 1.0
    max_group_size: int = 1
    env_weight: float = 1.0

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> EnvStatus:
        """Build from the JSON answer; missing (or null) keys keep their defaults.

        Raises :class:`BadStatusAnswer` naming the field when the answer is not an object
        or a field is not a number (a bool, a string that is none, NaN, infinity).
        """
        if not isinstance(payload, Mapping):
            raise BadStatusAnswer(
                f"/status-env answer is a JSON {type(payload).__name__}, expected an object"
            )
        values = {key: _field(payload, key, getattr(cls, key), int) for key in _INT_FIELDS}
        values.update(
            {key: _field(payload, key, getattr(cls, key), float) for key in _FLOAT_FIELDS}
        )
        values["max_group_size"] = max(1, values["max_group_size"])
        return cls(**values)


def derived_batch_size(
    batch_size: int, status: EnvStatus, min_batch_allocation: float | None
) -> int:
    """This env's share of a batch: ``batch_size × (unallocated + own minimum)``; -1 if unknown."""
    if batch_size <= 0:
        return -1
    share = status.unallocated_fraction + (min_batch_allocation or 0.0)
    return int(batch_size * min(1.0, share))


def own_quota_met(
    status: EnvStatus, group_size: int, batch_size: int, min_batch_allocation: float | None
) -> bool:
    """True when this env's minimum allocation is already queued (or it has none)."""
    if min_batch_allocation is None:
        return True
    return status.self_queue_size * group_size >= batch_size * min_batch_allocation


def offpolicy_full(
    status: EnvStatus,
    group_size: int,
    batch_size: int,
    max_batches_offpolicy: int,
    min_batch_allocation: float | None,
) -> bool:
    """The pause rule: enough data is queued already (docs/design.md, "Throttling and scheduling")."""
    if max_batches_offpolicy <= 0 or batch_size <= 0:
        return False
    queued = status.queue_size * group_size
    return queued >= max_batches_offpolicy * batch_size and own_quota_met(
        status, group_size, batch_size, min_batch_allocation
    )


def should_terminate(status: EnvStatus, group_size: int, batch_size: int, total_steps: int) -> bool:
    """True when the queued data already covers the steps left until ``total_steps``."""
    if total_steps < 0 or batch_size <= 0:
        return False
    return status.current_step + (status.queue_size * group_size) // batch_size > total_steps


def train_worker_cap(
    *,
    max_num_workers: int,
    eval_running: bool,
    eval_handling: str,
    eval_limit_ratio: float,
    max_batches_offpolicy: int,
    derived_batch: int,
    group_size: int,
    status: EnvStatus,
    min_batch_allocation: float | None,
    batch_size: int,
) -> int:
    """How many training workers may run now (docs/design.md, "Throttling and scheduling"). Never negative."""
    cap = max_num_workers
    if eval_running:
        if eval_handling == "STOP_TRAIN":
            return 0
        if eval_handling == "LIMIT_TRAIN":
            cap = int(max_num_workers * eval_limit_ratio)
    if max_batches_offpolicy > 0 and derived_batch > 0:
        cap = min(cap, max_batches_offpolicy * derived_batch // group_size - status.queue_size)
    if min_batch_allocation is not None and batch_size > 0:
        quota_seqs = batch_size * min_batch_allocation
        per_pack = max(group_size, status.max_group_size)
        needed = (
            math.ceil(quota_seqs / per_pack) * (per_pack // group_size) - status.self_queue_size
        )
        cap = max(cap, needed)
    return max(0, cap)
