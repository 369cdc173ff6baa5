"""``run-api`` hardening: browser guard, bounded buffer, env timeout, weights, damaged
databases, in-flight bodies, API key handling (issue items 7-13)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sqlite3
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.recovery import check_database
from atroposlib.api.store import IncomingGroup, RolloutStore
from atroposlib.api.utils import find_groups_summing_to_target
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON
from tests.api.conftest import TRAINER, Api, group, start_api

REG = Registration(**{**TRAINER, "batch_size": 8})


def _started(store: RolloutStore, group_size: int = 8, **env) -> RolloutStore:
    store.register_trainer(REG)
    store.serve_batch(None)
    store.register_env(
        RegisterEnv(max_token_length=64, desired_name="e", weight=1.0, group_size=group_size, **env)
    )
    return store


def _g(size: int, tag: int, env_id: int | None = 0, pad: int = 0) -> IncomingGroup:
    body = {"tokens": [[tag]] * size, "env_id": env_id, "pad": "x" * pad}
    return IncomingGroup(env_id, size, json.dumps(body).encode())


# ------------------------------------------------------------ 7. browser guard


@pytest.mark.parametrize(
    "path", ["/scored_data", "/scored_data_list", "/register", "/register-env"]
)
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_non_json_bodies_are_415(fresh: Api, path: str, content_type: str):
    r = fresh.client.post(path, content=b'{"a": 1}', headers={"Content-Type": content_type})
    assert r.status_code == 415 and content_type in r.json()["detail"]


def test_foreign_origin_is_refused_everywhere_and_host_must_be_loopback(fresh: Api):
    evil = {"Origin": "http://evil.example"}
    for method, path in [
        ("GET", "/status"),
        ("GET", "/info"),
        ("GET", "/batch"),
        ("GET", "/metrics"),
        ("POST", "/scored_data"),
        ("POST", "/register"),
    ]:
        r = fresh.client.request(method, path, headers=evil, json={})
        assert r.status_code == 403, (method, path)
    preflight = fresh.client.options(
        "/scored_data", headers={**evil, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403
    assert fresh.client.get("/status", headers={"Host": "attacker.example"}).status_code == 403
    assert fresh.client.get("/status", headers={"Host": "localhost:1234"}).status_code == 200


def test_reset_data_is_post_and_get_only_without_browser_headers(fresh: Api):
    fresh.start_trainer()
    assert fresh.client.get("/reset_data", headers={"Origin": "http://evil.example"}).status_code
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": fresh.base_url}):
        r = fresh.client.get("/reset_data", headers=headers)
        assert r.status_code == 403 and "POST /reset_data" in r.json()["detail"]
        assert fresh.client.get("/info").json()["batch_size"] == 8  # nothing was reset
    # A browser GET cannot consume batches either.
    assert fresh.client.get("/batch", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert fresh.client.post("/reset_data").text == "Reset successful"
    assert fresh.client.get("/info").json()["batch_size"] == -1
    assert fresh.client.get("/reset_data").text == "Reset successful"  # old clients


# ------------------------------------------------------------ 8. mixed-size buffer


def test_buffered_groups_show_in_status_status_env_and_metrics(fresh: Api):
    fresh.start_trainer()
    env = fresh.register_env(group_size=8)
    fresh.client.post("/scored_data", json=group(3, env_id=env))
    assert fresh.client.get("/status").json()["buffered_groups"] == 1
    status = fresh.client.get("/status-env", params={"env_id": env}).json()
    assert status["self_buffered_groups"] == 1
    metrics = fresh.client.get("/metrics").text
    assert f'atropos_buffer_groups{{env_id="{env}"}} 1' in metrics
    assert f'atropos_buffer_sequences{{env_id="{env}"}} 3' in metrics
    assert 'atropos_buffer_dropped_total{reason="buffer_full"} 0' in metrics


def test_unmatchable_groups_never_block_the_queue(fresh: Api):
    """Size-3 groups with group_size 8 never add up; they used to fill the queue budget (2 MiB
    here) so that every post got 503 forever. Now the buffer's own bound drops the oldest."""
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=8)
    for i in range(180):  # ~3 MiB of posts, more than the whole queue budget
        r = fresh.client.post("/scored_data", json=group(3, seq_len=800, env_id=env, base=i))
        assert r.status_code == 200, (i, r.text)
    metrics = fresh.client.get("/metrics").text
    dropped = [ln for ln in metrics.splitlines() if ln.startswith("atropos_buffer_dropped_total")]
    assert int(dropped[0].split()[-1]) > 0
    # Full groups still go through and are served.
    assert fresh.client.post("/scored_data", json=group(8, env_id=env, base=999)).status_code == 200
    assert fresh.client.get("/batch").json()["batch"][0]["tokens"][0][0] // 1000 == 999


