"""Pure batch-packing functions of the rollout API (public; same names and results as Atropos).

Each queue item is a group dict whose ``tokens`` holds one entry per sequence;
only ``len(item["tokens"])`` and ``item.get("env_id")`` are read, so callers may
pass light stand-ins (e.g. ``{"tokens": range(8), "env_id": 0}``).

Example::

    >>> queue = [{"tokens": [[1]] * 4}, {"tokens": [[2]] * 4}, {"tokens": [[3]] * 4}]
    >>> batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    >>> len(batch), len(rest)
    (2, 1)
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

__all__ = [
    "find_groups_summing_to_target",
    "grab_batch_with_minimum_allocations",
    "grab_exact_from_heterogeneous_queue",
]

Group = Dict[str, Any]


def _size(group: Group) -> int:
    return len(group["tokens"])


def find_groups_summing_to_target(buffer: List[Group], target_size: int) -> List[int]:
    """Indices (sorted) of buffered groups whose sequence counts sum to ``target_size``.

    A greedy pass in FIFO order comes first (take each group that still fits);
    if it does not hit the target exactly, a subset-sum search over all groups
    prefers the oldest groups. Returns ``[]`` when no combination exists.
    """
    if not buffer or target_size <= 0:
        return []
    sizes = [_size(g) for g in buffer]
    chosen: List[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if total + size <= target_size:
            chosen.append(i)
            total += size
            if total == target_size:
                return chosen
    if sum(sizes) < target_size:
        return []  # no subset can reach it; also bounds the search below by the data at hand
    # reachable[i] has bit s set when some subset of the first i groups sums to s.
    mask = (1 << (target_size + 1)) - 1
    reachable = [1]
    for size in sizes:
        prev = reachable[-1]
        reachable.append((prev | (prev << size)) & mask)
    if not reachable[-1] >> target_size & 1:
        return []
    picked: List[int] = []
    s = target_size
    for i in range(len(sizes), 0, -1):
        if reachable[i - 1] >> s & 1:
            continue  # skip the newer group when the older ones suffice
        picked.append(i - 1)
        s -= sizes[i - 1]
    return sorted(picked)


def _pack_order(
    indexed: Sequence[Tuple[int, Group]], max_group_size: int
) -> List[Tuple[int, Group]]:
    """Items that form whole packs of ``max_group_size`` sequences, in pack-completion order."""
    buckets: Dict[int, List[Tuple[int, Group]]] = {}
    packed: List[Tuple[int, Group]] = []
    for idx, group in indexed:
        size = _size(group)
        bucket = buckets.setdefault(size, [])
        bucket.append((idx, group))
        if len(bucket) * size == max_group_size:
            packed.extend(bucket)
            buckets[size] = []
    return packed


def grab_exact_from_heterogeneous_queue(
    queue: List[Group], batch_size: int
) -> Tuple[List[Group] | None, List[Group]]:
    """Take groups summing to exactly ``batch_size`` sequences, never splitting a group.

    Groups are bucketed by size; a bucket holding ``max_group_size`` sequences
    becomes a pack. Items are taken in pack-completion order until the count
    hits ``batch_size``; overshooting or running out yields ``(None, queue)``.
    Returns ``(batch, remaining_queue)`` with the remainder in original order.
    """
    if not queue:
        return None, queue
    if sum(_size(g) for g in queue) < batch_size:
        return None, queue
    max_group_size = max(_size(g) for g in queue)
    candidates = _pack_order(list(enumerate(queue)), max_group_size)
    if sum(_size(g) for _, g in candidates) < batch_size:
        return None, queue
    taken: List[int] = []
    count = 0
    for idx, group in candidates:
        count += _size(group)
        taken.append(idx)
        if count >= batch_size:
            break
    if count != batch_size:
        return None, queue
    taken_set = set(taken)
    batch = [queue[i] for i in taken]
    return batch, [g for i, g in enumerate(queue) if i not in taken_set]


def grab_batch_with_minimum_allocations(
    queue: List[Group], batch_size: int, env_configs: List[Dict[str, Any]]
) -> Tuple[List[Group] | None, List[Group]]:
    """Like :func:`grab_exact_from_heterogeneous_queue`, honouring per-env minimum shares.

    ``env_configs[env_id]`` is the env record (``connected``,
    ``min_batch_allocation``). Connected envs with a minimum get at least
    ``int(batch_size * min_batch_allocation)`` sequences (scaled down when the
    minimums exceed the batch, never below the env's smallest packable group);
    if such an env has nothing packable, no batch forms. The rest of the batch
    is filled from any env's packable groups in queue order. Groups without an
    ``env_id`` are not used on this path.
    """
    minimums: Dict[int, float] = {}
    for env_id, cfg in enumerate(env_configs):
        alloc = cfg.get("min_batch_allocation")
        if alloc is not None and cfg.get("connected", True):
            minimums[env_id] = alloc
    if not minimums:
        return grab_exact_from_heterogeneous_queue(queue, batch_size)
    if not queue:
        return None, queue
    max_group_size = max(_size(g) for g in queue)

    per_env: Dict[int, List[Tuple[int, Group]]] = {}
    for idx, group in enumerate(queue):
        env_id = group.get("env_id")
        if env_id is not None:
            per_env.setdefault(env_id, []).append((idx, group))
    packable = {env_id: _pack_order(items, max_group_size) for env_id, items in per_env.items()}

    min_seqs: Dict[int, int] = {}
    for env_id, alloc in minimums.items():
        min_seq = int(batch_size * alloc)
        if min_seq > 0 and not packable.get(env_id):
            return None, queue  # a starved env with a quota blocks the batch
        min_seqs[env_id] = min_seq
    total_min = sum(min_seqs.values())
    if total_min > batch_size:
        scale = batch_size / total_min
        for env_id in min_seqs:
            items = packable.get(env_id)
            floor = min(_size(g) for _, g in items) if items else 1
            min_seqs[env_id] = max(floor, int(min_seqs[env_id] * scale))

    taken: List[int] = []
    taken_set: set = set()
    count = 0
    for env_id, min_seq in min_seqs.items():
        got = 0
        for idx, group in packable.get(env_id, []):
            if got >= min_seq:
                break
            size = _size(group)
            if count + size <= batch_size:
                taken.append(idx)
                taken_set.add(idx)
                got += size
                count += size
    rest = sorted((item for items in packable.values() for item in items), key=lambda t: t[0])
    for idx, group in rest:
        if count >= batch_size:
            break
        if idx in taken_set:
            continue
        size = _size(group)
        if count + size <= batch_size:
            taken.append(idx)
            taken_set.add(idx)
            count += size
    if count != batch_size:
        return None, queue
    return [queue[i] for i in taken], [g for i, g in enumerate(queue) if i not in taken_set]
