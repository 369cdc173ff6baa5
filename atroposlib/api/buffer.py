"""The odd-size buffer: groups smaller (or larger) than their env's group size.

Such a group waits in its env's buffer until some buffered groups of that env
add up to the group size; those then go onto the queue together, chosen as the
original chose them (:func:`~atroposlib.api.utils.find_groups_summing_to_target`).
The buffers are bounded in bytes (``--max-buffer-mb``): beyond the bound the
oldest groups leave first (see :meth:`OddSizeBuffer.evict`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List

from atroposlib.api.queue import StoredGroup
from atroposlib.api.utils import find_groups_summing_to_target

__all__ = ["EnvBuffer", "OddSizeBuffer"]


@dataclass
class EnvBuffer:
    """One env's odd-sized groups, per size in arrival order, with running totals."""

    by_size: Dict[int, Deque[StoredGroup]] = field(default_factory=dict)
    groups: int = 0
    sequences: int = 0
    nbytes: int = 0

    def add(self, g: StoredGroup) -> None:
        """Put ``g`` at the tail of its size's bucket."""
        self.by_size.setdefault(g.size, deque()).append(g)
        self.groups += 1
        self.sequences += g.size
        self.nbytes += g.nbytes

    def remove(self, g: StoredGroup) -> None:
        """Take ``g`` out (usually the head of its bucket)."""
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
        """Every group of this buffer, oldest first."""
        return sorted(itertools.chain.from_iterable(self.by_size.values()), key=lambda g: g.seq)


class OddSizeBuffer:
    """The per-env buffers with their arrival order and total bytes."""

    def __init__(self) -> None:
        self._envs: Dict[int, EnvBuffer] = {}
        self._order: OrderedDict[int, StoredGroup] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[StoredGroup]:
        return iter(self._order.values())

    def clear(self) -> None:
        """Drop every buffered group."""
        self._envs.clear()
        self._order.clear()
        self.nbytes = 0

    def of(self, env_id: int) -> EnvBuffer | None:
        """The buffer of ``env_id`` (None when nothing of it waits)."""
        return self._envs.get(env_id)

    def add(self, g: StoredGroup) -> None:
        """Buffer ``g`` (which has an ``env_id``) without matching it."""
        assert g.env_id is not None
        buf = self._envs.get(g.env_id)
        if buf is None:
            buf = self._envs[g.env_id] = EnvBuffer()
        buf.add(g)
        self._order[g.seq] = g
        self.nbytes += g.nbytes

    def take(self, g: StoredGroup) -> None:
        """Remove the buffered group ``g``."""
        assert g.env_id is not None
        buf = self._envs[g.env_id]
        buf.remove(g)
        if not buf.groups:
            del self._envs[g.env_id]
        del self._order[g.seq]
        self.nbytes -= g.nbytes

    def match(self, g: StoredGroup, target: int) -> tuple[List[StoredGroup], int]:
        """Buffer ``g``, then take out buffered groups of its env that add up to ``target``.

        Returns the groups taken (oldest-preferring, in the original's order) and
        the sequences still buffered for that env.
        """
        assert g.env_id is not None
        self.add(g)
        buf = self._envs[g.env_id]
        candidates = buf.candidates(target)
        picked = find_groups_summing_to_target(
            [{"tokens": range(c.size)} for c in candidates], target
        )
        taken = [candidates[i] for i in picked]
        for flushed in taken:
            self.take(flushed)
        return taken, (buf.sequences if g.env_id in self._envs else 0)

    def evict(
        self, max_bytes: int, group_size_of: Callable[[int], int]
    ) -> List[tuple[StoredGroup, int, bool]]:
        """Take out the oldest groups until at most ``max_bytes`` are buffered.

        Returns ``(group, its env's group size, release)`` for each: ``release``
        when the group's size divides the group size (it can go onto the queue
        as a whole group of its own size and pack with others of that size);
        any other size could never be packed into a batch and is to be dropped.
        """
        out: List[tuple[StoredGroup, int, bool]] = []
        while self.nbytes > max_bytes and self._order:
            oldest = next(iter(self._order.values()))
            self.take(oldest)
            assert oldest.env_id is not None
            target = group_size_of(oldest.env_id)
            out.append((oldest, target, oldest.size < target and target % oldest.size == 0))
        return out

    def stats(self, env_id: int) -> tuple[int, int, int]:
        """``(groups, sequences, bytes)`` buffered for ``env_id``, in O(1)."""
        buf = self._envs.get(env_id)
        return (buf.groups, buf.sequences, buf.nbytes) if buf is not None else (0, 0, 0)

    def ordered(self, env_id: int) -> List[StoredGroup]:
        """The groups of ``env_id``, oldest first."""
        buf = self._envs.get(env_id)
        return buf.ordered() if buf is not None else []
