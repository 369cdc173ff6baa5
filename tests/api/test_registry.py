"""The env registry: ids, names, lookups, disconnects and ``--env-timeout`` on a fake clock."""

from __future__ import annotations

import logging

import pytest

from atroposlib.api.errors import UnknownEnvError
from atroposlib.api.metrics import render_metrics
from atroposlib.api.models import RegisterEnv
from atroposlib.api.registry import EnvRegistry
from atroposlib.api.store import RolloutStore
from tests.api.store_helpers import REG, FakeClock, env_request, incoming, started


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


def test_unknown_env_rejects_whole_post_and_stores_nothing():
    store = started(RolloutStore(10**9), a={})
    with pytest.raises(UnknownEnvError):
        store.ingest([incoming(4, 0), incoming(4, 3)])
    assert len(store.queue) == 0


def test_ids_are_positions_and_names_count_earlier_envs_of_the_same_name():
    registry = EnvRegistry(clock=FakeClock())
    a, b, c = (registry.add(env_request(n)) for n in ("math", "code", "math"))
    assert [a.registered_id, b.registered_id, c.registered_id] == [0, 1, 2]
    assert [a.real_name, b.real_name, c.real_name] == ["math_0", "code_0", "math_1"]
    assert registry.get(2) is c


@pytest.mark.parametrize("env_id", [-1, 1, True, "0", 0.0, None])
def test_lookup_of_anything_but_a_registered_int_id_is_unknown(env_id):
    registry = EnvRegistry(clock=FakeClock())
    registry.add(env_request("a"))
    with pytest.raises(UnknownEnvError):
        registry.get(env_id)


def test_disconnected_env_keeps_its_record_and_id_and_is_never_inactive():
    clock = FakeClock()
    registry = EnvRegistry(env_timeout=10, clock=clock)
    registry.add(env_request("a"))
    registry.add(env_request("b"))
    registry.disconnect(0)
    clock.advance(11)
    assert registry.get(0).connected is False and len(registry) == 2
    assert registry.inactive() == [1]


def test_silence_is_measured_on_the_injected_clock(caplog):
    clock = FakeClock()
    registry = EnvRegistry(env_timeout=30, clock=clock)
    registry.add(env_request("a"))
    clock.advance(30)
    assert registry.inactive() == []  # more than --env-timeout, not equal
    clock.advance(0.5)
    with caplog.at_level(logging.WARNING, logger="atroposlib.api.registry"):
        assert registry.inactive() == [0]
        assert registry.inactive() == [0]
    assert len([r for r in caplog.records if "has not posted" in r.message]) == 1  # once per change
    registry.seen(0)
    assert registry.inactive() == []


def test_no_env_timeout_means_never_inactive():
    clock = FakeClock()
    registry = EnvRegistry(env_timeout=0, clock=clock)
    registry.add(env_request("a"))
    clock.advance(10**9)
    assert registry.inactive() == []


def test_group_size_only_grows():
    registry = EnvRegistry(clock=FakeClock())
    registry.add(env_request("a", group_size=4))
    assert registry.grow_group_size(0, 2) is False and registry.get(0).group_size == 4
    assert registry.grow_group_size(0, 8) is True and registry.get(0).group_size == 8


def test_silent_env_stops_counting_for_min_allocation_and_counts_again():
    """``--env-timeout``: a silent env with a minimum stops blocking batches, until it posts."""
    clock = FakeClock()
    store = RolloutStore(10**9, env_timeout=1, clock=clock)
    store.register_trainer(REG)
    store.next_batch()
    quiet = store.register_env(env_request("quiet", group_size=4, min_batch_allocation=0.5))
    busy = store.register_env(env_request("busy", group_size=4))
    quiet, busy = quiet["env_id"], busy["env_id"]
    store.ingest([incoming(4, busy, tag=t) for t in range(4)])
    # The quiet env has a minimum and nothing queued: no batch (as in the original) ...
    assert store.next_batch() is None
    assert store.status()["inactive_envs"] == []
    clock.advance(1.3)
    store.ingest([incoming(4, busy, tag=9)])  # busy stays alive
    # ... until it has been silent for --env-timeout.
    assert store.status()["inactive_envs"] == [quiet]
    assert "atropos_envs_inactive 1" in render_metrics(store)
    assert len(store.next_batch()) == 2
    store.ingest([incoming(2, quiet, tag=50)])
    assert store.status()["inactive_envs"] == []
    assert store.env_status(busy)["unallocated_fraction"] == 0.5


def test_restored_envs_count_as_just_seen(tmp_path):
    from atroposlib.api.persistence import SqlitePersistence

    clock = FakeClock()
    db = tmp_path / "api.db"
    store = started(RolloutStore(10**9, SqlitePersistence(db), env_timeout=5, clock=clock), a={})
    clock.advance(100)
    assert store.inactive_envs() == [0]
    store.close()
    again = RolloutStore(10**9, SqlitePersistence(db), env_timeout=5, clock=clock)
    assert again.inactive_envs() == []
    clock.advance(6)
    assert again.inactive_envs() == [0]
    again.close()
