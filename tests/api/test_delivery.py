"""Delivery of ``/batch`` (docs/design.md, "Delivery guarantee"): at-least-once to the trainer, exactly-once consumption.

A served batch stays in the store until acknowledged: by ``?ack=<batch_id>``,
by ``POST /batch/ack``, or (clients that never ack) by the next ``/batch``.
The soak at the bottom kills ``run-api --persist`` with ``kill -9`` while it
answers large batches and checks that every acknowledged group reaches exactly
one trainer step; ``benchmarks/delivery_soak.py`` runs it longer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from atroposlib.api.delivery import Delivery, PendingBatch
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.queue import StoredGroup
from atroposlib.api.store import IncomingGroup, RolloutStore, UnknownBatchError
from atroposlib.testing.ports import free_port
from example_trainer.api import BatchClient
from tests.api.conftest import TRAINER, Api, group, start_api

REG = Registration(**{**TRAINER, "batch_size": 4})


def _store(db: Path | None = None) -> RolloutStore:
    store = RolloutStore(10**9, SqlitePersistence(db) if db else None)
    store.register_trainer(REG)
    store.serve_batch(None)
    store.register_env(RegisterEnv(max_token_length=64, desired_name="e", weight=1.0, group_size=4))
    return store


def _post(store: RolloutStore, *tags: int) -> None:
    store.ingest(
        [IncomingGroup(0, 4, json.dumps({"tokens": [[t]] * 4, "env_id": 0}).encode()) for t in tags]
    )


def _tags(served) -> list[int]:
    return [json.loads(b)["tokens"][0][0] for b in served[0]]


def _groups(*seqs: int) -> list[StoredGroup]:
    return [StoredGroup(seq, 0, 4, b"{}") for seq in seqs]


def test_delivery_settles_the_pending_batch_by_the_clients_ack():
    delivery = Delivery()
    assert delivery.settle(None) == [] and delivery.settle("") == []  # nothing pending
    first = delivery.form(1, _groups(1, 2))
    assert first.batch_id == f"{delivery.run_token}-1" and first.live
    assert delivery.settle("") is None and delivery.pending is first  # not received: again
    assert delivery.settle("someone-else") is None
    assert [g.seq for g in delivery.settle(first.batch_id)] == [1, 2]
    assert delivery.pending is None
    second = delivery.form(2, _groups(3))
    assert [g.seq for g in delivery.settle(None)] == [3]  # an old client's next call acks
    assert second.batch_id.endswith("-2")


def test_delivery_serves_a_restored_batch_once_even_to_old_clients():
    delivery = Delivery()
    delivery.pending = PendingBatch("t-4", 4, _groups(1), live=False)
    assert delivery.settle(None) is None and delivery.pending.live
    assert [g.seq for g in delivery.settle(None)] == [1]


@pytest.mark.parametrize("number", ["0", "01", "3", "²", "١", "1" * 19, ""])
def test_delivery_knows_only_the_batch_ids_it_wrote(number):
    delivery = Delivery()
    delivery.form(1, _groups(1))
    delivery.settle(None)
    delivery.form(2, _groups(2))
    assert [g.seq for g in delivery.acknowledge(f"{delivery.run_token}-2")] == [2]
    assert delivery.acknowledge(f"{delivery.run_token}-1") is None  # earlier: already done
    with pytest.raises(UnknownBatchError):
        delivery.acknowledge(f"{delivery.run_token}-{number}")
    with pytest.raises(UnknownBatchError):
        delivery.acknowledge("other-1")


def test_unacknowledged_batch_is_served_again_identical_until_acked():
    store = _store()
    _post(store, 1, 2, 3)
    first = store.serve_batch("")
    assert _tags(first) == [1] and first[2] == 1
    # A client that did not receive it (its last batch_id differs) gets the same batch again.
    assert store.serve_batch("") == first
    assert store.batch_answer("") == store.batch_answer("nonsense")
    # Acknowledging it consumes it: the next batch comes, with the next step.
    second = store.serve_batch(first[1])
    assert _tags(second) == [2] and second[2] == 2 and second[1] != first[1]
    assert store.acknowledge(second[1]) == "acknowledged"
    assert store.acknowledge(second[1]) == "already acknowledged"
    assert _tags(store.serve_batch(second[1])) == [3]
    with pytest.raises(UnknownBatchError):
        store.acknowledge("feedface-99")
    assert store.counters["batches_resent"] == 3


def test_old_clients_acknowledge_by_their_next_call():
    store = _store()
    _post(store, 1, 2)
    assert [json.loads(b)["tokens"][0][0] for b in store.next_batch()] == [1]
    assert [json.loads(b)["tokens"][0][0] for b in store.next_batch()] == [2]
    assert store.next_batch() is None
    assert store.pending is None  # the empty call acknowledged the last batch too


def test_after_a_restart_the_unacknowledged_batch_comes_first_even_to_old_clients(tmp_path):
    db = tmp_path / "api.db"
    store = _store(db)
    _post(store, 1, 2, 3)
    served = store.serve_batch(None)
    store.close()
    again = RolloutStore(10**9, SqlitePersistence(db))
    assert again.serve_batch(None) == served  # identical, with the same batch_id and step
    assert _tags(again.serve_batch(None)) == [2]  # an old client's next call acknowledged it
    # A new client that already holds the batch it was served only consumes it.
    third = again.serve_batch(None)
    again.close()
    restarted = RolloutStore(10**9, SqlitePersistence(db))
    assert restarted.serve_batch(third[1]) is None and restarted.pending is None
    assert restarted.step == third[2]


def test_reset_drops_the_unacknowledged_batch_and_ids_keep_rising():
    store = _store()
    _post(store, 1)
    first = store.serve_batch("")
    store.reset()
    store.register_trainer(REG)
    store.serve_batch("")
    store.register_env(RegisterEnv(max_token_length=64, desired_name="e", weight=1.0, group_size=4))
    _post(store, 2)
    second = store.serve_batch(first[1])
    assert _tags(second) == [2] and second[1] != first[1]


def test_http_batch_carries_id_and_step_and_ack_endpoint(fresh: Api):
    c = fresh.client
    fresh.start_trainer(batch_size=4)
    env = fresh.register_env(group_size=4)
    for tag in (1, 2):
        c.post("/scored_data", json=group(4, env_id=env, base=tag))
    first = c.get("/batch", params={"ack": ""})
    assert set(first.json()) == {"batch", "batch_id", "step"} and first.json()["step"] == 1
    # Not acknowledged: the very same bytes again.
    assert c.get("/batch", params={"ack": ""}).content == first.content
    batch_id = first.json()["batch_id"]
    assert c.post("/batch/ack", json={"batch_id": batch_id}).json() == {
        "status": "acknowledged",
        "batch_id": batch_id,
    }
    assert c.post("/batch/ack", json={"batch_id": "x-1"}).status_code == 404
    assert c.post("/batch/ack", json={}).status_code == 422
    second = c.get("/batch", params={"ack": batch_id}).json()
    assert second["batch"][0]["tokens"][0][0] // 1000 == 2 and second["step"] == 2
    assert c.get("/status").json()["unacknowledged_batch"] == second["batch_id"]
    assert c.get("/batch", params={"ack": second["batch_id"]}).json() == {"batch": None}
    assert c.get("/status").json()["unacknowledged_batch"] is None


def test_trainer_client_skips_a_batch_it_already_has(fresh: Api):
    c = fresh.client
    fresh.start_trainer(batch_size=4)
    env = fresh.register_env(group_size=4)
    for tag in (1, 2):
        c.post("/scored_data", json=group(4, env_id=env, base=tag))
    trainer = BatchClient(fresh.base_url)
    assert trainer.get_batch()[0]["tokens"][0][0] // 1000 == 1
    held = trainer.last_batch_id
    # A trainer restarted before training on it gets it again ...
    restarted = BatchClient(fresh.base_url)
    assert restarted.get_batch()[0]["tokens"][0][0] // 1000 == 1
    assert restarted.last_batch_id == held
    # ... and one resumed from a checkpoint that holds its id goes on to the next.
    resumed = BatchClient(fresh.base_url, last_batch_id=held)
    assert resumed.get_batch()[0]["tokens"][0][0] // 1000 == 2
    assert resumed.get_batch() is None


# ------------------------------------------------------------------ kill -9 soak


@dataclass
class SoakResult:
    """What the trainer saw: the tags of each trainer step, and the kills done."""

    steps: list[list[int]] = field(default_factory=list)
    kills: int = 0
    kills_mid_answer: int = 0


def kill_during_batches(
    tmp_path: Path,
    kills: int,
    groups: int = 48,
    seq_len: int = 6000,
    seed: int = 0,
    max_delay: float = 0.05,
) -> tuple[list[int], SoakResult]:
    """Post ``groups`` groups to ``run-api --persist``, then train through ``kills`` kill -9s.

    A trainer thread pulls batches of 4 groups (each group 4 x ``seq_len``
    tokens, ~0.2 MB of JSON) with :class:`BatchClient`; right after it sends
    a request the API is killed at a random delay in ``[0, max_delay]`` s and
    restarted on the same database. Returns the acknowledged tags and what
    the trainer trained on.
    """
    rng = random.Random(seed)
    db = str(tmp_path / "soak.db")
    port = free_port()
    result = SoakResult()
    acked: list[int] = []
    ctx, url = start_api(tmp_path, "--persist", db, port=port)
    proc = ctx.__enter__()
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            c.post("/register", json={**TRAINER, "batch_size": 16})
            c.get("/batch", params={"ack": ""})
            env = c.post(
                "/register-env",
                json={"max_token_length": 64, "desired_name": "s", "weight": 1.0, "group_size": 4},
            ).json()["env_id"]
            for tag in range(1, groups + 1):
                r = c.post("/scored_data", json=group(4, seq_len=seq_len, env_id=env, base=tag))
                assert r.status_code == 200, r.text
                acked.append(tag)
        asking = threading.Event()
        done = threading.Event()

        def train() -> None:
            trainer = BatchClient(url, client=httpx.Client(timeout=30))
            trainer._client.event_hooks["request"] = [lambda request: asking.set()]  # type: ignore[union-attr]
            while not done.is_set():
                try:
                    batch = trainer.get_batch()
                except (httpx.HTTPError, OSError):
                    time.sleep(0.05)
                    continue
                if batch is None:
                    done.set()
                    return
                result.steps.append([g["tokens"][0][0] // 1000 for g in batch])

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        for _ in range(kills):
            asking.clear()
            if not asking.wait(timeout=60) or done.is_set():
                break
            time.sleep(rng.uniform(0, max_delay))
            steps_before = len(result.steps)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            result.kills += 1
            result.kills_mid_answer += len(result.steps) == steps_before
            ctx.__exit__(None, None, None)
            ctx, url_again = start_api(tmp_path, "--persist", db, port=port)
            assert url_again == url
            proc = ctx.__enter__()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the trainer never finished draining"
    finally:
        ctx.__exit__(None, None, None)
    return acked, result


def test_kill_9_during_batch_answers_loses_nothing_and_trains_nothing_twice(tmp_path):
    # 24 batches for 4 kills: between two restarts the trainer may drain several batches,
    # and the kills must not run out of batches to interrupt.
    acked, result = kill_during_batches(tmp_path, kills=4, seed=1, groups=96)
    trained = [tag for step in result.steps for tag in step]
    assert result.kills >= 3
    assert sorted(trained) == acked, "every acknowledged group reaches exactly one trainer step"
    assert all(len(step) == 4 for step in result.steps)