def test_buffer_bound_releases_packable_groups_and_drops_the_rest(caplog):
    store = _started(RolloutStore(10**9, max_buffer_bytes=3000), group_size=8)
    store.ingest([_g(4, 1, pad=400)])  # 4 divides 8: released onto the queue when evicted
    with caplog.at_level(logging.WARNING, logger="atroposlib.api.store"):
        for tag in range(2, 12):
            store.ingest([_g(3, tag, pad=400)])  # 3 + 3 and 3 + 4 never make 8
    assert store.buffered_bytes <= 3000
    assert store.counters["buffer_released"] == 1 and [g.size for g in store.queue] == [4]
    assert store.counters["buffer_dropped"] >= 1
    assert any("reason: buffer_full" in r.message for r in caplog.records)
    survivors = [json.loads(b)["tokens"][0][0] for b in _bodies(store)]
    assert survivors == sorted(survivors) and survivors[-1] == 11  # the newest stay


def _bodies(store: RolloutStore) -> list[bytes]:
    return [g.body for g in store.buffered(0)]


def test_buffer_bound_is_at_most_half_the_queue_budget():
    assert RolloutStore(1000, max_buffer_bytes=10**9).max_buffer_bytes == 500


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=60),
    target=st.sampled_from([4, 6, 8]),
)
def test_buffer_matching_is_the_originals_choice(sizes: list[int], target: int):
    """Post by post, the same groups leave the buffer as with the original's whole-buffer search."""
    store = _started(RolloutStore(10**9), group_size=target)
    reference: list[tuple[int, int]] = []  # (tag, size) in arrival order
    for tag, size in enumerate(sizes, start=1):
        queued_before = len(store.queue)
        store.ingest([_g(size, tag)])
        if size == target:
            assert len(store.queue) == queued_before + 1
            continue
        reference.append((tag, size))
        picked = find_groups_summing_to_target([{"tokens": range(s)} for _, s in reference], target)
        flushed = [reference[i][0] for i in picked]
        reference = [r for i, r in enumerate(reference) if i not in set(picked)]
        got = [json.loads(g.body)["tokens"][0][0] for g in list(store.queue)[queued_before:]]
        assert got == flushed
    assert [json.loads(g.body)["tokens"][0][0] for g in store.buffered(0)] == [
        t for t, _ in reference
    ]


def test_buffer_matching_looks_at_a_bounded_number_of_groups():
    """Whatever waits in the buffer, a post considers at most ~target*ln(target) groups."""
    store = _started(RolloutStore(10**9), group_size=8)
    store.ingest([_g(3, tag) for tag in range(5000)])
    buf = store.buffer.of(0)
    assert buf.groups == 5000
    assert len(buf.candidates(8)) == 2  # only two size-3 groups can take part in a sum to 8
    store.ingest([_g(5, 9999)])
    assert buf.groups == 4999 and len(store.queue) == 2


# ------------------------------------------------------------ 9. --env-timeout


# Tested in-process on a fake clock: tests/api/test_registry.py.


# ------------------------------------------------------------ 10. weights


