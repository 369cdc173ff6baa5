"""SQLite persistence layer of the rollout store (``run-api --persist PATH``).

WAL journal with ``synchronous=NORMAL``: a committed transaction is in the
operating system's hands before the call returns, so it survives ``kill -9``
of the server (not a power cut). Each store mutation is one transaction, made
before the HTTP answer: a group is committed before its 200, and the groups of
a batch are deleted in the same transaction that advances the step.

Commits run on the event loop on purpose: without fsync they take tens of
microseconds, and doing them inline keeps every handler atomic with respect to
the in-memory state (no await between the change and its commit).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from atroposlib.api.errors import StorageError

logger = logging.getLogger(__name__)

__all__ = ["GroupRow", "PersistedState", "SqlitePersistence"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY,
    env_id INTEGER,
    size INTEGER NOT NULL,
    buffered INTEGER NOT NULL,
    body BLOB NOT NULL
);
"""

_IN_CHUNK = 500
"""Rows per ``IN (...)`` statement, well below SQLite's limit on bound parameters."""


@dataclass(frozen=True)
class GroupRow:
    """One stored group: its queue position, sender, sequence count and canonical JSON."""

    seq: int
    env_id: int | None
    size: int
    buffered: bool
    body: bytes | None
    nbytes: int = 0


@dataclass
class PersistedState:
    """What a restart reads back: the state blob and every stored group, oldest first."""

    meta: dict[str, Any] = field(default_factory=dict)
    groups: list[GroupRow] = field(default_factory=list)


class SqlitePersistence:
    """Durable storage of queue, buffers and registry in one SQLite file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                str(self.path), isolation_level=None, check_same_thread=False
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise StorageError(f"cannot open persistence database {self.path}: {e}") from e

    def load(self) -> PersistedState:
        """Read the state back: meta, and every group's row without its body, by queue position."""
        state = PersistedState()
        for key, value in self._conn.execute("SELECT key, value FROM meta"):
            state.meta[key] = json.loads(value)
        rows = self._conn.execute(
            "SELECT seq, env_id, size, buffered, length(body) FROM groups ORDER BY seq"
        )
        state.groups = [
            GroupRow(seq, env_id, size, bool(buf), None, n) for seq, env_id, size, buf, n in rows
        ]
        return state

    def body(self, seq: int) -> bytes | None:
        """The stored JSON of one group."""
        row = self._conn.execute("SELECT body FROM groups WHERE seq = ?", (seq,)).fetchone()
        return bytes(row[0]) if row else None

    def take(self, seqs: Sequence[int], meta: dict[str, Any]) -> list[bytes]:
        """Atomically read and delete the groups ``seqs`` (in that order) and set ``meta``."""
        conn = self._conn
        try:
            conn.execute("BEGIN")
            # One read and one delete per chunk of rows rather than per row.
            found: dict[int, bytes] = {}
            for i in range(0, len(seqs), _IN_CHUNK):
                chunk = list(seqs[i : i + _IN_CHUNK])
                marks = ",".join("?" * len(chunk))
                found.update(
                    conn.execute(f"SELECT seq, body FROM groups WHERE seq IN ({marks})", chunk)
                )
                conn.execute(f"DELETE FROM groups WHERE seq IN ({marks})", chunk)
            missing = [seq for seq in seqs if seq not in found]
            if missing:
                raise sqlite3.IntegrityError(f"groups {missing} are missing from the database")
            bodies = [bytes(found[seq]) for seq in seqs]
            self._set_meta(meta)
            conn.execute("COMMIT")
            return bodies
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.error("persistence take failed: %s", e)
            raise StorageError(f"could not read the batch from the database: {e}") from e

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self._conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [(k, json.dumps(v)) for k, v in meta.items()],
        )

    def commit(
        self,
        *,
        insert: Iterable[GroupRow] = (),
        move_to_queue: Sequence[tuple[int, int]] = (),
        delete: Sequence[int] = (),
        meta: dict[str, Any] | None = None,
        clear_groups: bool = False,
    ) -> None:
        """Apply one atomic change: insert groups, re-number buffered groups onto the queue, delete, set meta."""
        conn = self._conn
        try:
            conn.execute("BEGIN")
            if clear_groups:
                conn.execute("DELETE FROM groups")
            conn.executemany(
                "INSERT INTO groups (seq, env_id, size, buffered, body) VALUES (?, ?, ?, ?, ?)",
                [(r.seq, r.env_id, r.size, int(r.buffered), r.body) for r in insert],
            )
            if move_to_queue:
                conn.executemany(
                    "UPDATE groups SET seq = ?, buffered = 0 WHERE seq = ?",
                    [(new, old) for old, new in move_to_queue],
                )
            if delete:
                conn.executemany("DELETE FROM groups WHERE seq = ?", [(s,) for s in delete])
            if meta:
                self._set_meta(meta)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.error("persistence commit failed: %s", e)
            raise StorageError(f"could not persist the change: {e}") from e

    def close(self) -> None:
        """Checkpoint the WAL and close the database."""
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            logger.warning("WAL checkpoint on close failed: %s", e)
        self._conn.close()
