"""The odd-size buffer: matching groups to the group size, eviction, per-env totals."""

from __future__ import annotations

from atroposlib.api.buffer import OddSizeBuffer
from atroposlib.api.queue import StoredGroup
from atroposlib.api.store import RolloutStore
from tests.api.store_helpers import incoming, started


def _g(seq: int, size: int, env_id: int = 0, nbytes: int = 10) -> StoredGroup:
    return StoredGroup(seq, env_id, size, b"{}", nbytes)


def test_odd_sized_groups_are_buffered_until_they_sum_to_group_size():
    store = started(RolloutStore(10**9), a={"group_size": 4})
    first = store.ingest([incoming(3, 0, tag=1)])[0]
    assert (first.status, first.buffer_size) == ("buffered", 3)
    assert len(store.queue) == 0
    second = store.ingest([incoming(1, 0, tag=2)])[0]
    assert (second.status, second.buffer_size) == ("buffered", 0)
    assert [g.size for g in store.queue] == [3, 1]


def test_match_takes_the_oldest_groups_that_sum_to_the_target_and_reports_what_is_left():
    buf = OddSizeBuffer()
    assert buf.match(_g(1, 3), 4) == ([], 3)
    assert buf.match(_g(2, 2), 4) == ([], 5)
    taken, left = buf.match(_g(3, 1), 4)
    assert [g.seq for g in taken] == [1, 3] and left == 2
    assert [g.seq for g in buf.ordered(0)] == [2]
    assert buf.stats(0) == (1, 2, 10) and len(buf) == 1 and buf.nbytes == 10


def test_envs_are_matched_separately():
    buf = OddSizeBuffer()
    buf.match(_g(1, 2, env_id=0), 4)
    taken, left = buf.match(_g(2, 2, env_id=1), 4)
    assert taken == [] and left == 2
    assert buf.stats(0) == (1, 2, 10) and buf.stats(1) == (1, 2, 10)
    assert buf.stats(7) == (0, 0, 0) and buf.ordered(7) == [] and buf.of(7) is None


def test_evict_takes_oldest_first_and_releases_only_divisors_of_the_group_size():
    buf = OddSizeBuffer()
    for seq, size in ((1, 2), (2, 3), (3, 2)):
        buf.add(_g(seq, size))
    evicted = buf.evict(10, lambda env_id: 8)
    assert [(g.seq, target, release) for g, target, release in evicted] == [
        (1, 8, True),
        (2, 8, False),
    ]
    assert [g.seq for g in buf] == [3] and buf.nbytes == 10


def test_evict_under_the_bound_takes_nothing():
    buf = OddSizeBuffer()
    buf.add(_g(1, 3))
    assert buf.evict(10, lambda env_id: 8) == [] and len(buf) == 1


def test_store_releases_divisors_and_drops_the_rest_when_the_buffer_is_over_its_bound():
    store = started(RolloutStore(10**9, max_buffer_bytes=50), a={"group_size": 8})
    store.ingest([incoming(2, 0, tag=1)])
    store.ingest([incoming(3, 0, tag=2)])  # over 50 bytes: the oldest (2 | 8) is released
    assert store.counters["buffer_released"] == 1 and store.counters["buffer_dropped"] == 0
    store.ingest([incoming(3, 0, tag=3)])  # over again: the oldest 3 can never pack, dropped
    assert store.counters["buffer_released"] == 1 and store.counters["buffer_dropped"] == 1
    assert [g.size for g in store.queue] == [2] and [g.size for g in store.buffered(0)] == [3]
