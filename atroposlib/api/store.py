"""``RolloutStore``: the one owner of the rollout API's state.

It holds the trainer registration, the env registry, the FIFO queue of scored
groups, the per-env buffers of odd-sized groups, the step counter and the
batch last served but not yet acknowledged. Its methods are the only way to
change that state; routes call them and answer. With a
:class:`~atroposlib.api.persistence.SqlitePersistence` every change is
committed before the method returns (and therefore before the HTTP answer).

Delivery (SPEC D19): a served batch stays in the store, in memory and in the
database, until the trainer acknowledges it: explicitly (``GET
/batch?ack=ID`` or ``POST /batch/ack``), or implicitly by its next ``GET
/batch`` without ``ack`` (the original's clients). Until then it is served
again, byte for byte, to a client that did not acknowledge it, so a batch lost
in transit (a crash of the server while answering, or of the trainer before it
trained) is not lost. The answer carries ``batch_id`` and ``step`` for the
client to de-duplicate on.

Without persistence, groups are kept as their JSON bytes; once more than
``pack_above_bytes`` of JSON is held, further groups are stored as LZ4 blocks
(:func:`~atroposlib.api.compression.pack`, about 2x smaller) and restored
when served. Environments throttle at a few batches of queued data, so in
normal operation nothing is packed; a backlog costs half of the memory.
The queue budget (``--max-queue-mb``) always counts JSON bytes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import secrets
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Sequence

from atroposlib.api.compression import pack
from atroposlib.api.errors import ApiError, QueueFullError, StorageError, UnknownEnvError
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import Change, GroupRow, SqlitePersistence
from atroposlib.api.queue import GroupQueue, StoredGroup, canonical_json
from atroposlib.api.staleness import StalenessControl, histogram
from atroposlib.api.utils import find_groups_summing_to_target

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_ENV_TIMEOUT",
    "MIN_ENV_WEIGHT",
    "EnvRecord",
    "IncomingGroup",
    "PendingBatch",
    "RolloutStore",
    "UnknownBatchError",
]

MIN_ENV_WEIGHT = 0.01
"""Floor of the ``env_weight`` that ``/status-env`` reports."""

_META_KEY = "state"
_BATCH_NUMBER = re.compile(r"[1-9][0-9]{0,17}")
"""The number of a ``batch_id`` as this server writes it (ASCII, canonical, bounded)."""

DEFAULT_PACK_ABOVE_BYTES = 4 * 1024 * 1024
"""Queued JSON beyond this many bytes is kept packed in memory (``--pack-above-mb``)."""

DEFAULT_BUFFER_BYTES = 64 * 1024 * 1024
"""Bound of the odd-sized group buffers (``--max-buffer-mb``)."""

DEFAULT_ENV_TIMEOUT = 300.0
"""Seconds of silence after which an env stops counting for ``min_batch_allocation``."""


class UnknownBatchError(ApiError):
    """A ``batch_id`` this server never served (404)."""

    status_code = 404

    def __init__(self, batch_id: str) -> None:
        shown = batch_id if len(batch_id) <= 80 else batch_id[:80] + "..."
        super().__init__(
            f"unknown batch_id {shown!r}: acknowledge the batch_id of the last /batch answer"
        )


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


@dataclass(frozen=True)
class IncomingGroup:
    """A validated group ready to store: sender, sequence count, canonical JSON bytes."""

    env_id: int | None
    size: int
    body: bytes
    version: int | None = None
    fill: bytes = b""
    """The ``"field":null,`` bytes of the absent fields (see :func:`~atroposlib.api.queue.canonical_json`)."""


class CommitTicket:
    """Whether the deferred changes of some ``ingest(..., defer=True)`` calls are committed:
    ``done`` once a commit included them (or failed), ``error`` its :class:`StorageError`."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: StorageError | None = None


@dataclass(frozen=True)
class IngestOutcome:
    """Where one posted group went: ``received`` (queue) or ``buffered`` (with the buffer's size)."""

    status: str
    buffer_size: int = 0


