"""The rollout store's durable state: what it saves, commits and reloads.

:class:`DurableState` is the part of :class:`~atroposlib.api.store.RolloutStore` that
talks to its :class:`~atroposlib.api.persistence.SqlitePersistence` (``store._db``):
the registration and env records saved as one meta row (:meth:`~DurableState._meta`),
each change committed before the store's method returns (:meth:`~DurableState._commit`)
or deferred to a group commit (:meth:`~DurableState.flush`), and the whole state
reloaded from the database at start and after a failed commit
(:meth:`~DurableState._restore`), so memory always matches what is on disk.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from atroposlib.api.delivery import Delivery, PendingBatch
from atroposlib.api.errors import StorageError
from atroposlib.api.persistence import Change, CommitTicket, DeferredChanges, SqlitePersistence
from atroposlib.api.queue import GroupQueue, StoredGroup

if TYPE_CHECKING:
    from atroposlib.api.buffer import OddSizeBuffer
    from atroposlib.api.registry import EnvRecord, EnvRegistry
    from atroposlib.api.staleness import StalenessControl

# The store's own logger: the store logs under one name, whichever part of it speaks.
logger = logging.getLogger("atroposlib.api.store")

__all__ = ["META_KEY", "TRAINER_KEYS", "DurableState"]

META_KEY = "state"
"""The key of the meta row that holds the registration, env records and delivery state."""

TRAINER_KEYS = (
    "registered",
    "started",
    "step",
    "wandb_group",
    "wandb_project",
    "batch_size",
    "num_steps",
    "max_token_len",
    "checkpoint_dir",
    "save_checkpoint_interval",
)
"""The store attributes a trainer's registration sets, saved and restored as they are."""


class DurableState:
    """Saving, committing and reloading of :class:`~atroposlib.api.store.RolloutStore` (a
    base class of it; the attributes below are the store's)."""

    _db: SqlitePersistence | None
    _deferred: DeferredChanges
    _next_seq: int
    _latest: StoredGroup | None
    queue: GroupQueue
    buffer: OddSizeBuffer
    delivery: Delivery
    registry: EnvRegistry
    staleness: StalenessControl
    requesters: List[int]
    step: int
    vocab_size: int | None

    if TYPE_CHECKING:

        @property
        def envs(self) -> List[EnvRecord]: ...

        @property
        def pending(self) -> PendingBatch | None: ...

        @property
        def latest(self) -> bytes | None: ...

        @latest.setter
        def latest(self, body: bytes | None) -> None: ...

    def _meta(self) -> Dict[str, Any]:
        pending = self.delivery.pending
        return {
            **{key: getattr(self, key) for key in TRAINER_KEYS},
            "vocab_size": self.vocab_size,
            "requesters": [str(r) for r in self.requesters],
            "envs": [asdict(e) for e in self.envs],
            "run_token": self.delivery.run_token,
            "batches_formed": self.delivery.formed,
            "pending": pending.meta() if pending is not None else None,
        }

    def _restore(self) -> None:
        assert self._db is not None
        state = self._db.load()
        meta = state.meta.get(META_KEY)
        pending_meta = None
        if meta:
            for key in TRAINER_KEYS:
                setattr(self, key, meta[key])
            self.vocab_size = meta.get("vocab_size")  # absent in databases of older versions
            self.requesters = [int(r) for r in meta["requesters"]]
            self.registry.restore(meta["envs"])
            self.delivery.run_token = meta.get("run_token") or self.delivery.run_token
            self.delivery.formed = meta.get("batches_formed", 0)
            pending_meta = meta.get("pending")
        else:
            self.registry.restore(None)
        self.queue.clear()
        self.staleness.forget_all()
        self.buffer.clear()
        self.delivery.pending = None
        in_batch = {seq: None for seq in pending_meta["seqs"]} if pending_meta else {}
        last_queued: int | None = None
        for row in state.groups:
            g = StoredGroup(row.seq, row.env_id, row.size, None, row.nbytes)
            if row.seq in in_batch:
                in_batch[row.seq] = g
            elif row.buffered and row.env_id is not None:
                self.buffer.add(g)
            else:
                self.queue.append(g)
                last_queued = g.seq
            self._next_seq = max(self._next_seq, row.seq + 1)
        if pending_meta:
            groups = [g for g in in_batch.values() if g is not None]
            if len(groups) != len(in_batch):
                raise StorageError(
                    f"the unacknowledged batch {pending_meta['batch_id']} lists groups missing "
                    f"from {self._db.path}"
                )
            # Served before the restart, maybe never received: serve it again, once, even
            # to a client that does not acknowledge.
            self.delivery.pending = PendingBatch(
                pending_meta["batch_id"], pending_meta["step"], groups, live=False
            )
        if last_queued is not None:
            self.latest = self._db.body(last_queued)
        logger.info(
            "restored %d queued groups, %d buffered, %d envs, step %d%s from %s",
            len(self.queue),
            len(self.buffer),
            len(self.envs),
            self.step,
            f", unacknowledged batch {self.pending.batch_id}" if self.pending else "",
            self._db.path,
        )

    def _commit(self, **changes: Any) -> None:
        """Persist one change (after any deferred ones, in the same transaction); on failure
        reload the durable state so memory matches it."""
        if self._db is None:
            return
        self._write([Change(**changes)])

    def _write(self, changes: List[Change]) -> None:
        deferred, ticket, groups = self._deferred.take()
        assert self._db is not None
        try:
            self._db.commit_many(deferred + changes)
        except Exception as e:
            if ticket is not None:  # the deferred posts must hear of any failure, not only SQLite's
                ticket.error = (
                    e if isinstance(e, StorageError) else StorageError(f"commit failed: {e!r}")
                )
            self._restore()  # memory must match what the database holds
            raise
        finally:
            if ticket is not None:
                ticket.done = True
        self._release_bodies(groups)

    def flush(self) -> None:
        """Commit the changes of ``ingest(..., defer=True)`` calls not committed yet (one
        transaction for all of them). Raises :class:`StorageError` when the commit fails;
        the state is then reloaded from the database, without those groups, and their
        :attr:`pending_ticket` carries the error."""
        if self._deferred:
            self._write([])

    @property
    def pending_ticket(self) -> CommitTicket | None:
        """The ticket of the deferred changes not committed yet (None when there are none)."""
        return self._deferred.ticket

    def _release_bodies(self, groups: Sequence[StoredGroup]) -> None:
        """The database holds these groups' bytes now; memory keeps the ints."""
        for stored in groups:
            if self._latest is stored:
                self._latest = StoredGroup(-1, None, 0, stored.body, fill=stored.fill)
            stored.body = None

    def close(self) -> None:
        """Commit what is deferred and release the persistence layer."""
        if self._db is not None:
            try:
                self.flush()
            finally:
                self._db.close()
