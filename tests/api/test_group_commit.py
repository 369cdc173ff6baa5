"""``--persist`` group commit: posts of one event-loop turn share one SQLite transaction,
and none is answered ``received`` before its rows are committed."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any, List

import pytest

from atroposlib.api import APISettings, create_app
from atroposlib.api.errors import StorageError
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import RolloutStore
from tests.api.conftest import group
from tests.api.store_helpers import incoming, started


def _rows(path) -> int:
    with sqlite3.connect(str(path)) as conn:  # a second connection sees committed rows only
        return conn.execute("SELECT count(*) FROM groups").fetchone()[0]


def _persisted(tmp_path) -> tuple[RolloutStore, Any]:
    path = tmp_path / "api.db"
    return started(RolloutStore(10**9, persistence=SqlitePersistence(path)), e=dict()), path


def test_deferred_ingests_are_committed_together_by_flush(tmp_path):
    store, path = _persisted(tmp_path)
    for tag in range(3):
        store.ingest([incoming(4, env_id=0, tag=tag)], defer=True)
    ticket = store.pending_ticket
    assert ticket is not None and not ticket.done
    assert len(store.queue) == 3 and _rows(path) == 0
    store.flush()
    assert ticket.done and ticket.error is None and store.pending_ticket is None
    assert _rows(path) == 3
    assert all(g.body is None for g in store.queue)  # the bytes live in the database now
    assert json.loads(store.latest)["tokens"][0] == [2]


def test_any_other_commit_and_batch_reads_include_the_deferred_rows_first(tmp_path):
    store, path = _persisted(tmp_path)
    store.ingest([incoming(4, env_id=0, tag=1)], defer=True)
    store.ingest([incoming(4, env_id=0, tag=2)])  # an immediate commit takes the deferred one too
    assert _rows(path) == 2 and store.pending_ticket is None
    store.ingest([incoming(4, env_id=0, tag=3)], defer=True)
    store.ingest([incoming(4, env_id=0, tag=4)], defer=True)
    bodies, _, _ = store.serve_batch("")
    assert [json.loads(b)["tokens"][0] for b in bodies] == [[1], [2]]
    bodies, batch_id, _ = store.serve_batch(None)
    assert [json.loads(b)["tokens"][0] for b in bodies] == [[3], [4]]


def test_a_failed_group_commit_reaches_every_deferred_post_and_memory_matches_disk(
    tmp_path, monkeypatch
):
    store, path = _persisted(tmp_path)
    store.ingest([incoming(4, env_id=0, tag=1)])
    store.ingest([incoming(4, env_id=0, tag=2)], defer=True)
    store.ingest([incoming(4, env_id=0, tag=3)], defer=True)
    ticket = store.pending_ticket

    def broken(changes):
        raise StorageError("disk full")

    monkeypatch.setattr(store._db, "commit_many", broken)
    with pytest.raises(StorageError):
        store.flush()
    assert ticket is not None and ticket.done and isinstance(ticket.error, StorageError)
    assert len(store.queue) == 1 and _rows(path) == 1  # reloaded: only what is on disk


def _post(path: str, body: bytes) -> tuple[dict, dict]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    return (
        {
            "type": "http",
            "http_version": "1.1",
            "scheme": "http",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "headers": headers,
            "query_string": b"",
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
        },
        {"type": "http.request", "body": body, "more_body": False},
    )


async def _call(app: Any, path: str, body: bytes) -> tuple[int, dict, bytes]:
    """One POST straight through the app's ASGI stack (guards, routes, group commit)."""
    scope, message = _post(path, body)
    sent: List[dict] = []

    async def receive() -> dict:
        return message

    async def send(m: dict) -> None:
        sent.append(m)

    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def _hot(tmp_path, monkeypatch, fail: bool = False):
    store, path = _persisted(tmp_path)
    calls: List[int] = []
    real = store._db.commit_many

    def counting(changes):
        calls.append(len(changes))
        if fail:
            raise StorageError("disk full")
        real(changes)

    monkeypatch.setattr(store._db, "commit_many", counting)

    return create_app(APISettings(), store), store, path, calls


def test_posts_of_one_loop_turn_share_one_transaction(tmp_path, monkeypatch):
    app, store, path, calls = _hot(tmp_path, monkeypatch)
    bodies = [json.dumps(group(4, env_id=0, base=b)).encode() for b in range(1, 7)]
    listed = json.dumps([group(4, env_id=0, base=7), group(4, env_id=0, base=8)]).encode()

    async def main():
        return await asyncio.gather(
            *(_call(app, "/scored_data", b) for b in bodies),
            _call(app, "/scored_data_list", listed),
        )

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [200] * 7
    assert calls == [7]  # one transaction holding the seven posts' changes
    assert _rows(path) == 8 and len(store.queue) == 8


def test_a_failed_group_commit_answers_every_post_503_and_keeps_nothing(tmp_path, monkeypatch):
    app, store, path, calls = _hot(tmp_path, monkeypatch, fail=True)
    bodies = [json.dumps(group(4, env_id=0, base=b)).encode() for b in range(1, 5)]

    async def main():
        return await asyncio.gather(*(_call(app, "/scored_data", b) for b in bodies))

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [503] * 4
    assert all(headers[b"retry-after"] == b"1" for _, headers, _ in answers)
    assert all(b"disk full" in body for _, _, body in answers)
    assert calls == [4] and _rows(path) == 0 and len(store.queue) == 0


def test_an_unexpected_commit_failure_still_reaches_the_deferred_posts(tmp_path, monkeypatch):
    app, store, path, calls = _hot(tmp_path, monkeypatch)

    def broken(changes):
        raise MemoryError("no room")

    monkeypatch.setattr(store._db, "commit_many", broken)
    body = json.dumps(group(4, env_id=0, base=1)).encode()

    async def main():
        return await asyncio.gather(*(_call(app, "/scored_data", body) for _ in range(3)))

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [503] * 3
    assert _rows(path) == 0 and len(store.queue) == 0