_RECEIVED = IngestOutcome("received")


@dataclass
class PendingBatch:
    """The batch served last and not acknowledged yet; ``live`` once this process served it."""

    batch_id: str
    step: int
    groups: List[StoredGroup]
    live: bool = True
    staleness: Dict[str, int] | None = None

    def meta(self) -> Dict[str, Any]:
        return {
            "batch_id": self.batch_id,
            "step": self.step,
            "seqs": [g.seq for g in self.groups],
        }


@dataclass
class _EnvBuffer:
    """One env's odd-sized groups, per size in arrival order, with running totals."""

    by_size: Dict[int, Deque[StoredGroup]] = field(default_factory=dict)
    groups: int = 0
    sequences: int = 0
    nbytes: int = 0

    def add(self, g: StoredGroup) -> None:
        self.by_size.setdefault(g.size, deque()).append(g)
        self.groups += 1
        self.sequences += g.size
        self.nbytes += g.nbytes

    def remove(self, g: StoredGroup) -> None:
        bucket = self.by_size[g.size]
        if bucket[0] is g:
            bucket.popleft()
        else:
            bucket.remove(g)
        if not bucket:
            del self.by_size[g.size]
        self.groups -= 1
        self.sequences -= g.size
        self.nbytes -= g.nbytes

    def candidates(self, target: int) -> List[StoredGroup]:
        """The groups that can take part in a sum to ``target``, oldest first.

        Of each size ``s`` only the oldest ``target // s`` groups can: more
        would overshoot. On these the original's choice
        (:func:`find_groups_summing_to_target`: greedy in FIFO order, then the
        oldest-preferring subset sum) is the same as on the whole buffer, since
        the groups left out never change which sums are reachable. So matching
        costs O(target log target) per post, however many groups wait.
        """
        picked: List[StoredGroup] = []
        for size, bucket in self.by_size.items():
            if size <= target:
                picked.extend(itertools.islice(bucket, target // size))
        picked.sort(key=lambda g: g.seq)
        return picked

    def ordered(self) -> List[StoredGroup]:
        return sorted(itertools.chain.from_iterable(self.by_size.values()), key=lambda g: g.seq)


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
    ) -> None:
        self.max_queue_bytes = max_queue_bytes
        self.staleness = StalenessControl(max_staleness)
        self.pack_above_bytes = pack_above_bytes
        # The buffer never holds more than half the queue budget, so odd-sized groups
        # alone can never fill the queue and block every env with 503s.
        self.max_buffer_bytes = min(max_buffer_bytes, max_queue_bytes // 2)
        self.env_timeout = env_timeout
        self._db = persistence
        self._deferred: List[Change] = []
        self._deferred_groups: List[StoredGroup] = []
        self._ticket: CommitTicket | None = None
        self.queue = GroupQueue()
        self._buffers: Dict[int, _EnvBuffer] = {}
        self._buffer_order: OrderedDict[int, StoredGroup] = OrderedDict()
        self._buffer_bytes = 0
        self._next_seq = 1
        self._latest: StoredGroup | None = None
        self.pending: PendingBatch | None = None
        self._run_token = secrets.token_hex(4)
        self._batches_formed = 0
        self._last_seen: Dict[int, float] = {}
        self._inactive: set[int] = set()
        self.counters: Dict[str, int] = {
            "groups_ingested": 0,
            "sequences_ingested": 0,
            "batches_served": 0,
            "sequences_served": 0,
            "batches_resent": 0,
            "batches_acknowledged": 0,
            "rejected_queue_full": 0,
            "rejected_invalid": 0,
            "rejected_unknown_env": 0,
            "buffer_released": 0,
            "buffer_dropped": 0,
            "internal_errors": 0,
            "stale_dropped": 0,
        }
        self._reset_registration()
        self.max_token_len = -1
        self.checkpoint_dir: str | None = None
        self.save_checkpoint_interval = -1
        if self._db is not None:
            self._restore()

    # ----------------------------------------------------------------- state
    def _reset_registration(self) -> None:
        self.registered = False
        self.started = False
        self.step = 0
        self.requesters: List[int] = []
        self.envs: List[EnvRecord] = []
        self.wandb_group: str | None = None
        self.wandb_project: str | None = None
        self.batch_size = -1
        self.num_steps = -1
        self._last_seen.clear()
        self._inactive.clear()

    def _meta(self) -> Dict[str, Any]:
        return {
            "registered": self.registered,
            "started": self.started,
            "step": self.step,
            "requesters": [str(r) for r in self.requesters],
            "envs": [asdict(e) for e in self.envs],
            "wandb_group": self.wandb_group,
            "wandb_project": self.wandb_project,
            "batch_size": self.batch_size,
            "num_steps": self.num_steps,
            "max_token_len": self.max_token_len,
            "checkpoint_dir": self.checkpoint_dir,
            "save_checkpoint_interval": self.save_checkpoint_interval,
            "run_token": self._run_token,
            "batches_formed": self._batches_formed,
            "pending": self.pending.meta() if self.pending is not None else None,
        }

    def _restore(self) -> None:
        assert self._db is not None
        state = self._db.load()
        meta = state.meta.get(_META_KEY)
        pending_meta = None
        if meta:
            for key in (
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
            ):
                setattr(self, key, meta[key])
            self.requesters = [int(r) for r in meta["requesters"]]
            self.envs = [EnvRecord(**e) for e in meta["envs"]]
            self._run_token = meta.get("run_token") or self._run_token
            self._batches_formed = meta.get("batches_formed", 0)
            pending_meta = meta.get("pending")
        self.queue.clear()
        self.staleness.forget_all()
        self._buffers.clear()
        self._buffer_order.clear()
        self._buffer_bytes = 0
        self.pending = None
        in_batch = {seq: None for seq in pending_meta["seqs"]} if pending_meta else {}
        last_queued: int | None = None
        for row in state.groups:
            g = StoredGroup(row.seq, row.env_id, row.size, None, row.nbytes)
            if row.seq in in_batch:
                in_batch[row.seq] = g
            elif row.buffered and row.env_id is not None:
                self._add_to_buffer(g)
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
            self.pending = PendingBatch(
                pending_meta["batch_id"], pending_meta["step"], groups, live=False
            )
        if last_queued is not None:
            self.latest = self._db.body(last_queued)
        now = time.monotonic()
        self._last_seen = {i: now for i in range(len(self.envs))}
        logger.info(
            "restored %d queued groups, %d buffered, %d envs, step %d%s from %s",
            len(self.queue),
            len(self._buffer_order),
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
        deferred, ticket, groups = self._deferred, self._ticket, self._deferred_groups
        self._deferred, self._ticket, self._deferred_groups = [], None, []
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
        return self._ticket

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
        return self.queue.nbytes + self._buffer_bytes

    @property
    def buffered_bytes(self) -> int:
        """Bytes held by the odd-sized group buffers (bounded by ``--max-buffer-mb``)."""
        return self._buffer_bytes

    @property
    def buffered_groups(self) -> int:
        """Odd-sized groups waiting in all buffers."""
        return len(self._buffer_order)

    def buffered(self, env_id: int) -> List[StoredGroup]:
        """The odd-sized groups of ``env_id`` waiting to add up to its group size, oldest first."""
        buf = self._buffers.get(env_id)
        return buf.ordered() if buf is not None else []

    def buffer_stats(self, env_id: int) -> tuple[int, int, int]:
        """``(groups, sequences, bytes)`` buffered for ``env_id``, in O(1)."""
        buf = self._buffers.get(env_id)
        return (buf.groups, buf.sequences, buf.nbytes) if buf is not None else (0, 0, 0)

    def env(self, env_id: Any) -> EnvRecord:
        """The record of ``env_id``; :class:`UnknownEnvError` when there is none."""
        if (
            not isinstance(env_id, int)
            or isinstance(env_id, bool)
            or not 0 <= env_id < len(self.envs)
        ):
            raise UnknownEnvError(env_id)
        return self.envs[env_id]

    # ------------------------------------------------------------ activity
    def inactive_envs(self) -> List[int]:
        """Connected envs silent for more than ``env_timeout`` s (they stop counting for
        ``min_batch_allocation`` until they post again). Logs each change."""
        if self.env_timeout <= 0:
            return []
        now = time.monotonic()
        silent: List[int] = []
        for i, e in enumerate(self.envs):
            quiet = e.connected and now - self._last_seen.get(i, now) > self.env_timeout
            if quiet:
                silent.append(i)
                if i not in self._inactive:
                    self._inactive.add(i)
                    logger.warning(
                        "env %d (%s) has not posted for %.0f s (--env-timeout): it no longer "
                        "counts for min_batch_allocation until it posts again",
                        i,
                        e.real_name,
                        now - self._last_seen.get(i, now),
                    )
        return silent

    def _seen(self, env_id: int) -> None:
        self._last_seen[env_id] = time.monotonic()
        if env_id in self._inactive:
            self._inactive.discard(env_id)
            logger.info("env %d posted again: it counts for min_batch_allocation again", env_id)

    # -------------------------------------------------------- registration
    def register_trainer(self, reg: Registration) -> int:
        """Register a trainer; only the first registration (since start or reset) sets the config."""
        if not self.registered:
            self.registered = True
            self.started = False
            self.envs = []
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
        same_name = sum(1 for e in self.envs if e.desired_name == req.desired_name)
        env_id = len(self.envs)
        record = EnvRecord(
            max_context_len=req.max_token_length,
            weight=req.weight,
            desired_name=req.desired_name,
            real_name=f"{req.desired_name}_{same_name}",
            registered_id=env_id,
            last_update=time.time(),
            connected=True,
            min_batch_allocation=req.min_batch_allocation,
            group_size=req.group_size,
        )
        self.envs.append(record)
        self._last_seen[env_id] = time.monotonic()
        self._commit(meta={_META_KEY: self._meta()})
        return {
            "status": "success",
            "env_id": env_id,
            "wandb_name": record.real_name,
            "checkpoint_dir": self.checkpoint_dir,
            "starting_step": self.step,
            "checkpoint_interval": self.save_checkpoint_interval,
            "num_steps": self.num_steps,
        }

    def disconnect_env(self, env_id: int) -> None:
        """Mark an env disconnected (its record and id stay)."""
        self.env(env_id).connected = False
        self._inactive.discard(env_id)
        self._commit(meta={_META_KEY: self._meta()})

    def reset(self) -> None:
        """Forget queue, buffers, envs, registration and the unacknowledged batch.

        ``max_token_len``, checkpoint settings and ``latest`` stay (as in the
        original); batch ids keep counting up, so a client never mistakes a
        batch formed after the reset for one it already has.
        """
        self.queue.clear()
        self.staleness.forget_all()
        self._buffers.clear()
        self._buffer_order.clear()
        self._buffer_bytes = 0
        self.pending = None
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
                self.env(g.env_id)
        incoming = sum(len(g.body) + len(g.fill) for g in groups)
        used = self.queued_bytes
        if used and used + incoming > self.max_queue_bytes:
            self.counters["rejected_queue_full"] += 1
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
                self._seen(g.env_id)
            target = self.envs[g.env_id].group_size if g.env_id is not None else g.size
            if g.size == target:
                if persist:
                    inserts.append(
                        GroupRow(
                            stored.seq, g.env_id, g.size, False, canonical_json(g.body, g.fill)
                        )
                    )
                self._enqueue(stored)
                outcomes.append(_RECEIVED)
                continue
            if persist:
                inserts.append(
                    GroupRow(stored.seq, g.env_id, g.size, True, canonical_json(g.body, g.fill))
                )
            outcomes.append(IngestOutcome("buffered", self._buffer(stored, target, moves)))
        if self._buffer_bytes > self.max_buffer_bytes:
            self._shrink_buffer(moves, drops)
        # A group inserted and dropped in the same post never needs a row.
        dropped_now = {s for s in drops if s >= created[0].seq} if created else set()
        if dropped_now:
            inserts = [r for r in inserts if r.seq not in dropped_now]
            drops = [s for s in drops if s not in dropped_now]
        if persist and defer:
            self._deferred.append(Change(insert=inserts, move_to_queue=moves, delete=drops))
            self._deferred_groups.extend(created)
            if self._ticket is None:
                self._ticket = CommitTicket()
        else:
            self._commit(insert=inserts, move_to_queue=moves, delete=drops)
            self._release_bodies(created if persist else ())
        self.counters["groups_ingested"] += len(groups)
        self.counters["sequences_ingested"] += sum(g.size for g in groups)
        return outcomes

    def _enqueue(self, g: StoredGroup) -> None:
        self.queue.append(g)
        self.staleness.track(g)
        if g.body is not None:
            self._latest = g

    def _add_to_buffer(self, g: StoredGroup) -> None:
        assert g.env_id is not None
        buf = self._buffers.get(g.env_id)
        if buf is None:
            buf = self._buffers[g.env_id] = _EnvBuffer()
        buf.add(g)
        self._buffer_order[g.seq] = g
        self._buffer_bytes += g.nbytes

    def _take_from_buffer(self, g: StoredGroup) -> None:
        assert g.env_id is not None
        buf = self._buffers[g.env_id]
        buf.remove(g)
        if not buf.groups:
            del self._buffers[g.env_id]
        del self._buffer_order[g.seq]
        self._buffer_bytes -= g.nbytes

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
        self._add_to_buffer(g)
        buf = self._buffers[g.env_id]
        candidates = buf.candidates(target)
        picked = find_groups_summing_to_target(
            [{"tokens": range(c.size)} for c in candidates], target
        )
        for i in picked:
            flushed = candidates[i]
            self._take_from_buffer(flushed)
            self._to_queue(flushed, moves)
        return buf.sequences if g.env_id in self._buffers else 0

    def _shrink_buffer(self, moves: List[tuple[int, int]], drops: List[int]) -> None:
        """Bring the buffers back under ``--max-buffer-mb``, oldest group first.

        A group whose size divides its env's group size is released onto the
        queue as a whole group of its own size (it packs with others of that
        size); any other size could never be packed into a batch, so it is
        dropped, logged and counted (``atropos_buffer_dropped_total``).
        """
        while self._buffer_bytes > self.max_buffer_bytes and self._buffer_order:
            oldest = next(iter(self._buffer_order.values()))
            self._take_from_buffer(oldest)
            assert oldest.env_id is not None
            target = self.envs[oldest.env_id].group_size
            if oldest.size < target and target % oldest.size == 0:
                self.counters["buffer_released"] += 1
                logger.warning(
                    "buffer over --max-buffer-mb: released env %d's oldest buffered group "
                    "(%d sequences, group_size %d) onto the queue as a group of its own",
                    oldest.env_id,
                    oldest.size,
                    target,
                )
                self._to_queue(oldest, moves)
            else:
                self.counters["buffer_dropped"] += 1
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
        pending = self.pending
        consume: List[StoredGroup] = []
        if pending is not None:
            acked = pending.live if ack is None else ack == pending.batch_id
            if not acked:
                pending.live = True
                self.counters["batches_resent"] += 1
                logger.info("serving unacknowledged batch %s again", pending.batch_id)
                return self._bodies(pending.groups), pending.batch_id, pending.step
            consume = pending.groups
            self.pending = None
            self.counters["batches_acknowledged"] += 1
        self._drop_stale()
        batch = self._pop_batch()
        if batch is None:
            if consume or newly_started:
                self._commit(delete=[g.seq for g in consume], meta={_META_KEY: self._meta()})
            return None
        self.step += 1
        self._batches_formed += 1
        pending = self.pending = PendingBatch(
            f"{self._run_token}-{self._batches_formed}", self.step, batch
        )
        if self.staleness.max_staleness is not None or any(g.version is not None for g in batch):
            pending.staleness = histogram(self.step - 1, batch)
        self.counters["batches_served"] += 1
        sequences = sum(g.size for g in batch)
        self.counters["sequences_served"] += sequences
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
        pending = self.pending
        if pending is not None and batch_id == pending.batch_id:
            self.pending = None
            self.counters["batches_acknowledged"] += 1
            self._commit(delete=[g.seq for g in pending.groups], meta={_META_KEY: self._meta()})
            return "acknowledged"
        token, _, number = batch_id.rpartition("-")
        # Only the form this server writes: ASCII digits without a leading zero, at most 18 of
        # them (``isdigit`` also accepts '²' and '١', and "01" would pass for batch 1 while
        # batch 1 is still pending).
        if (
            token == self._run_token
            and _BATCH_NUMBER.fullmatch(number)
            and int(number) <= self._batches_formed
        ):
            return "already acknowledged"
        raise UnknownBatchError(batch_id)

    def batch_answer(self, ack: str | None) -> bytes:
        """The ``GET /batch`` JSON: ``{"batch":[...],"batch_id":...,"step":...}`` or ``{"batch":null}``."""
        served = self.serve_batch(ack)
        if served is None:
            return b'{"batch":null}'
        bodies, batch_id, step = served
        tail = b'],"batch_id":' + json.dumps(batch_id).encode() + b',"step":%d' % step
        hist = self.pending.staleness if self.pending is not None else None
        if hist is not None:
            tail += b',"staleness":' + json.dumps(hist, separators=(",", ":")).encode()
        return b'{"batch":[' + b",".join(bodies) + tail + b"}"

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
        self.counters["stale_dropped"] += len(stale)
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
            "buffered_groups": len(self._buffer_order),
            "buffered_bytes": self._buffer_bytes,
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
        """The throttling signal of one env (SPEC §2.7), in O(number of envs)."""
        if not self.registered:
            return {
                "current_step": self.step,
                "queue_size": 0,
                "unallocated_fraction": 1.0,
                "self_queue_size": 0,
                "max_group_size": 1,
                "env_weight": 1.0,
                "self_buffered_groups": 0,
                **self._version_status(),
            }
        me = self.env(env_id)
        connected = [e for e in self.envs if e.connected]
        total = sum(e.max_context_len * max(0.0, e.weight) for e in connected)
        share = me.max_context_len * me.weight / total if total > 0 else 0.0
        env_weight = max(MIN_ENV_WEIGHT, share)
        silent = set(self.inactive_envs()) if self.env_timeout > 0 else set()
        allocated = sum(
            e.min_batch_allocation
            for i, e in enumerate(self.envs)
            if e.connected and e.min_batch_allocation is not None and i not in silent
        )
        unallocated = 1.0 - min(allocated, 1.0)
        max_group = max(1, self.queue.max_group_size)
        mine = self.queue.per_env.get(env_id)
        own = mine.sequences if mine else 0
        group_size = max(me.group_size, mine.max_size if mine else 0)
        if group_size != me.group_size:
            me.group_size = group_size
            self._commit(meta={_META_KEY: self._meta()})
        from_others = 0
        if max_group > 1:
            for other_id, stats in self.queue.per_env.items():
                if other_id == env_id:
                    continue
                packed = math.ceil(stats.sequences / max_group) * max_group
                reserved = 0
                if other_id is not None and 0 <= other_id < len(self.envs):
                    other = self.envs[other_id]
                    if (
                        other.connected
                        and other.min_batch_allocation is not None
                        and other_id not in silent
                    ):
                        reserved = int(self.batch_size * other.min_batch_allocation)
                from_others += max(0, packed - reserved)
        return {
            "current_step": self.step,
            "queue_size": (own + from_others) // group_size,
            "unallocated_fraction": unallocated,
            "self_queue_size": own // group_size,
            "max_group_size": max_group,
            "env_weight": env_weight,
            "self_buffered_groups": self.buffer_stats(env_id)[0],
            **self._version_status(),
        }
