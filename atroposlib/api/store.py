"""``RolloutStore``: the one owner of the rollout API's state, and the only way to change it.

It holds the trainer registration, the step counter, and the parts with a job
each: the env registry (:mod:`~atroposlib.api.registry`), the FIFO queue of
scored groups (:mod:`~atroposlib.api.queue`), the odd-size buffer
(:mod:`~atroposlib.api.buffer`), the unacknowledged batch
(:mod:`~atroposlib.api.delivery`) and the staleness bound
(:mod:`~atroposlib.api.staleness`). Routes call its methods and answer; the
throttling signal is computed by :func:`~atroposlib.api.throttle.env_signal` and
the answers' bytes by :mod:`~atroposlib.api.codec`. With a
:class:`~atroposlib.api.persistence.SqlitePersistence` every change is committed
before the method returns (and therefore before the HTTP answer), or deferred
to a group commit whose ticket the caller waits on.

Delivery (docs/design.md, "Delivery guarantee"): a served batch stays in the
store, in memory and in the database, until the trainer acknowledges it
(see :class:`~atroposlib.api.delivery.Delivery`). The answer carries
``batch_id`` and ``step`` for the client to de-duplicate on.

Without persistence, groups are kept as their JSON bytes; once more than
``pack_above_bytes`` of JSON is held, further groups are stored as LZ4 blocks
(:func:`~atroposlib.api.compression.pack`, about 2x smaller) and restored
when served. Environments throttle at a few batches of queued data, so in
normal operation nothing is packed; a backlog costs half of the memory.
The queue budget (``--max-queue-mb``) always counts JSON bytes.

Time (``--env-timeout``) is read from the ``clock`` passed in
(``time.monotonic`` by default), so tests move it by hand instead of sleeping.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Sequence

from atroposlib.api import codec
from atroposlib.api.buffer import OddSizeBuffer
from atroposlib.api.compression import pack
from atroposlib.api.delivery import Delivery, PendingBatch, UnknownBatchError
from atroposlib.api.errors import QueueFullError, StorageError
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import (
    Change,
    CommitTicket,
    DeferredChanges,
    GroupRow,
    SqlitePersistence,
)
from atroposlib.api.queue import GroupQueue, StoredGroup
from atroposlib.api.registry import DEFAULT_ENV_TIMEOUT, Clock, EnvRecord, EnvRegistry
from atroposlib.api.staleness import StalenessControl, histogram
from atroposlib.api.throttle import MIN_ENV_WEIGHT, env_signal, unregistered_signal

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ENV_TIMEOUT",
    "MIN_ENV_WEIGHT",
    "CommitTicket",
    "EnvRecord",
    "IncomingGroup",
    "IngestOutcome",
    "PendingBatch",
    "RolloutStore",
    "UnknownBatchError",
]

_META_KEY = "state"

DEFAULT_PACK_ABOVE_BYTES = 4 * 1024 * 1024
"""Queued JSON beyond this many bytes is kept packed in memory (``--pack-above-mb``)."""

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
"""Bound of the odd-sized group buffers (``--max-buffer-mb``)."""

COUNTERS = (
    "groups_ingested",
    "sequences_ingested",
    "batches_served",
    "sequences_served",
    "batches_resent",
    "batches_acknowledged",
    "rejected_queue_full",
    "rejected_invalid",
    "rejected_unknown_env",
    "buffer_released",
    "buffer_dropped",
    "internal_errors",
    "stale_dropped",
)
"""The counters ``/metrics`` always shows (``inconsistent_<field>`` ones appear when counted)."""

_TRAINER_KEYS = (
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


class RolloutStore:
    """Queue, env registry, trainer registration and step counter of one API server."""

    def __init__(
        self,
        max_queue_bytes: int,
        persistence: SqlitePersistence | None = None,
        pack_above_bytes: int = DEFAULT_PACK_ABOVE_BYTES,
        max_buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        env_timeout: float = DEFAULT_ENV_TIMEOUT,
        max_staleness: int | None = None,
        *,
        strict_groups: bool = False,
        clock: Clock = time.monotonic,
    ) -> None:
        self.max_queue_bytes = max_queue_bytes
        self.staleness = StalenessControl(max_staleness)
        self.pack_above_bytes = pack_above_bytes
        # The buffer never holds more than half the queue budget, so odd-sized groups
        # alone can never fill the queue and block every env with 503s.
        self.max_buffer_bytes = min(max_buffer_bytes, max_queue_bytes // 2)
        self.strict_groups = strict_groups
        """Reject optional per-token fields whose lengths differ from ``tokens`` (``--strict-groups``)."""
        self._db = persistence
        self._deferred = DeferredChanges()
        self.queue = GroupQueue()
        self.registry = EnvRegistry(env_timeout, clock)
        self.buffer = OddSizeBuffer()
        self.delivery = Delivery()
        self._next_seq = 1
        self._latest: StoredGroup | None = None
        self._counters: Dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._warned: set[tuple[int | None, str]] = set()
        self._reset_registration()
        self.max_token_len = -1
        self.checkpoint_dir: str | None = None
        self.save_checkpoint_interval = -1
        if self._db is not None:
            self._restore()

    # ----------------------------------------------------------------- state
    @property
    def counters(self) -> Mapping[str, int]:
        """The event counters ``/metrics`` renders (read-only: :meth:`count` adds to them)."""
        return MappingProxyType(self._counters)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (created at 0 the first time)."""
        self._counters[name] = self._counters.get(name, 0) + n

    def note_inconsistent(self, findings: Sequence[tuple[int | None, str]]) -> None:
        """Count accepted groups whose optional per-token fields ``(env_id, field)`` disagree
        with ``tokens`` in length; warn once per env and field (docs/design.md,
        "Per-token fields")."""
        for env_id, name in findings:
            self.count(f"inconsistent_{name}")
            if (env_id, name) not in self._warned:
                self._warned.add((env_id, name))
                logger.warning(
                    "env %s sent %s whose lengths differ from tokens; accepted as the original "
                    "API does (counted in atropos_inconsistent_groups_total; run-api "
                    "--strict-groups rejects such groups with 422). Further ones from this env "
                    "are only counted.",
                    "without env_id" if env_id is None else env_id,
                    name,
                )

    @property
    def envs(self) -> List[EnvRecord]:
        """The registered envs, by id."""
        return self.registry.envs

    @property
    def env_timeout(self) -> float:
        """Seconds of silence after which an env stops counting for ``min_batch_allocation``."""
        return self.registry.env_timeout

    @property
    def pending(self) -> PendingBatch | None:
        """The batch served last and not acknowledged yet."""
        return self.delivery.pending

    def _reset_registration(self) -> None:
        self.registered = False
        self.started = False
        self.step = 0
        self.requesters: List[int] = []
        self.registry.clear()
        self.wandb_group: str | None = None
        self.wandb_project: str | None = None
        self.batch_size = -1
        self.num_steps = -1

    def _meta(self) -> Dict[str, Any]:
        pending = self.delivery.pending
        return {
            **{key: getattr(self, key) for key in _TRAINER_KEYS},
            "requesters": [str(r) for r in self.requesters],
            "envs": [asdict(e) for e in self.envs],
            "run_token": self.delivery.run_token,
            "batches_formed": self.delivery.formed,
            "pending": pending.meta() if pending is not None else None,
        }

    def _restore(self) -> None:
        assert self._db is not None
        state = self._db.load()
        meta = state.meta.get(_META_KEY)
        pending_meta = None
        if meta:
            for key in _TRAINER_KEYS:
                setattr(self, key, meta[key])
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

    @property
    def latest(self) -> bytes | None:
        """JSON of the last group put on the queue (None before any)."""
        return None if self._latest is None else self._latest.json()

    @latest.setter
    def latest(self, body: bytes | None) -> None:
        self._latest = None if body is None else StoredGroup(-1, None, 0, body)

    @property
    def queued_bytes(self) -> int:
        """Bytes held by queued and buffered groups (the ``--max-queue-mb`` budget)."""
        return self.queue.nbytes + self.buffer.nbytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes held by the odd-sized group buffers (bounded by ``--max-buffer-mb``)."""
        return self.buffer.nbytes

    @property
    def buffered_groups(self) -> int:
        """Odd-sized groups waiting in all buffers."""
        return len(self.buffer)

    def buffered(self, env_id: int) -> List[StoredGroup]:
        """The odd-sized groups of ``env_id`` waiting to add up to its group size, oldest first."""
        return self.buffer.ordered(env_id)

    def buffer_stats(self, env_id: int) -> tuple[int, int, int]:
        """``(groups, sequences, bytes)`` buffered for ``env_id``, in O(1)."""
        return self.buffer.stats(env_id)

    def env(self, env_id: Any) -> EnvRecord:
        """The record of ``env_id``; :class:`UnknownEnvError` when there is none."""
        return self.registry.get(env_id)

    def inactive_envs(self) -> List[int]:
        """Connected envs silent for more than ``env_timeout`` s (they stop counting for
        ``min_batch_allocation`` until they post again). Logs each change."""
        return self.registry.inactive()

    # -------------------------------------------------------- registration
    def register_trainer(self, reg: Registration) -> int:
        """Register a trainer; only the first registration (since start or reset) sets the config."""
        if not self.registered:
            self.registered = True
            self.started = False
            self.registry.clear()
            self.wandb_group, self.wandb_project = reg.wandb_group, reg.wandb_project
            self.batch_size, self.max_token_len = reg.batch_size, reg.max_token_len
            self.checkpoint_dir = reg.checkpoint_dir
            self.save_checkpoint_interval = reg.save_checkpoint_interval
            self.num_steps, self.step = reg.num_steps, reg.starting_step
        requester = uuid.uuid4().int
        self.requesters.append(requester)
        self._commit(meta={_META_KEY: self._meta()})
        return requester

    def register_env(self, req: RegisterEnv) -> Dict[str, Any] | None:
        """Add an env record; None while the trainer has not polled /batch yet."""
        if not self.started:
            return None
        record = self.registry.add(req)
        self._commit(meta={_META_KEY: self._meta()})
        return {
            "status": "success",
            "env_id": record.registered_id,
            "wandb_name": record.real_name,
            "checkpoint_dir": self.checkpoint_dir,
            "starting_step": self.step,
            "checkpoint_interval": self.save_checkpoint_interval,
            "num_steps": self.num_steps,
        }

    def disconnect_env(self, env_id: int) -> None:
        """Mark an env disconnected (its record and id stay)."""
        self.registry.disconnect(env_id)
        self._commit(meta={_META_KEY: self._meta()})

    def reset(self) -> None:
        """Forget queue, buffers, envs, registration and the unacknowledged batch.

        ``max_token_len``, checkpoint settings and ``latest`` stay (as in the
        original); batch ids keep counting up, so a client never mistakes a
        batch formed after the reset for one it already has.
        """
        self.queue.clear()
        self.staleness.forget_all()
        self.buffer.clear()
        self.delivery.pending = None
        self._reset_registration()
        self._commit(clear_groups=True, meta={_META_KEY: self._meta()})

    # ------------------------------------------------------------ ingest
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

    # ------------------------------------------------------------- batches
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
                self._commit(delete=[g.seq for g in consume], meta={_META_KEY: self._meta()})
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
                    [g.seq for g in consume], [g.seq for g in batch], {_META_KEY: self._meta()}
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
        self._commit(delete=[g.seq for g in consumed], meta={_META_KEY: self._meta()})
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

    # -------------------------------------------------------------- status
    def status(self) -> Dict[str, Any]:
        """``GET /status``: the original's two keys plus buffer, batch and env activity."""
        return {
            "current_step": self.step,
            "queue_size": len(self.queue),
            "buffered_groups": len(self.buffer),
            "buffered_bytes": self.buffer.nbytes,
            "unacknowledged_batch": self.pending.batch_id if self.pending else None,
            "inactive_envs": self.inactive_envs(),
        }

    def _version_status(self) -> Dict[str, Any]:
        """The current policy version (the step) and, when set, ``--max-staleness``."""
        out: Dict[str, Any] = {"current_version": self.step}
        if self.staleness.max_staleness is not None:
            out["max_staleness"] = self.staleness.max_staleness
        return out

    def env_status(self, env_id: int) -> Dict[str, Any]:
        """The throttling signal of one env (see :mod:`~atroposlib.api.throttle`); an env's
        group size that grew to its largest queued group is kept."""
        if not self.registered:
            return {**unregistered_signal(self.step), **self._version_status()}
        self.registry.get(env_id)
        signal = env_signal(
            env_id,
            self.envs,
            self.queue.per_env,
            self.queue.max_group_size,
            self.batch_size,
            set(self.inactive_envs()),
            self.step,
            self.buffer.stats(env_id)[0],
        )
        if self.registry.grow_group_size(env_id, signal.group_size):
            self._commit(meta={_META_KEY: self._meta()})
        return {**signal.answer, **self._version_status()}
