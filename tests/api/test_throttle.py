"""The ``/status-env`` throttling signal: the pure function, and the store that feeds it."""

from __future__ import annotations

import pytest

from atroposlib.api.queue import GroupQueue, StoredGroup
from atroposlib.api.registry import EnvRecord
from atroposlib.api.store import RolloutStore
from atroposlib.api.throttle import MIN_ENV_WEIGHT, env_signal, unregistered_signal
from tests.api.store_helpers import FakeClock, incoming, started


def _env(
    i: int, group_size: int = 4, ctx: int = 100, weight: float = 1.0, minimum=None, connected=True
):
    return EnvRecord(ctx, weight, f"e{i}", f"e{i}_0", i, 0.0, connected, minimum, group_size)


def _queue(*groups: tuple[int | None, int]) -> GroupQueue:
    q = GroupQueue()
    for seq, (env_id, size) in enumerate(groups, 1):
        q.append(StoredGroup(seq, env_id, size, b"{}"))
    return q


def _signal(env_id, envs, q, batch_size=8, silent=(), step=0, buffered=0):
    return env_signal(
        env_id, envs, q.per_env, q.max_group_size, batch_size, set(silent), step, buffered
    )


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


def test_signal_counts_others_as_packed_minus_their_reserve():
    envs = [_env(0, group_size=4), _env(1, group_size=2, ctx=300, minimum=0.25)]
    q = _queue((0, 4), (0, 4), (1, 2), (1, 2), (1, 2))
    signal = _signal(0, envs, q)
    assert signal.answer["self_queue_size"] == 2
    assert signal.answer["queue_size"] == (8 + 6) // 4  # b: 6 -> packed 8, minus int(8 * 0.25)
    assert signal.answer["unallocated_fraction"] == pytest.approx(0.75)
    assert signal.answer["env_weight"] == pytest.approx(0.25)
    assert signal.group_size == 4


def test_a_silent_env_reserves_nothing_and_allocates_nothing():
    envs = [_env(0), _env(1, minimum=0.5)]
    q = _queue((1, 4), (1, 4))
    loud = _signal(0, envs, q).answer
    silent = _signal(0, envs, q, silent={1}).answer
    assert (loud["unallocated_fraction"], silent["unallocated_fraction"]) == (0.5, 1.0)
    assert (loud["queue_size"], silent["queue_size"]) == ((8 - 4) // 4, 8 // 4)


def test_a_disconnected_env_has_no_weight_share():
    envs = [_env(0), _env(1, connected=False)]
    assert _signal(0, envs, _queue()).answer["env_weight"] == 1.0


def test_the_group_size_grows_to_the_largest_own_group_but_the_function_changes_nothing():
    envs = [_env(0, group_size=2)]
    signal = _signal(0, envs, _queue((0, 8)))
    assert signal.group_size == 8 and signal.answer["self_queue_size"] == 1
    assert envs[0].group_size == 2


def test_weight_is_floored_and_a_zero_total_is_no_error():
    envs = [_env(0, weight=0.0)]
    assert _signal(0, envs, _queue()).answer["env_weight"] == MIN_ENV_WEIGHT


def test_unregistered_signal_lets_an_env_run():
    assert unregistered_signal(7) == {
        "current_step": 7,
        "queue_size": 0,
        "unallocated_fraction": 1.0,
        "self_queue_size": 0,
        "max_group_size": 1,
        "env_weight": 1.0,
        "self_buffered_groups": 0,
    }


def test_store_passes_silent_envs_and_buffered_groups_to_the_signal():
    clock = FakeClock()
    store = started(
        RolloutStore(10**9, env_timeout=5, clock=clock),
        a={"group_size": 4},
        b={"group_size": 4, "min_batch_allocation": 0.5},
    )
    store.ingest([incoming(3, 0)])
    assert store.env_status(0)["self_buffered_groups"] == 1
    assert store.env_status(0)["unallocated_fraction"] == 0.5
    clock.advance(6)
    assert store.env_status(0)["unallocated_fraction"] == 1.0
