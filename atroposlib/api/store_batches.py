"""Serving batches: ``GET /batch``, ``POST /batch/ack`` and the unacknowledged batch.

:class:`StoreBatches` is the part of :class:`~atroposlib.api.store.RolloutStore` that
forms a batch from the queue (with the envs' ``min_batch_allocation``), drops groups
more than ``--max-staleness`` versions behind, serves the unacknowledged batch again
until the trainer acknowledges it (docs/design.md, "Delivery guarantee") and renders the
``GET /batch`` answer.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, List, Sequence

from atroposlib.api import codec
from atroposlib.api.errors import StorageError
from atroposlib.api.queue import StoredGroup
from atroposlib.api.staleness import histogram
from atroposlib.api.store_state import META_KEY, DurableState

# The store's own logger: the store logs under one name, whichever part of it speaks.
logger = logging.getLogger("atroposlib.api.store")

__all__ = ["StoreBatches"]


class StoreBatches(DurableState):
    """Batch serving of :class:`~atroposlib.api.store.RolloutStore` (a base class of it)."""

    started: bool
    batch_size: int

    if TYPE_CHECKING:

        def count(self, name: str, n: int = 1) -> None: ...

        def inactive_envs(self) -> List[int]: ...

    def next_batch(self) -> List[bytes] | None:
        """Serve the next batch as an old client sees it: its groups' JSON, or None.

        Calling it acknowledges the batch served before (implicit ack).
        """
        served = self.serve_batch(None)
        return None if served is None else served[0]

    def serve_batch(self, ack: str | None) -> tuple[List[bytes], str, int] | None:
        """Mark the trainer started and answer ``GET /batch``: ``(groups, batch_id, step)`` or None.

        ``ack`` None is an old client: this call acknowledges the batch it was
        served last, unless that batch was restored after a restart and not
        served since. A string (possibly empty) is the ``batch_id`` the client
        holds: the unacknowledged batch is consumed when it matches, and
        served again, identical, when it does not.
        """
        self.flush()  # the batch may hold groups whose rows are still deferred
        newly_started = not self.started
        self.started = True
        consume = self.delivery.settle(ack)
        if consume is None:
            pending = self.delivery.pending
            assert pending is not None
            self.count("batches_resent")
            logger.info("serving unacknowledged batch %s again", pending.batch_id)
            return self._bodies(pending.groups), pending.batch_id, pending.step
        if consume:
            self.count("batches_acknowledged")
        self._drop_stale()
        batch = self._pop_batch()
        if batch is None:
            if consume or newly_started:
                self._commit(delete=[g.seq for g in consume], meta={META_KEY: self._meta()})
            return None
        self.step += 1
        pending = self.delivery.form(self.step, batch)
        if self.staleness.max_staleness is not None or any(g.version is not None for g in batch):
            pending.staleness = histogram(self.step - 1, batch)
        self.count("batches_served")
        sequences = sum(g.size for g in batch)
        self.count("sequences_served", sequences)
        if self._db is None:
            bodies = self._bodies(batch)
        else:
            try:
                bodies = self._db.swap_batch(
                    [g.seq for g in consume], [g.seq for g in batch], {META_KEY: self._meta()}
                )
            except StorageError:
                self._restore()
                raise
        logger.info("Sending batch of %d sequences", sequences)
        return bodies, pending.batch_id, pending.step

    def acknowledge(self, batch_id: str) -> str:
        """Consume the unacknowledged batch ``batch_id`` (``POST /batch/ack``).

        Returns ``"acknowledged"``, or ``"already acknowledged"`` for an
        earlier batch of this server; :class:`UnknownBatchError` otherwise.
        """
        consumed = self.delivery.acknowledge(batch_id)
        if consumed is None:
            return "already acknowledged"
        self.count("batches_acknowledged")
        self._commit(delete=[g.seq for g in consumed], meta={META_KEY: self._meta()})
        return "acknowledged"

    def batch_answer(self, ack: str | None) -> bytes:
        """The ``GET /batch`` JSON: ``{"batch":[...],"batch_id":...,"step":...}`` or ``{"batch":null}``."""
        served = self.serve_batch(ack)
        if served is None:
            return codec.NO_BATCH
        bodies, batch_id, step = served
        pending = self.delivery.pending
        return codec.batch_answer(
            bodies, batch_id, step, pending.staleness if pending is not None else None
        )

    def _bodies(self, groups: Sequence[StoredGroup]) -> List[bytes]:
        if self._db is not None:
            try:
                return self._db.bodies([g.seq for g in groups])
            except StorageError:
                self._restore()
                raise
        return [g.json() for g in groups]

    def _drop_stale(self) -> None:
        """Take groups more than ``--max-staleness`` versions behind off the queue for good."""
        stale = self.staleness.too_stale(self.step, self.queue)
        if not stale:
            return
        self.queue.remove(stale)
        self.staleness.record_drops(self.step, stale)
        self.count("stale_dropped", len(stale))
        self._commit(delete=[g.seq for g in stale])

    def _pop_batch(self) -> List[StoredGroup] | None:
        if any(e.min_batch_allocation is not None for e in self.envs):
            silent = set(self.inactive_envs())
            env_configs = [asdict(e) for e in self.envs]
            for i in silent:
                env_configs[i]["connected"] = False
            return self.queue.pop_batch_with_minimums(self.batch_size, env_configs)
        return self.queue.pop_batch(self.batch_size)
