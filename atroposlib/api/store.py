"""``RolloutStore``: the one owner of the rollout API's state.

It holds the trainer registration, the env registry, the FIFO queue of scored
groups, the per-env buffers of odd-sized groups and the step counter. Its
methods are the only way to change that state; routes call them and answer.
With a :class:`~atroposlib.api.persistence.SqlitePersistence` every change is
committed before the method returns (and therefore before the HTTP answer).

Without persistence, groups are kept as their JSON bytes; once more than
``pack_above_bytes`` of JSON is held, further groups are stored deflated
(:func:`~atroposlib.api.compression.pack`, about 3.5x smaller) and inflated
when served. Environments throttle at a few batches of queued data, so in
normal operation nothing is packed; a backlog costs a quarter of the memory.
The queue budget (``--max-queue-mb``) always counts JSON bytes.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Sequence

from atroposlib.api.compression import pack, unpack
from atroposlib.api.errors import QueueFullError, StorageError, UnknownEnvError
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import GroupRow, SqlitePersistence
from atroposlib.api.queue import GroupQueue, StoredGroup
from atroposlib.api.utils import find_groups_summing_to_target

logger = logging.getLogger(__name__)

__all__ = ["MIN_ENV_WEIGHT", "EnvRecord", "IncomingGroup", "RolloutStore"]

MIN_ENV_WEIGHT = 0.01
"""Floor of the ``env_weight`` that ``/status-env`` reports."""

_META_KEY = "state"

DEFAULT_PACK_ABOVE_BYTES = 16 * 1024 * 1024
"""Queued JSON beyond this many bytes is kept deflated in memory (``--pack-above-mb``)."""


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


@dataclass(frozen=True)
class IngestOutcome:
    """Where one posted group went: ``received`` (queue) or ``buffered`` (with the buffer's size)."""

    status: str
    buffer_size: int = 0


class RolloutStore:
    """Queue, env registry, trainer registration and step counter of one API server."""

    def __init__(
        self,
        max_queue_bytes: int,
        persistence: SqlitePersistence | None = None,
        pack_above_bytes: int = DEFAULT_PACK_ABOVE_BYTES,
    ) -> None:
        self.max_queue_bytes = max_queue_bytes
        self.pack_above_bytes = pack_above_bytes
        self._db = persistence
        self.queue = GroupQueue()
        self._buffers: Dict[int, List[StoredGroup]] = {}
        self._buffer_bytes = 0
        self._next_seq = 1
        self._latest: bytes | None = None
        self._latest_packed = False
        self.counters: Dict[str, int] = {
            "groups_ingested": 0,
            "sequences_ingested": 0,
            "batches_served": 0,
            "sequences_served": 0,
            "rejected_queue_full": 0,
            "rejected_invalid": 0,
            "rejected_unknown_env": 0,
            "internal_errors": 0,
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
        }

    def _restore(self) -> None:
        assert self._db is not None
        state = self._db.load()
        meta = state.meta.get(_META_KEY)
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
        self.queue.clear()
        self._buffers.clear()
        self._buffer_bytes = 0
        last_queued: int | None = None
        for row in state.groups:
            g = StoredGroup(row.seq, row.env_id, row.size, None, row.nbytes)
            if row.buffered and row.env_id is not None:
                self._buffers.setdefault(row.env_id, []).append(g)
                self._buffer_bytes += g.nbytes
            else:
                self.queue.append(g)
                last_queued = g.seq
            self._next_seq = max(self._next_seq, row.seq + 1)
        if last_queued is not None:
            self.latest = self._db.body(last_queued)
        logger.info(
            "restored %d queued groups, %d envs, step %d from %s",
            len(self.queue),
            len(self.envs),
            self.step,
            self._db.path,
        )

    def _commit(self, **changes: Any) -> None:
        """Persist one change; on failure reload the durable state so memory matches it."""
        if self._db is None:
            return
        try:
            self._db.commit(**changes)
        except StorageError:
            self._restore()
            raise

    def close(self) -> None:
        """Release the persistence layer."""
        if self._db is not None:
            self._db.close()

    @property
    def latest(self) -> bytes | None:
        """JSON of the last group put on the queue (None before any)."""
        if self._latest is not None and self._latest_packed:
            return unpack(self._latest)
        return self._latest

    @latest.setter
    def latest(self, body: bytes | None) -> None:
        self._latest, self._latest_packed = body, False

    @property
    def queued_bytes(self) -> int:
        """Bytes held by queued and buffered groups (the ``--max-queue-mb`` budget)."""
        return self.queue.nbytes + self._buffer_bytes

    def buffered(self, env_id: int) -> List[StoredGroup]:
        """The odd-sized groups of ``env_id`` waiting to add up to its group size."""
        return self._buffers.get(env_id, [])

    def env(self, env_id: Any) -> EnvRecord:
        """The record of ``env_id``; :class:`UnknownEnvError` when there is none."""
        if (
            not isinstance(env_id, int)
            or isinstance(env_id, bool)
            or not 0 <= env_id < len(self.envs)
        ):
            raise UnknownEnvError(env_id)
        return self.envs[env_id]

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
        self._commit(meta={_META_KEY: self._meta()})

    def reset(self) -> None:
        """Forget queue, buffers, envs and registration (max_token_len, checkpoint settings and latest stay)."""
        self.queue.clear()
        self._buffers.clear()
        self._buffer_bytes = 0
        self._reset_registration()
        self._commit(clear_groups=True, meta={_META_KEY: self._meta()})

    # ------------------------------------------------------------ ingest
    def ingest(self, groups: Sequence[IncomingGroup]) -> List[IngestOutcome]:
        """Store posted groups (all or none): onto the queue, or into their env's buffer.

        Raises :class:`UnknownEnvError` for an unregistered ``env_id`` and
        :class:`QueueFullError` when the queue budget would be exceeded (an
        empty queue always accepts, so one large post cannot starve forever).
        """
        for g in groups:
            if g.env_id is not None:
                self.env(g.env_id)
        incoming = sum(len(g.body) for g in groups)
        used = self.queued_bytes
        if used and used + incoming > self.max_queue_bytes:
            self.counters["rejected_queue_full"] += 1
            raise QueueFullError(used, self.max_queue_bytes)
        inserts: List[GroupRow] = []
        moves: List[tuple[int, int]] = []
        outcomes: List[IngestOutcome] = []
        created: List[StoredGroup] = []
        # In memory, JSON beyond the pack threshold is stored deflated: a few tens of
        # microseconds per group buy a queue several times smaller (the RSS target).
        held = used
        for g in groups:
            held += len(g.body)
            if self._db is None and held > self.pack_above_bytes:
                stored = StoredGroup(
                    self._next_seq, g.env_id, g.size, pack(g.body), len(g.body), packed=True
                )
            else:
                stored = StoredGroup(self._next_seq, g.env_id, g.size, g.body)
            created.append(stored)
            self._next_seq += 1
            target = self.envs[g.env_id].group_size if g.env_id is not None else g.size
            if g.size == target:
                inserts.append(GroupRow(stored.seq, g.env_id, g.size, False, g.body))
                self._enqueue(stored)
                outcomes.append(IngestOutcome("received"))
                continue
            inserts.append(GroupRow(stored.seq, g.env_id, g.size, True, g.body))
            outcomes.append(IngestOutcome("buffered", self._buffer(stored, target, moves)))
        self._commit(insert=inserts, move_to_queue=moves)
        self.counters["groups_ingested"] += len(groups)
        self.counters["sequences_ingested"] += sum(g.size for g in groups)
        if self._db is not None:
            for stored in created:  # the database holds the bytes now; memory keeps the ints
                stored.body = None
        return outcomes

    def _enqueue(self, g: StoredGroup) -> None:
        self.queue.append(g)
        if g.body is not None:
            self._latest, self._latest_packed = g.body, g.packed

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
        buf = self._buffers.setdefault(g.env_id, [])
        buf.append(g)
        self._buffer_bytes += g.nbytes
        picked = find_groups_summing_to_target([{"tokens": range(b.size)} for b in buf], target)
        if picked:
            chosen = set(picked)
            for i in picked:
                flushed = buf[i]
                if flushed.body is None and self._db is not None:  # its bytes are only on disk
                    self.latest = self._db.body(flushed.seq)
                self._buffer_bytes -= flushed.nbytes
                moves.append((flushed.seq, self._next_seq))
                flushed.seq = self._next_seq
                self._next_seq += 1
                self._enqueue(flushed)
            buf[:] = [b for i, b in enumerate(buf) if i not in chosen]
        return sum(b.size for b in buf)

    # ------------------------------------------------------------- batches
    def next_batch(self) -> List[bytes] | None:
        """Mark the trainer started and serve the oldest full batch (None when not enough data)."""
        newly_started = not self.started
        self.started = True
        if any(e.min_batch_allocation is not None for e in self.envs):
            env_configs = [asdict(e) for e in self.envs]
            batch = self.queue.pop_batch_with_minimums(self.batch_size, env_configs)
        else:
            batch = self.queue.pop_batch(self.batch_size)
        if batch is None:
            if newly_started:
                self._commit(meta={_META_KEY: self._meta()})
            return None
        self.step += 1
        self.counters["batches_served"] += 1
        sequences = sum(g.size for g in batch)
        self.counters["sequences_served"] += sequences
        if self._db is None:
            bodies = [unpack(g.body) if g.packed else g.body for g in batch]  # type: ignore[misc]
        else:
            try:
                bodies = self._db.take([g.seq for g in batch], {_META_KEY: self._meta()})
            except StorageError:
                self._restore()
                raise
        logger.info("Sending batch of %d sequences", sequences)
        return bodies

    # -------------------------------------------------------------- status
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
            }
        me = self.env(env_id)
        connected = [e for e in self.envs if e.connected]
        total = sum(e.max_context_len * max(0.0, e.weight) for e in connected)
        share = me.max_context_len * me.weight / total if total > 0 else 0.0
        env_weight = max(MIN_ENV_WEIGHT, share)
        allocated = sum(
            e.min_batch_allocation for e in connected if e.min_batch_allocation is not None
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
                    if other.connected and other.min_batch_allocation is not None:
                        reserved = int(self.batch_size * other.min_batch_allocation)
                from_others += max(0, packed - reserved)
        return {
            "current_step": self.step,
            "queue_size": (own + from_others) // group_size,
            "unallocated_fraction": unallocated,
            "self_queue_size": own // group_size,
            "max_group_size": max_group,
            "env_weight": env_weight,
        }
