"""Unit and property tests of the pure packing functions and of the store's bucketed queue."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atroposlib.api.queue import GroupQueue, StoredGroup
from atroposlib.api.utils import (
    find_groups_summing_to_target,
    grab_batch_with_minimum_allocations,
    grab_exact_from_heterogeneous_queue,
)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def g(size: int, env_id=None, tag: int = 0) -> dict:
    return {"tokens": [[tag]] * size, "env_id": env_id, "tag": tag}


def tags(groups) -> list:
    return [x["tag"] for x in groups]


# ----------------------------------------------------------- find_groups_summing_to_target
def test_find_groups_greedy_pass_takes_oldest_that_fit():
    buffer = [g(2), g(1), g(3), g(1)]
    assert find_groups_summing_to_target(buffer, 4) == [0, 1, 3]


def test_find_groups_falls_back_to_subset_sum_when_greedy_misses():
    # Greedy takes 3 then cannot add 2 (5 > 4); the exact subset is 2 + 2.
    buffer = [g(3), g(2), g(2)]
    assert find_groups_summing_to_target(buffer, 4) == [1, 2]


def test_find_groups_returns_empty_when_impossible():
    assert find_groups_summing_to_target([g(3), g(3)], 4) == []
    assert find_groups_summing_to_target([], 4) == []
    assert find_groups_summing_to_target([g(8)], 4) == []


@FAST
@given(st.lists(st.integers(1, 8), max_size=12), st.integers(1, 16))
def test_find_groups_result_sums_to_target_or_is_empty(sizes, target):
    picked = find_groups_summing_to_target([g(s) for s in sizes], target)
    assert picked == sorted(set(picked))
    if picked:
        assert sum(sizes[i] for i in picked) == target
    else:
        # Exhaustive check for small inputs: really no subset sums to target.
        reachable = {0}
        for s in sizes:
            reachable |= {r + s for r in reachable}
        assert target not in reachable


# ----------------------------------------------------- grab_exact_from_heterogeneous_queue
def test_grab_exact_takes_oldest_groups_of_uniform_size():
    queue = [g(4, tag=i) for i in range(5)]
    batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    assert tags(batch) == [0, 1]
    assert tags(rest) == [2, 3, 4]


def test_grab_exact_returns_none_and_same_queue_when_short():
    queue = [g(4), g(2)]
    batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    assert batch is None and rest is queue


def test_grab_exact_packs_small_groups_to_max_group_size():
    # max group size 4: two 2s form a pack, completing after the 4.
    queue = [g(2, tag=0), g(4, tag=1), g(2, tag=2), g(4, tag=3)]
    batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    assert tags(batch) == [1, 0, 2]
    assert tags(rest) == [3]


def test_grab_exact_never_uses_sizes_that_do_not_divide_the_max():
    queue = [g(3, tag=0), g(4, tag=1), g(4, tag=2)]
    batch, rest = grab_exact_from_heterogeneous_queue(queue, 8)
    assert tags(batch) == [1, 2] and tags(rest) == [0]
    assert grab_exact_from_heterogeneous_queue([g(3), g(3), g(4)], 6)[0] is None


sizes_pow2 = st.lists(st.sampled_from([1, 2, 4, 8]), min_size=0, max_size=40)


@FAST
@given(sizes_pow2, st.sampled_from([8, 16, 32]))
def test_grab_exact_batch_is_exact_whole_groups_and_rest_keeps_order(sizes, batch_size):
    queue = [g(s, tag=i) for i, s in enumerate(sizes)]
    batch, rest = grab_exact_from_heterogeneous_queue(queue, batch_size)
    if batch is None:
        assert rest == queue
        return
    assert sum(len(x["tokens"]) for x in batch) == batch_size
    assert sorted(tags(batch) + tags(rest)) == list(range(len(queue)))
    assert tags(rest) == sorted(tags(rest))


@FAST
@given(st.lists(st.just(4), min_size=2, max_size=30))
def test_grab_exact_is_fifo_for_uniform_groups(sizes):
    queue = [g(s, tag=i) for i, s in enumerate(sizes)]
    batch, _ = grab_exact_from_heterogeneous_queue(queue, 8)
    assert tags(batch) == [0, 1]


# --------------------------------------------------------------- min allocations
def test_min_allocation_reserves_share_for_env_even_when_it_is_newer():
    queue = [g(4, env_id=0, tag=i) for i in range(4)] + [g(4, env_id=1, tag=10)]
    envs = [
        {"connected": True, "min_batch_allocation": None},
        {"connected": True, "min_batch_allocation": 0.5},
    ]
    batch, rest = grab_batch_with_minimum_allocations(queue, 8, envs)
    assert tags(batch) == [10, 0]
    assert tags(rest) == [1, 2, 3]


def test_min_allocation_starved_env_blocks_batch():
    queue = [g(4, env_id=0, tag=i) for i in range(4)]
    envs = [
        {"connected": True, "min_batch_allocation": None},
        {"connected": True, "min_batch_allocation": 0.25},
    ]
    assert grab_batch_with_minimum_allocations(queue, 8, envs)[0] is None


def test_min_allocation_of_disconnected_env_is_ignored():
    queue = [g(4, env_id=0, tag=i) for i in range(4)]
    envs = [
        {"connected": True, "min_batch_allocation": None},
        {"connected": False, "min_batch_allocation": 0.5},
    ]
    batch, _ = grab_batch_with_minimum_allocations(queue, 8, envs)
    assert tags(batch) == [0, 1]


def test_min_allocations_above_batch_are_scaled_down():
    queue = [
        g(2, env_id=0, tag=0),
        g(2, env_id=0, tag=1),
        g(2, env_id=1, tag=2),
        g(2, env_id=1, tag=3),
    ]
    envs = [
        {"connected": True, "min_batch_allocation": 0.75},
        {"connected": True, "min_batch_allocation": 0.75},
    ]
    batch, _ = grab_batch_with_minimum_allocations(queue, 4, envs)
    assert sorted(tags(batch)) == [0, 2]


@FAST
@given(
    st.lists(st.integers(0, 2), max_size=30),
    st.sampled_from([0.0, 0.25, 0.5]),
    st.sampled_from([0.25, 0.5]),
)
def test_min_allocations_are_honoured_up_to_each_envs_supply(env_ids, alloc0, alloc1):
    queue = [g(4, env_id=e, tag=i) for i, e in enumerate(env_ids)]
    envs = [
        {"connected": True, "min_batch_allocation": alloc0},
        {"connected": True, "min_batch_allocation": alloc1},
        {"connected": True, "min_batch_allocation": None},
    ]
    batch_size = 16
    batch, rest = grab_batch_with_minimum_allocations(queue, batch_size, envs)
    if batch is None:
        return
    assert sum(len(x["tokens"]) for x in batch) == batch_size
    for env_id, alloc in ((0, alloc0), (1, alloc1)):
        supply = 4 * env_ids.count(env_id)
        got = sum(len(x["tokens"]) for x in batch if x["env_id"] == env_id)
        assert got >= min(int(batch_size * alloc), supply)
    assert sorted(tags(batch) + tags(rest)) == list(range(len(queue)))
    # Within each env the oldest groups go first.
    for env_id in (0, 1, 2):
        mine = [x["tag"] for x in queue if x["env_id"] == env_id]
        taken = [t for t in tags(batch) if env_ids[t] == env_id]
        assert sorted(taken) == mine[: len(taken)]


# --------------------------------------------- the store's queue makes the same choices
def _stored(sizes):
    q = GroupQueue()
    for i, s in enumerate(sizes):
        q.append(StoredGroup(i, None, s, b"{}"))
    return q


@FAST
@given(
    st.lists(st.sampled_from([1, 2, 3, 4, 8]), max_size=40),
    st.sampled_from([4, 8, 16]),
    st.integers(1, 4),
)
def test_bucketed_queue_serves_exactly_what_the_pure_function_chooses(sizes, batch_size, rounds):
    reference = [g(s, tag=i) for i, s in enumerate(sizes)]
    q = _stored(sizes)
    for _ in range(rounds):
        expected, reference = grab_exact_from_heterogeneous_queue(reference, batch_size)
        got = q.pop_batch(batch_size)
        if expected is None:
            assert got is None
            break
        assert [x.seq for x in got] == tags(expected)
        assert [x.seq for x in q] == tags(reference)
        assert q.sequences == sum(len(x["tokens"]) for x in reference)


def test_bucketed_queue_with_minimums_matches_pure_function():
    sizes_envs = [(4, 0), (4, 0), (2, 1), (4, 0), (2, 1), (4, 1)]
    q = GroupQueue()
    for i, (s, e) in enumerate(sizes_envs):
        q.append(StoredGroup(i, e, s, b"{}"))
    envs = [
        {"connected": True, "min_batch_allocation": None},
        {"connected": True, "min_batch_allocation": 0.5},
    ]
    expected, rest = grab_batch_with_minimum_allocations(
        [g(s, env_id=e, tag=i) for i, (s, e) in enumerate(sizes_envs)], 8, envs
    )
    got = q.pop_batch_with_minimums(8, envs)
    assert [x.seq for x in got] == tags(expected)
    assert [x.seq for x in q] == tags(rest)
    # The buckets stay consistent: the rest drains as the pure function would.
    assert [x.seq for x in q.pop_batch(4)] == tags(grab_exact_from_heterogeneous_queue(rest, 4)[0])
