"""``run-api --max-staleness``: stale groups are dropped (counted per env), ``/batch`` reports
the staleness of what it serves and ``/status-env`` the current version."""

from __future__ import annotations

import json
import random
import re

from atroposlib.api.models import Registration
from atroposlib.api.queue import StoredGroup
from atroposlib.api.staleness import histogram
from atroposlib.api.store import IncomingGroup, RolloutStore

from .conftest import Api, group, start_api

MESSAGES = [[{"role": "user", "content": "hi"}]] * 4


def _versioned(env: int, base: int, version: int | None, slow: bool = False) -> dict:
    extra: dict = {}
    if version is not None:
        extra["policy_version"] = [version + 1, version, version + 2, version]
        extra["policy_version_max"] = [version + 2] * 4
    if slow:  # messages send the group through the pydantic path
        extra["messages"] = MESSAGES
    return group(4, env_id=env, base=base, **extra)


def _dropped(metrics: str) -> dict[str, int]:
    found = re.findall(
        r'^atropos_stale_groups_dropped_total\{env_id="(\d+)"\} (\d+)$', metrics, re.M
    )
    return {env: int(n) for env, n in found}


def test_slow_trainer_drops_exactly_the_groups_beyond_k(tmp_path):
    ctx, url = start_api(tmp_path, "--max-staleness", "1")
    with ctx:
        api = Api(url)
        api.start_trainer(batch_size=4)
        a, b = api.register_env("a"), api.register_env("b")
        status = api.client.get("/status-env", params={"env_id": a}).json()
        assert status["current_version"] == 0 and status["max_staleness"] == 1
        # The envs run ahead of a trainer that takes one group per step.
        for i in range(4):
            api.client.post("/scored_data", json=_versioned(a, 10 + i, 0)).raise_for_status()
        posts = [_versioned(b, 20, 1, slow=True), _versioned(b, 21, 1, slow=True)]
        posts.append(_versioned(b, 22, None))
        api.client.post("/scored_data_list", json=posts).raise_for_status()

        served = []
        for _ in range(5):
            body = api.client.get("/batch").json()
            if body["batch"] is None:
                break
            (g,) = body["batch"]
            served.append((g["tokens"][0][0] // 1000, body["staleness"]))
        # step 0: a0 (0 behind); step 1: a1 (1 behind); step 2: a2, a3 dropped (2 behind),
        # b0 served (1 behind); step 3: b1 dropped, the unversioned b2 served.
        assert served == [
            (10, {"0": 1, "unknown": 0}),
            (11, {"1": 1, "unknown": 0}),
            (20, {"1": 1, "unknown": 0}),
            (22, {"unknown": 1}),
        ]
        metrics = api.client.get("/metrics").text
        assert _dropped(metrics) == {str(a): 2, str(b): 1}
        status = api.client.get("/status-env", params={"env_id": b}).json()
        assert status["current_version"] == 4
        api.client.close()


def test_without_the_flag_nothing_is_dropped_and_versions_are_kept(fresh: Api):
    fresh.start_trainer(batch_size=4)
    env = fresh.register_env()
    fresh.client.post("/scored_data", json=_versioned(env, 30, 0)).raise_for_status()
    for _ in range(3):  # the step moves on: the group is now 3 versions behind
        fresh.client.post("/scored_data", json=group(4, env_id=env, base=31))
        fresh.client.get("/batch")
    fresh.client.post("/scored_data", json=group(4, env_id=env, base=32))
    status = fresh.client.get("/status-env", params={"env_id": env}).json()
    assert "max_staleness" not in status
    body = fresh.client.get("/batch").json()
    assert body["batch"] is not None
    unversioned = fresh.client.get("/batch").json()
    assert "staleness" not in unversioned or unversioned["batch"] is None
    assert "atropos_stale_groups_dropped_total 0" in fresh.client.get("/metrics").text


def test_versions_survive_to_the_trainer_as_posted(fresh: Api):
    fresh.start_trainer(batch_size=4)
    env = fresh.register_env()
    fresh.client.post("/scored_data", json=_versioned(env, 40, 5)).raise_for_status()
    (g,) = fresh.client.get("/batch").json()["batch"]
    assert g["policy_version"] == [6, 5, 7, 5] and g["policy_version_max"] == [7] * 4


def _store(max_staleness: int) -> RolloutStore:
    store = RolloutStore(1 << 30, max_staleness=max_staleness)
    store.register_trainer(
        Registration(
            wandb_group="g",
            wandb_project="p",
            batch_size=2,
            max_token_len=64,
            checkpoint_dir="c",
            save_checkpoint_interval=-1,
            starting_step=0,
            num_steps=1000,
        )
    )
    store.serve_batch(None)
    return store


def test_random_interleavings_match_a_reference_model():
    rng = random.Random(7)
    for trial in range(30):
        k = rng.randint(0, 3)
        store = _store(k)
        queue: list[tuple[int, int | None, int]] = []  # (seq, version, env) FIFO
        expected_dropped: dict[int, int] = {}
        step = 0
        for seq in range(60):
            if rng.random() < 0.6:
                version = None if rng.random() < 0.2 else rng.randint(max(0, step - 4), step)
                env = rng.randint(0, 1)
                body = json.dumps({"id": seq}).encode()
                store.ingest([IncomingGroup(None, 2, body, version)])
                queue.append((seq, version, env))
            else:
                stale = [q for q in queue if q[1] is not None and step - q[1] > k]
                for q in stale:
                    queue.remove(q)
                    expected_dropped[q[2]] = expected_dropped.get(q[2], 0) + 1
                served = store.next_batch()
                if queue:
                    head = queue.pop(0)
                    assert served is not None and json.loads(served[0])["id"] == head[0], trial
                    step += 1
                else:
                    assert served is None
        assert store.counters["stale_dropped"] == sum(expected_dropped.values()), trial
        assert store.step == step


def test_histogram_counts_versions_behind_and_unknown():
    groups = [StoredGroup(i, 0, 2, b"{}", version=v) for i, v in enumerate([5, 3, None, 5])]
    assert histogram(5, groups) == {"0": 2, "2": 1, "unknown": 1}
