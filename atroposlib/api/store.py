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

The store's methods live in three parts besides this module (registration, counters,
status): :mod:`~atroposlib.api.store_ingest` (posted groups onto the queue or into the
buffer), :mod:`~atroposlib.api.store_batches` (``GET /batch`` and its acknowledgement) and
:mod:`~atroposlib.api.store_state` (saving, committing, reloading).

Time (``--env-timeout``) is read from the ``clock`` passed in
(``time.monotonic`` by default), so tests move it by hand instead of sleeping.
"""

from __future__ import annotations

import logging
import time
import uuid
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Sequence

from atroposlib.api.buffer import OddSizeBuffer
from atroposlib.api.delivery import Delivery, PendingBatch, UnknownBatchError
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import CommitTicket, DeferredChanges, SqlitePersistence
from atroposlib.api.queue import GroupQueue, StoredGroup
from atroposlib.api.registry import DEFAULT_ENV_TIMEOUT, Clock, EnvRecord, EnvRegistry
from atroposlib.api.staleness import StalenessControl
from atroposlib.api.store_batches import StoreBatches
from atroposlib.api.store_ingest import IncomingGroup, IngestOutcome, StoreIngest
from atroposlib.api.store_state import META_KEY as _META_KEY
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


class RolloutStore(StoreIngest, StoreBatches):
    """Queue, env registry, trainer registration and step counter of one API server.

    Its parts: :class:`~atroposlib.api.store_ingest.StoreIngest` (posted groups),
    :class:`~atroposlib.api.store_batches.StoreBatches` (``/batch`` and its ack) and
    :class:`~atroposlib.api.store_state.DurableState` (commit and reload).
    """

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
        self.vocab_size: int | None = None
        """The trainer's embedding rows (``/register``'s optional ``vocab_size``): groups
        with a token id at or above it are refused at ingest."""
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
            self.vocab_size = reg.vocab_size
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
