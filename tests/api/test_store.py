"""Unit tests of ``RolloutStore``: registration rules, buffer, FIFO batches, status math, persistence."""

from __future__ import annotations

import json

import pytest

from atroposlib.api.errors import QueueFullError, UnknownEnvError
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import MIN_ENV_WEIGHT, IncomingGroup, RolloutStore

REG = Registration(
    wandb_group="g",
    wandb_project="p",
    batch_size=8,
    max_token_len=64,
    checkpoint_dir="c",
    save_checkpoint_interval=3,
    starting_step=5,
    num_steps=50,
)


def incoming(size: int, env_id=None, tag: int = 0) -> IncomingGroup:
    return IncomingGroup(
        env_id, size, json.dumps({"tokens": [[tag]] * size, "env_id": env_id}).encode()
    )


def started(store: RolloutStore, **envs: dict) -> RolloutStore:
    store.register_trainer(REG)
    store.next_batch()
    for name, kw in envs.items():
        store.register_env(
            RegisterEnv(
                max_token_length=kw.pop("max_token_length", 100),
                desired_name=name,
                weight=kw.pop("weight", 1.0),
                group_size=kw.pop("group_size", 4),
                **kw,
            )
        )
    return store


def test_second_registration_keeps_first_config_but_adds_requester():
    store = RolloutStore(10**9)
    store.register_trainer(REG)
    store.register_trainer(REG.model_copy(update={"batch_size": 99, "starting_step": 0}))
    assert store.batch_size == 8 and store.step == 5
    assert len(store.requesters) == 2


def test_env_cannot_register_before_trainer_polls_batch():
    store = RolloutStore(10**9)
    store.register_trainer(REG)
    req = RegisterEnv(max_token_length=10, desired_name="a", weight=1.0, group_size=4)
    assert store.register_env(req) is None
    store.next_batch()
    answer = store.register_env(req)
    assert answer["env_id"] == 0 and answer["wandb_name"] == "a_0" and answer["starting_step"] == 5
    assert store.register_env(req)["wandb_name"] == "a_1"


def test_odd_sized_groups_are_buffered_until_they_sum_to_group_size():
    store = started(RolloutStore(10**9), a={"group_size": 4})
    first = store.ingest([incoming(3, 0, tag=1)])[0]
    assert (first.status, first.buffer_size) == ("buffered", 3)
    assert len(store.queue) == 0
    second = store.ingest([incoming(1, 0, tag=2)])[0]
    assert (second.status, second.buffer_size) == ("buffered", 0)
    assert [g.size for g in store.queue] == [3, 1]


def test_batches_are_served_one_per_call_oldest_first_and_count_steps():
    store = started(RolloutStore(10**9), a={"group_size": 4})
    store.ingest([incoming(4, 0, tag=i) for i in range(6)])
    first = store.next_batch()
    assert [json.loads(b)["tokens"][0][0] for b in first] == [0, 1]
    assert store.step == 6
    second = store.next_batch()
    assert [json.loads(b)["tokens"][0][0] for b in second] == [2, 3]
    assert store.step == 7 and len(store.queue) == 2


def test_unknown_env_rejects_whole_post_and_stores_nothing():
    store = started(RolloutStore(10**9), a={})
    with pytest.raises(UnknownEnvError):
        store.ingest([incoming(4, 0), incoming(4, 3)])
    assert len(store.queue) == 0


def test_queue_full_raises_with_retry_after_and_counts_rejection():
    store = started(RolloutStore(200), a={})
    store.ingest([incoming(4, 0)])
    store.ingest([incoming(4, 0)])
    with pytest.raises(QueueFullError) as info:
        store.ingest([incoming(4, 0)] * 3)
    assert info.value.headers()["Retry-After"] == "1"
    assert store.counters["rejected_queue_full"] == 1


def test_status_env_weights_queue_and_group_size_follow_the_spec():
    store = started(
        RolloutStore(10**9),
        a={"group_size": 4, "max_token_length": 100, "weight": 1.0},
        b={"group_size": 2, "max_token_length": 300, "weight": 1.0, "min_batch_allocation": 0.25},
    )
    store.ingest([incoming(4, 0), incoming(4, 0), incoming(2, 1), incoming(2, 1), incoming(2, 1)])
    a = store.env_status(0)
    assert a["env_weight"] == pytest.approx(100 / 400)
    assert a["unallocated_fraction"] == pytest.approx(0.75)
    assert a["max_group_size"] == 4
    # b: 6 sequences -> packed to 8, minus its reserve int(8 * 0.25) = 2 -> 6 available to a.
    assert a["self_queue_size"] == 2 and a["queue_size"] == (8 + 6) // 4
    b = store.env_status(1)
    assert b["env_weight"] == pytest.approx(300 / 400)
    assert b["self_queue_size"] == 3 and b["queue_size"] == (6 + 8) // 2


def test_status_env_grows_group_size_to_largest_own_group():
    store = started(RolloutStore(10**9), a={"group_size": 2})
    store.ingest([incoming(2, 0)])
    store.envs[0].group_size = 1  # as if registered smaller than what it sends
    store.ingest([incoming(2, 0)])
    store.env_status(0)
    assert store.envs[0].group_size == 2


def test_status_env_floors_weight_and_survives_zero_total_weight():
    store = started(RolloutStore(10**9), a={})
    store.envs[
        0
    ].weight = 0.0  # /register-env refuses 0 now; a record restored from before may hold it
    assert store.env_status(0)["env_weight"] == MIN_ENV_WEIGHT


def test_status_env_before_registration_is_a_defined_payload():
    status = RolloutStore(10**9).env_status(0)
    assert status["queue_size"] == 0 and status["env_weight"] == 1.0


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
    assert [json.loads(b)["tokens"][0][0] for b in again.next_batch()] == [0, 1]
    served = again.next_batch()
    assert [json.loads(b)["tokens"][0][0] for b in served] == [2, 9, 10]
    assert again.next_batch() is None


def test_persistence_swap_reads_in_order_across_chunks_and_is_all_or_nothing(tmp_path):
    from atroposlib.api.errors import StorageError
    from atroposlib.api.persistence import GroupRow

    db = SqlitePersistence(tmp_path / "take.db")
    rows = [GroupRow(seq, None, 1, False, b'{"n":%d}' % seq) for seq in range(1, 1201)]
    db.commit(insert=rows)
    wanted = list(range(1200, 0, -2))  # 600 rows, more than one IN chunk, reversed order
    # Serving reads without deleting: the rows stay until acknowledged.
    assert db.swap_batch((), wanted, {"state": {}}) == [b'{"n":%d}' % s for s in wanted]
    assert len(db.load().groups) == 1200
    with pytest.raises(StorageError):
        db.swap_batch(wanted, [1, 5000], {"state": {}})
    assert len(db.load().groups) == 1200  # the failed swap consumed nothing
    # Acknowledging consumes them in the same transaction that reads the next batch.
    assert db.swap_batch(wanted, [1, 3], {"state": {}}) == [b'{"n":1}', b'{"n":3}']
    assert [r.seq for r in db.load().groups] == list(range(1, 1201, 2))
    db.close()