@pytest.mark.parametrize("weight", ["Infinity", "-Infinity", "NaN", "1e308", "1e6.5", "0", "-3"])
def test_register_env_weight_must_be_finite_positive_and_bounded(fresh: Api, weight: str):
    fresh.start_trainer()
    body = (
        f'{{"max_token_length": 8, "desired_name": "w", "group_size": 4, "weight": {weight}}}'
    ).encode()
    r = fresh.client.post(
        "/register-env", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422, r.text
    if weight != "1e6.5":
        assert r.json()["detail"][0]["loc"] == ["body", "weight"]


def test_register_env_keeps_the_ignore_weight_sentinel_and_large_weights(fresh: Api):
    fresh.start_trainer()
    fresh.register_env(weight=-1)
    fresh.register_env(weight=1e6)


# ------------------------------------------------------------ 11. damaged databases

_CRASH = """
import json, os, signal, sys
from atroposlib.api.models import RegisterEnv, Registration
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import IncomingGroup, RolloutStore
store = RolloutStore(10**9, SqlitePersistence(sys.argv[1]))
store.register_trainer(Registration(**json.loads(sys.argv[2])))
store.serve_batch(None)
store.register_env(RegisterEnv(max_token_length=8, desired_name="d", weight=1.0, group_size=4))
for tag in range(int(sys.argv[3])):
    body = json.dumps({"tokens": [[tag] * 1500] * 4, "env_id": 0}).encode()
    store.ingest([IncomingGroup(0, 4, body)])
if sys.argv[4] == "close":
    store.close()
else:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _database(tmp_path: Path, groups: int = 40, how: str = "kill") -> Path:
    """A --persist database with ``groups`` groups, left by a killed (or closed) server."""
    db = tmp_path / "src" / "api.db"
    db.parent.mkdir(exist_ok=True)
    subprocess.run(
        [PYTHON, "-c", _CRASH, str(db), json.dumps(TRAINER), str(groups), how], check=False
    )
    return db


def _copy(db: Path, dest: Path) -> Path:
    dest.mkdir()
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{db}{suffix}").exists():
            shutil.copy(f"{db}{suffix}", dest / f"api.db{suffix}")
    return dest / "api.db"


def _garbage(path: Path, at: float = 0.5, size: int = 6000) -> None:
    with path.open("r+b") as f:
        f.seek(int(path.stat().st_size * at))
        f.write(random.Random(7).randbytes(size))


def _damage(kind: str, db: Path) -> Path:
    wal = Path(f"{db}-wal")
    if kind == "zero-length main":
        os.truncate(db, 0)
        return db
    if kind == "zero-length WAL":
        os.truncate(wal, 0)
        return wal
    if kind == "truncated WAL":
        os.truncate(wal, wal.stat().st_size // 2)
        return wal
    if kind == "garbage mid-WAL":
        _garbage(wal)
        return wal
    raise AssertionError(kind)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    return _database(tmp_path_factory.mktemp("crashed"))


@pytest.mark.parametrize(
    "kind", ["zero-length main", "zero-length WAL", "truncated WAL", "garbage mid-WAL"]
)
def test_damaged_database_after_a_crash_refuses_to_start_and_says_how_to_recover(
    crashed: Path, tmp_path, kind: str, caplog, monkeypatch
):
    import atroposlib.cli.run_api as run_api

    monkeypatch.setattr(run_api.uvicorn, "run", lambda *a, **k: None)
    assert check_database(crashed) is None  # the crash itself damages nothing
    db = _copy(crashed, tmp_path / "copy")
    damaged = _damage(kind, db)
    for _ in range(2):  # the check leaves the evidence: a second start refuses too
        caplog.clear()
        with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as info:
            run_api.main(["--persist", str(db), "--port", "1"])
        assert info.value.code == 2
        message = " ".join(r.getMessage() for r in caplog.records)
        assert str(damaged) in message and "--persist-recover" in message


def test_garbage_in_a_checkpointed_database_is_caught(tmp_path):
    db = _database(tmp_path, groups=40, how="close")
    assert check_database(db) is None
    _garbage(db, at=0.5)
    problem = check_database(db)
    assert problem is not None and str(db) in problem


def test_persist_recover_salvages_what_it_can_and_reports_it(tmp_path, caplog, monkeypatch):
    import atroposlib.cli.run_api as run_api
    from atroposlib.api import server

    monkeypatch.setattr(run_api.uvicorn, "run", lambda *a, **k: None)
    built = []
    create = server.create_app
    monkeypatch.setattr(server, "create_app", lambda s: built.append(create(s)) or built[-1])
    db = _database(tmp_path, groups=40)
    _damage("truncated WAL", db)
    with caplog.at_level(logging.WARNING):
        run_api.main(["--persist", str(db), "--port", "1", "--persist-recover"])
    store = built[0].atropos_store
    restored = [r.getMessage() for r in caplog.records if "restored" in r.getMessage()]
    assert restored and f"restored {len(store.queue)} groups" in restored[0]
    assert 0 < len(store.queue) < 40 and store.registered and len(store.envs) == 1
    store.close()
    assert list(tmp_path.glob("src/api.db.damaged-*"))  # the damaged files are kept
    assert check_database(db) is None


def test_damaged_database_exits_without_a_traceback(
    crashed: Path, tmp_path, caplog, capsys, monkeypatch
):
    import atroposlib.cli.run_api as run_api

    def serve(*args, **kwargs):
        raise AssertionError("run-api started on a damaged database")

    monkeypatch.setattr(run_api.uvicorn, "run", serve)
    db = _copy(crashed, tmp_path / "copy")
    _damage("truncated WAL", db)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as info:
        run_api.main(["--persist", str(db), "--port", str(free_port())])
    captured = capsys.readouterr()
    out = caplog.text + captured.out + captured.err
    assert info.value.code == 2 and "--persist-recover" in out and "Traceback" not in out


# ------------------------------------------------------------ 12. in-flight bodies
# (tests/api/test_body_budget.py)


# ------------------------------------------------------------ 13. API key


def test_key_on_the_command_line_is_warned_about_and_key_file_is_not(tmp_path, caplog, monkeypatch):
    import atroposlib.cli.run_api as run_api

    seen = []
    monkeypatch.setattr(run_api.uvicorn, "run", lambda app, **k: seen.append(app))
    monkeypatch.delenv("ATROPOS_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING):
        run_api.main(["--api-key", "sekret", "--port", "1"])
    assert any(
        "ATROPOS_API_KEY" in r.getMessage() and "ps" in r.getMessage() for r in caplog.records
    )
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_api.main(["--api-key-file", str(key_file), "--port", "1"])
    assert not any("visible" in r.getMessage() for r in caplog.records)
    from starlette.testclient import TestClient

    with TestClient(seen[-1], base_url="http://127.0.0.1") as client:
        assert client.get("/status").status_code == 401
        ok = client.get("/status", headers={"Authorization": "Bearer from-file"})
        assert ok.status_code == 200
    with pytest.raises(SystemExit):
        run_api.main(["--api-key-file", str(tmp_path / "missing"), "--port", "1"])


def test_api_key_file_works_for_a_real_server(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k3y")
    ctx, url = start_api(tmp_path, "--api-key-file", str(key_file))
    with ctx:
        api = Api(url)
        assert api.client.get("/status").status_code == 401
        assert api.client.get("/status", headers={"Authorization": "Bearer k3y"}).status_code == 200
        api.client.close()


def _checkpoint_page_one(db: Path) -> None:
    """Do what a checkpoint killed after its first write leaves: the WAL's newest committed
    page 1 (the header, with the grown page count) copied into a main file not yet extended."""
    wal = Path(f"{db}-wal").read_bytes()
    (page,) = struct.unpack_from(">I", wal, 8)
    newest = committed = None
    for at in range(32, len(wal) - page - 24 + 1, page + 24):
        number, commit = struct.unpack_from(">II", wal, at)
        if number == 1:
            newest = wal[at + 24 : at + 24 + page]
        if commit and newest is not None:
            committed = newest
    assert committed is not None
    with db.open("r+b") as f:
        f.write(committed)


def test_a_server_killed_mid_checkpoint_leaves_a_sound_database(crashed: Path, tmp_path):
    db = _copy(crashed, tmp_path / "copy")
    _checkpoint_page_one(db)
    header = db.read_bytes()[:100]
    (page,), (pages,) = struct.unpack_from(">H", header, 16), struct.unpack_from(">I", header, 28)
    assert db.stat().st_size < pages * page  # shorter than its header says, as in the crash
    assert check_database(db) is None  # the WAL still holds every page the file lacks
    conn = sqlite3.connect(str(db))
    try:
        assert conn.execute("SELECT count(*) FROM groups").fetchone()[0] == 40
    finally:
        conn.close()
