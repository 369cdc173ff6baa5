"""``run-api --persist``: acknowledged groups survive ``kill -9``; nothing is consumed twice."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from atroposlib.testing.ports import free_port
from tests.api.conftest import TRAINER, group, start_api


def _drain(c: httpx.Client, seen: set[str]) -> list[int]:
    """Tags of every batch not seen before (by ``batch_id``), as an old client polls."""
    served = []
    while True:
        answer = c.get("/batch").json()
        if answer["batch"] is None:
            return served
        if answer["batch_id"] in seen:
            continue
        seen.add(answer["batch_id"])
        served += [g["tokens"][0][0] // 1000 for g in answer["batch"]]


def _post_until(
    url: str, env: int, first_tag: int, stop: threading.Event, acked: list[int]
) -> None:
    """Post groups tagged ``first_tag``, ``first_tag + 1``, ... until ``stop`` or the server
    goes away; the tags answered 200 go to ``acked`` (``list.append`` is atomic)."""
    tag = first_tag
    with httpx.Client(base_url=url, timeout=5) as poster:
        while not stop.is_set():
            try:
                r = poster.post("/scored_data", json=group(4, env_id=env, base=tag))
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                acked.append(tag)
            tag += 1


def _wait_for_acks(acked: list[int], more_than: int, timeout: float = 60.0) -> None:
    """Wait until the posters have more than ``more_than`` answered posts (the kill then
    lands while they post, however loaded the machine is)."""
    deadline = time.monotonic() + timeout
    while len(acked) <= more_than:
        assert time.monotonic() < deadline, f"only {len(acked)} posts answered in {timeout} s"
        time.sleep(0.01)


def test_kill_9_loses_no_acknowledged_group_and_serves_nothing_twice(tmp_path):
    db = str(tmp_path / "api.db")
    port = free_port()
    acked: list[int] = []
    served_before: list[int] = []
    ctx, url = start_api(tmp_path, "--persist", db, port=port)
    with ctx as proc, httpx.Client(base_url=url, timeout=10) as c:
        c.post("/register", json={**TRAINER, "batch_size": 4, "starting_step": 3})
        c.get("/batch")
        env = c.post(
            "/register-env",
            json={
                "max_token_length": 64,
                "desired_name": "persist",
                "weight": 2.0,
                "group_size": 4,
            },
        ).json()["env_id"]
        for tag in (1, 2, 3):
            assert c.post("/scored_data", json=group(4, env_id=env, base=tag)).status_code == 200
            acked.append(tag)
        first = c.get("/batch").json()
        served_before.append(first["batch"][0]["tokens"][0][0] // 1000)
        assert (
            c.post("/scored_data", json=group(2, env_id=env, base=90)).json()["status"]
            == "buffered"
        )

        stop = threading.Event()
        thread = threading.Thread(target=_post_until, args=(url, env, 100, stop, acked))
        thread.start()
        _wait_for_acks(acked, 5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        stop.set()
        thread.join(timeout=10)
    assert len(acked) > 5

    ctx, url = start_api(tmp_path, "--persist", db, port=port)
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/info").json() == {"batch_size": 4, "max_token_len": 512}
        assert c.get("/wandb_info").json() == {"group": "grp", "project": "proj"}
        assert c.get("/status").json()["current_step"] == 4
        status = c.get("/status-env", params={"env_id": env}).json()
        assert status["env_weight"] == 1.0 and status["current_step"] == 4
        # The env registry survived: a new env gets the next id and a distinct name.
        again = c.post(
            "/register-env",
            json={
                "max_token_length": 64,
                "desired_name": "persist",
                "weight": 1.0,
                "group_size": 4,
            },
        ).json()
        assert (again["env_id"], again["wandb_name"]) == (env + 1, "persist_1")
        # The buffered half-group is still there: completing it puts both halves on the queue.
        assert c.post("/scored_data", json=group(2, env_id=env, base=91)).json() == {
            "status": "buffered",
            "buffer_size": 0,
        }
        # The batch served before the crash was never acknowledged: it is served again,
        # identical, before anything else.
        again = c.get("/batch").json()
        assert again == first
        served_after = _drain(c, {first["batch_id"]})
    assert served_after[: len(acked) - 1] == [t for t in acked if t not in served_before]
    unacked = served_after[len(acked) - 1 :]
    assert unacked[-2:] == [90, 91] and len(unacked) <= 3  # at most the one in-flight post extra
    assert not set(served_before) & set(served_after)


def test_kill_9_under_concurrent_posts_keeps_every_acknowledged_group(tmp_path):
    """Group commit: with many posters at once, every post answered 200 is on disk."""
    db = str(tmp_path / "api.db")
    port = free_port()
    acked: list[int] = []
    ctx, url = start_api(tmp_path, "--persist", db, port=port)
    with ctx as proc, httpx.Client(base_url=url, timeout=10) as c:
        c.post("/register", json={**TRAINER, "batch_size": 4})
        c.get("/batch")
        env = c.post(
            "/register-env",
            json={"max_token_length": 64, "desired_name": "gc", "weight": 1.0, "group_size": 4},
        ).json()["env_id"]
        stop = threading.Event()
        threads = [
            threading.Thread(target=_post_until, args=(url, env, 1 + 1000 * i, stop, acked))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        _wait_for_acks(acked, 20)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert len(acked) > 20

    ctx, url = start_api(tmp_path, "--persist", db, port=port)
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        served = _drain(c, set())
    assert set(acked) <= set(served)  # at most the in-flight posts extra, never one missing
    assert len(served) - len(acked) <= 8 and len(set(served)) == len(served)


def test_persistence_swap_reads_in_order_across_chunks_and_is_all_or_nothing(tmp_path):
    from atroposlib.api.errors import StorageError
    from atroposlib.api.persistence import GroupRow, SqlitePersistence

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
