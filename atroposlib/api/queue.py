"""The compact FIFO queue of scored groups, bucketed by group size.

Groups are kept as their canonical JSON bytes plus a few ints. A batch is
chosen exactly as :func:`atroposlib.api.utils.grab_exact_from_heterogeneous_queue`
would choose it on the same queue, but in O(batch) time: within one size
bucket, packs are consecutive runs of ``max_group_size // size`` groups, so the
pack-completion order is a k-way merge over the buckets' heads.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List

from atroposlib.api.codec import stored_json
from atroposlib.api.utils import grab_batch_with_minimum_allocations

__all__ = ["EnvQueueStats", "GroupQueue", "StoredGroup"]


class StoredGroup:
    """One validated group: queue position, sender, sequence count and its JSON bytes.

    ``body`` is the group as posted and ``fill`` the null fields its JSON gets
    (see :func:`~atroposlib.api.codec.canonical_json` and :meth:`json`; ``fill`` objects are shared
    between groups with the same fields, so they cost no memory per group).
    ``body`` is None when the bytes live only in the persistence database
    (``--persist``), and an LZ4 block of the posted bytes when ``packed`` (see
    :func:`atroposlib.api.compression.pack`); ``nbytes`` is the JSON's length
    in every case, so the queue budget does not depend on the stored form.
    ``version`` is the oldest ``policy_version`` of its sequences (None when none was
    posted), for ``--max-staleness``.
    """

    __slots__ = ("seq", "env_id", "size", "body", "nbytes", "packed", "version", "fill")

    def __init__(
        self,
        seq: int,
        env_id: int | None,
        size: int,
        body: bytes | None,
        nbytes: int | None = None,
        packed: bool = False,
        version: int | None = None,
        fill: bytes = b"",
    ) -> None:
        self.seq = seq
        self.env_id = env_id
        self.size = size
        self.body = body
        self.nbytes = (
            len(body) + len(fill) if nbytes is None and body is not None else (nbytes or 0)
        )
        self.packed = packed
        self.version = version
        self.fill = fill

    def json(self) -> bytes:
        """The group's JSON (in memory only: None-bodied groups are read from the database)."""
        assert self.body is not None
        return stored_json(self.body, self.fill, self.packed, self.nbytes)


@dataclass
class EnvQueueStats:
    """Running counters of one env's groups on the queue (``/status-env`` reads them)."""

    groups: int = 0
    sequences: int = 0
    nbytes: int = 0
    sizes: Dict[int, int] = field(default_factory=dict)

    def add(self, g: StoredGroup, sign: int) -> None:
        """Count ``g`` in (``sign=1``) or out (``sign=-1``)."""
        self.groups += sign
        self.sequences += sign * g.size
        self.nbytes += sign * g.nbytes
        left = self.sizes.get(g.size, 0) + sign
        if left:
            self.sizes[g.size] = left
        else:
            self.sizes.pop(g.size, None)

    @property
    def max_size(self) -> int:
        """Largest group of this env on the queue (0 when none)."""
        return max(self.sizes, default=0)


class GroupQueue:
    """FIFO queue of :class:`StoredGroup` with per-size buckets and per-env counters."""

    def __init__(self) -> None:
        self._order: Dict[int, StoredGroup] = {}
        self._buckets: Dict[int, deque] = {}
        self.per_env: Dict[int | None, EnvQueueStats] = {}
        self.sequences = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[StoredGroup]:
        return iter(self._order.values())

    def __contains__(self, g: object) -> bool:
        return isinstance(g, StoredGroup) and self._order.get(g.seq) is g

    @property
    def max_group_size(self) -> int:
        """Largest group size on the queue (0 when empty)."""
        return max(self._buckets, default=0)

    def append(self, g: StoredGroup) -> None:
        """Put ``g`` at the tail."""
        self._order[g.seq] = g
        self._buckets.setdefault(g.size, deque()).append(g)
        self._count(g, 1)

    def _count(self, g: StoredGroup, sign: int) -> None:
        stats = self.per_env.get(g.env_id)
        if stats is None:
            stats = self.per_env[g.env_id] = EnvQueueStats()
        stats.add(g, sign)
        if not stats.groups:
            del self.per_env[g.env_id]
        self.sequences += sign * g.size
        self.nbytes += sign * g.nbytes

    def _forget(self, g: StoredGroup) -> None:
        del self._order[g.seq]
        self._count(g, -1)

    def pop_batch(self, batch_size: int) -> List[StoredGroup] | None:
        """Remove and return the oldest exact batch (FIFO pack order), or None."""
        if batch_size <= 0 or self.sequences < batch_size:
            return None
        top = self.max_group_size
        heap: list[tuple[int, int, int]] = []  # (seq completing the pack, size, pack index)
        for size, bucket in self._buckets.items():
            per_pack = top // size
            if top % size == 0 and len(bucket) >= per_pack:
                heapq.heappush(heap, (bucket[per_pack - 1].seq, size, 0))
        taken: Dict[int, int] = {}
        order: List[StoredGroup] = []
        count = 0
        while heap and count < batch_size:
            _, size, pack = heapq.heappop(heap)
            bucket = self._buckets[size]
            per_pack = top // size
            start = pack * per_pack
            for i in range(start, start + per_pack):
                order.append(bucket[i])
                taken[size] = i + 1
                count += size
                if count >= batch_size:
                    break
            nxt = (pack + 2) * per_pack - 1
            if count < batch_size and nxt < len(bucket):
                heapq.heappush(heap, (bucket[nxt].seq, size, pack + 1))
        if count != batch_size:
            return None
        for size, n in taken.items():
            bucket = self._buckets[size]
            for _ in range(n):
                self._forget(bucket.popleft())
            if not bucket:
                del self._buckets[size]
        return order

    def pop_batch_with_minimums(
        self, batch_size: int, env_configs: List[Dict[str, Any]]
    ) -> List[StoredGroup] | None:
        """Remove and return a batch honouring per-env minimum allocations, or None.

        Delegates the choice to :func:`grab_batch_with_minimum_allocations` on
        light stand-ins of the queue, so it costs O(queue) per batch.
        """
        proxies = [
            {"tokens": range(g.size), "env_id": g.env_id, "_g": g} for g in self._order.values()
        ]
        batch, _ = grab_batch_with_minimum_allocations(proxies, batch_size, env_configs)
        if batch is None:
            return None
        chosen = [p["_g"] for p in batch]
        gone = {g.seq for g in chosen}
        for g in chosen:
            self._forget(g)
        for size in {g.size for g in chosen}:
            left = deque(g for g in self._buckets[size] if g.seq not in gone)
            if left:
                self._buckets[size] = left
            else:
                del self._buckets[size]
        return chosen

    def remove(self, groups: List[StoredGroup]) -> None:
        """Take ``groups`` (all on the queue) off it, wherever they are (``--max-staleness``)."""
        gone = {g.seq for g in groups}
        for g in groups:
            self._forget(g)
        for size in {g.size for g in groups}:
            left = deque(g for g in self._buckets[size] if g.seq not in gone)
            if left:
                self._buckets[size] = left
            else:
                del self._buckets[size]

    def clear(self) -> None:
        """Drop every group."""
        self.__init__()
