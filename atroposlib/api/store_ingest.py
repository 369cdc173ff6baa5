"""Storing posted groups: onto the queue, or into their env's odd-size buffer.

:class:`StoreIngest` is the part of :class:`~atroposlib.api.store.RolloutStore` behind
``POST /scored_data`` and ``/scored_data_list``: :meth:`~StoreIngest.ingest` stores a
post's groups all or none, within the queue budget (``--max-queue-mb``); a group smaller
than its env's group size waits in the buffer until buffered groups add up to it, and the
buffer is kept under ``--max-buffer-mb`` (oldest first). Without persistence, JSON beyond
``pack_above_bytes`` is kept as LZ4 blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Sequence

from atroposlib.api import codec
from atroposlib.api.compression import pack
from atroposlib.api.errors import QueueFullError
from atroposlib.api.persistence import Change, GroupRow
from atroposlib.api.queue import StoredGroup
from atroposlib.api.store_state import DurableState

# The store's own logger: the store logs under one name, whichever part of it speaks.
logger = logging.getLogger("atroposlib.api.store")

__all__ = ["IncomingGroup", "IngestOutcome", "StoreIngest"]


@dataclass(frozen=True)
class IncomingGroup:
    """A validated group ready to store: sender, sequence count, canonical JSON bytes."""

    env_id: int | None
    size: int
    body: bytes
    version: int | None = None
    fill: bytes = b""
    """The ``"field":null,`` bytes of the absent fields (see :func:`~atroposlib.api.codec.canonical_json`)."""


@dataclass(frozen=True)
class IngestOutcome:
    """Where one posted group went: ``received`` (queue) or ``buffered`` (with the buffer's size)."""

    status: str
    buffer_size: int = 0


_RECEIVED = IngestOutcome("received")


class StoreIngest(DurableState):
    """Ingest of :class:`~atroposlib.api.store.RolloutStore` (a base class of it)."""

    max_queue_bytes: int
    pack_above_bytes: int
    max_buffer_bytes: int

    if TYPE_CHECKING:

        @property
        def queued_bytes(self) -> int: ...

        def count(self, name: str, n: int = 1) -> None: ...

    def ingest(self, groups: Sequence[IncomingGroup], defer: bool = False) -> List[IngestOutcome]:
        """Store posted groups (all or none): onto the queue, or into their env's buffer.

        Raises :class:`UnknownEnvError` for an unregistered ``env_id`` and
        :class:`QueueFullError` when the queue budget would be exceeded (an
        empty queue always accepts, so one large post cannot starve forever).

        With persistence and ``defer``, the database change is not committed
        here but by the next :meth:`flush` (or any other commit, which includes
        it first): the caller answers its client only once
        :attr:`pending_ticket` is done without error.
        """
        for g in groups:
            if g.env_id is not None:
                self.registry.get(g.env_id)
        incoming = sum(len(g.body) + len(g.fill) for g in groups)
        used = self.queued_bytes
        if used and used + incoming > self.max_queue_bytes:
            self.count("rejected_queue_full")
            raise QueueFullError(used, self.max_queue_bytes)
        inserts: List[GroupRow] = []
        moves: List[tuple[int, int]] = []
        drops: List[int] = []
        outcomes: List[IngestOutcome] = []
        created: List[StoredGroup] = []
        # In memory, JSON beyond the pack threshold is stored as LZ4 blocks: ~13 µs per
        # group buy a queue half the size (the RSS target).
        held = used
        persist = self._db is not None
        envs = self.envs
        for g in groups:
            nbytes = len(g.body) + len(g.fill)
            held += nbytes
            packed = not persist and held > self.pack_above_bytes
            stored = StoredGroup(
                self._next_seq,
                g.env_id,
                g.size,
                pack(g.body) if packed else g.body,
                nbytes,
                packed=packed,
                version=g.version,
                fill=g.fill,
            )
            created.append(stored)
            self._next_seq += 1
            if g.env_id is not None:
                self.registry.seen(g.env_id)
            target = envs[g.env_id].group_size if g.env_id is not None else g.size
            if g.size == target:
                if persist:
                    inserts.append(
                        GroupRow(
                            stored.seq,
                            g.env_id,
                            g.size,
                            False,
                            codec.canonical_json(g.body, g.fill),
                        )
                    )
                self._enqueue(stored)
                outcomes.append(_RECEIVED)
                continue
            if persist:
                inserts.append(
                    GroupRow(
                        stored.seq, g.env_id, g.size, True, codec.canonical_json(g.body, g.fill)
                    )
                )
            outcomes.append(IngestOutcome("buffered", self._buffer(stored, target, moves)))
        if self.buffer.nbytes > self.max_buffer_bytes:
            self._shrink_buffer(moves, drops)
        # A group inserted and dropped in the same post never needs a row.
        dropped_now = {s for s in drops if s >= created[0].seq} if created else set()
        if dropped_now:
            inserts = [r for r in inserts if r.seq not in dropped_now]
            drops = [s for s in drops if s not in dropped_now]
        if persist and defer:
            self._deferred.add(Change(insert=inserts, move_to_queue=moves, delete=drops), created)
        else:
            self._commit(insert=inserts, move_to_queue=moves, delete=drops)
            self._release_bodies(created if persist else ())
        self.count("groups_ingested", len(groups))
        self.count("sequences_ingested", sum(g.size for g in groups))
        return outcomes

    def _enqueue(self, g: StoredGroup) -> None:
        self.queue.append(g)
        self.staleness.track(g)
        if g.body is not None:
            self._latest = g

    def _to_queue(self, g: StoredGroup, moves: List[tuple[int, int]]) -> None:
        """Move a buffered group to the queue's tail under a new queue position."""
        if g.body is None and self._db is not None:  # its bytes are only on disk
            self.latest = self._db.body(g.seq)
        moves.append((g.seq, self._next_seq))
        g.seq = self._next_seq
        self._next_seq += 1
        self._enqueue(g)

    def _buffer(self, g: StoredGroup, target: int, moves: List[tuple[int, int]]) -> int:
        """Buffer an odd-sized group; flush buffered groups that add up to ``target``."""
        assert g.env_id is not None
        if g.size > target:
            logger.warning(
                "env %d sent a group of %d sequences, larger than its group_size %d: "
                "it stays buffered until the group size grows",
                g.env_id,
                g.size,
                target,
            )
        flushed, left = self.buffer.match(g, target)
        for done in flushed:
            self._to_queue(done, moves)
        return left

    def _shrink_buffer(self, moves: List[tuple[int, int]], drops: List[int]) -> None:
        """Bring the buffers back under ``--max-buffer-mb``, oldest group first.

        A group whose size divides its env's group size is released onto the
        queue as a whole group of its own size (it packs with others of that
        size); any other size could never be packed into a batch, so it is
        dropped, logged and counted (``atropos_buffer_dropped_total``).
        """
        envs = self.envs
        for oldest, target, release in self.buffer.evict(
            self.max_buffer_bytes, lambda env_id: envs[env_id].group_size
        ):
            if release:
                self.count("buffer_released")
                logger.warning(
                    "buffer over --max-buffer-mb: released env %d's oldest buffered group "
                    "(%d sequences, group_size %d) onto the queue as a group of its own",
                    oldest.env_id,
                    oldest.size,
                    target,
                )
                self._to_queue(oldest, moves)
            else:
                self.count("buffer_dropped")
                logger.warning(
                    "buffer over --max-buffer-mb: dropped env %d's oldest buffered group "
                    "(%d sequences cannot be packed with group_size %d; reason: buffer_full)",
                    oldest.env_id,
                    oldest.size,
                    target,
                )
                drops.append(oldest.seq)
