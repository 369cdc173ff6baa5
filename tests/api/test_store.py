"""``RolloutStore`` as a whole: batches, budget, reset, persistence, and how its state changes."""

from __future__ import annotations

import json
import logging

import pytest

from atroposlib.api import handlers
from atroposlib.api.errors import QueueFullError
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import RolloutStore
from tests.api.store_helpers import incoming, started, tags


def test_batches_are_served_one_per_call_oldest_first_and_count_steps():
    store = started(RolloutStore(10**9), a={"group_size": 4})
    store.ingest([incoming(4, 0, tag=i) for i in range(6)])
    first = store.next_batch()
    assert tags(first) == [0, 1]
    assert store.step == 6
    second = store.next_batch()
    assert tags(second) == [2, 3]
    assert store.step == 7 and len(store.queue) == 2


def test_queue_full_raises_with_retry_after_and_counts_rejection():
    store = started(RolloutStore(200), a={})
    store.ingest([incoming(4, 0)])
    store.ingest([incoming(4, 0)])
    with pytest.raises(QueueFullError) as info:
        store.ingest([incoming(4, 0)] * 3)
    assert info.value.headers()["Retry-After"] == "1"
    assert store.counters["rejected_queue_full"] == 1


def test_reset_keeps_max_token_len_and_latest_but_forgets_the_rest():
    store = started(RolloutStore(10**9), a={})
    store.ingest([incoming(4, 0)])
    store.reset()
    assert (store.registered, store.batch_size, store.step, len(store.queue), store.envs) == (
        False,
        -1,
        0,
        0,
        [],
    )
    assert store.max_token_len == 64 and store.latest is not None


def test_persistence_restores_queue_buffer_envs_and_step(tmp_path):
    db = tmp_path / "api.db"
    store = started(RolloutStore(10**9, SqlitePersistence(db)), a={"group_size": 4})
    store.ingest([incoming(4, 0, tag=i) for i in range(3)] + [incoming(2, 0, tag=9)])
    store.next_batch()
    again = RolloutStore(10**9, SqlitePersistence(db))
    assert (again.registered, again.started, again.step, len(again.envs)) == (True, True, 6, 1)
    assert [g.seq for g in again.queue] == [3] and json.loads(again.latest)["tokens"][0][0] == 2
    assert [g.size for g in again.buffered(0)] == [2]
    # The buffered group still completes a group after the restart.
    again.ingest([incoming(2, 0, tag=10)])
    assert [g.size for g in again.queue] == [4, 2, 2]
    # The batch served before the restart was never acknowledged: it comes first, once.
    assert tags(again.next_batch()) == [0, 1]
    served = again.next_batch()
    assert tags(served) == [2, 9, 10]
    assert again.next_batch() is None


def test_counters_change_only_through_the_store():
    store = started(RolloutStore(10**9), a={})
    with pytest.raises(TypeError):
        store.counters["groups_ingested"] += 1  # type: ignore[index]
    store.count("internal_errors")
    store.count("inconsistent_masks", 2)
    assert store.counters["internal_errors"] == 1 and store.counters["inconsistent_masks"] == 2


def test_strict_groups_is_the_stores_own_setting():
    body = b'{"tokens":[[1,2]],"masks":[[1,2]],"scores":[1.0],"advantages":[[0.5]],"env_id":0}'
    lenient = started(RolloutStore(10**9), a={"group_size": 1})
    assert handlers.ingest_groups(lenient, body, many=False) == b'{"status":"received"}'
    strict = started(RolloutStore(10**9, strict_groups=True), a={"group_size": 1})
    with pytest.raises(Exception, match="advantages"):
        handlers.ingest_groups(strict, body, many=False)
    assert strict.counters["rejected_invalid"] == 1 and len(strict.queue) == 0


def test_inconsistent_groups_are_counted_each_and_warned_once_per_env_and_field(caplog):
    store = started(RolloutStore(10**9), a={})
    with caplog.at_level(logging.WARNING, logger="atroposlib.api.store"):
        store.note_inconsistent([(0, "advantages"), (0, "advantages"), (None, "advantages")])
    assert store.counters["inconsistent_advantages"] == 3
    assert len([r for r in caplog.records if "whose lengths differ" in r.message]) == 2
