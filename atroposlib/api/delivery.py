"""Delivery of batches to the trainer: batch ids, the unacknowledged batch, acks.

A served batch stays pending until the trainer acknowledges it: explicitly
(``GET /batch?ack=ID`` or ``POST /batch/ack``), or implicitly by its next
``GET /batch`` without ``ack`` (the original's clients). Until then it is served
again, byte for byte, to a client that did not acknowledge it (docs/design.md,
"Delivery guarantee"). Batch ids are ``<run token>-<n>``: the token is drawn
once per database (or process), ``n`` counts every batch formed and never goes
back, so a client never mistakes a new batch for one it already has.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any, Dict, List

from atroposlib.api.errors import ApiError
from atroposlib.api.queue import StoredGroup

__all__ = ["Delivery", "PendingBatch", "UnknownBatchError"]

_BATCH_NUMBER = re.compile(r"[1-9][0-9]{0,17}")
"""The number of a ``batch_id`` as this server writes it (ASCII, canonical, bounded)."""


class UnknownBatchError(ApiError):
    """A ``batch_id`` this server never served (404)."""

    status_code = 404

    def __init__(self, batch_id: str) -> None:
        shown = batch_id if len(batch_id) <= 80 else batch_id[:80] + "..."
        super().__init__(
            f"unknown batch_id {shown!r}: acknowledge the batch_id of the last /batch answer"
        )


@dataclass
class PendingBatch:
    """The batch served last and not acknowledged yet; ``live`` once this process served it."""

    batch_id: str
    step: int
    groups: List[StoredGroup]
    live: bool = True
    staleness: Dict[str, int] | None = None

    def meta(self) -> Dict[str, Any]:
        """What persistence keeps of it (its groups by queue position)."""
        return {
            "batch_id": self.batch_id,
            "step": self.step,
            "seqs": [g.seq for g in self.groups],
        }


class Delivery:
    """The unacknowledged batch and the batch-id counter of one store."""

    def __init__(self) -> None:
        self.pending: PendingBatch | None = None
        self.run_token = secrets.token_hex(4)
        self.formed = 0

    def settle(self, ack: str | None) -> List[StoredGroup] | None:
        """Apply a ``GET /batch``'s acknowledgement to the pending batch.

        ``ack`` None is an old client: the pending batch counts as acknowledged
        unless it was restored after a restart and not served since. A string
        (possibly empty) acknowledges the pending batch when it matches.
        Returns the groups consumed (empty when none was pending), or None when
        the pending batch is not acknowledged and must be served again (it is
        then marked ``live``).
        """
        pending = self.pending
        if pending is None:
            return []
        acked = pending.live if ack is None else ack == pending.batch_id
        if not acked:
            pending.live = True
            return None
        self.pending = None
        return pending.groups

    def form(self, step: int, groups: List[StoredGroup]) -> PendingBatch:
        """Make ``groups`` the pending batch of ``step`` under the next batch id."""
        self.formed += 1
        self.pending = PendingBatch(f"{self.run_token}-{self.formed}", step, groups)
        return self.pending

    def acknowledge(self, batch_id: str) -> List[StoredGroup] | None:
        """``POST /batch/ack``: the groups consumed, or None for an earlier batch of this
        server (already acknowledged); :class:`UnknownBatchError` for any other id."""
        pending = self.pending
        if pending is not None and batch_id == pending.batch_id:
            self.pending = None
            return pending.groups
        token, _, number = batch_id.rpartition("-")
        # Only the form this server writes: ASCII digits without a leading zero, at most 18 of
        # them (``isdigit`` also accepts '²' and '١', and "01" would pass for batch 1 while
        # batch 1 is still pending).
        if (
            token == self.run_token
            and _BATCH_NUMBER.fullmatch(number)
            and int(number) <= self.formed
        ):
            return None
        raise UnknownBatchError(batch_id)
