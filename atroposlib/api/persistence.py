"""SQLite persistence layer of the rollout store (``run-api --persist PATH``).

WAL journal with ``synchronous=NORMAL``: a committed transaction is in the
operating system's hands before the call returns, so it survives ``kill -9``
of the server (not a power cut). Each store mutation is one transaction, made
before the HTTP answer: a group is committed before its 200, and the groups of
a batch are deleted in the same transaction that advances the step.

Commits run on the event loop on purpose: without fsync they take tens of
microseconds, and doing them inline keeps every handler atomic with respect to
the in-memory state (no await between the change and its commit).

This module is the write path. Opening the database for ``run-api`` (lock,
damage check, ``--persist-recover``) is :mod:`atroposlib.api.recovery`, which
builds on it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Sequence

from atroposlib.api.compression import crc32
from atroposlib.api.errors import StorageError

logger = logging.getLogger(__name__)

__all__ = [
    "Change",
    "CommitTicket",
    "DeferredChanges",
    "GroupRow",
    "PersistLock",
    "PersistedState",
    "SqlitePersistence",
]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY,
    env_id INTEGER,
    size INTEGER NOT NULL,
    buffered INTEGER NOT NULL,
    body BLOB NOT NULL,
    crc INTEGER
);
CREATE INDEX IF NOT EXISTS groups_ledger ON groups(seq, size);
"""
# ``groups_ledger`` is a second B-tree holding every stored seq (a few bytes each, on pages
# of its own): when a page of ``groups`` is damaged, the ledger still says which groups were
# on it, so --persist-recover can read every other row and count exactly what was lost.

_IN_CHUNK = 500
"""Rows per ``IN (...)`` statement, well below SQLite's limit on bound parameters."""

_PAGE_SIZE = 16384
"""Page size of a new database file."""
_WAL_CHECKPOINT_BYTES = 4 * 1024 * 1024
"""WAL size at which SQLite checkpoints it into the database file."""


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


@dataclass
class Change:
    """One atomic change of :meth:`SqlitePersistence.commit` (see its arguments)."""

    insert: List[GroupRow] = field(default_factory=list)
    move_to_queue: Sequence[tuple[int, int]] = ()
    delete: Sequence[int] = ()
    meta: dict[str, Any] | None = None
    clear_groups: bool = False


class CommitTicket:
    """Whether some deferred changes are committed: ``done`` once a commit included them (or
    failed), ``error`` its :class:`StorageError`. Each deferred post waits on one."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: StorageError | None = None


class DeferredChanges:
    """Changes applied in memory but not committed yet, with the ticket their posts wait on.

    Posts handled in one turn of the event loop defer their changes here; the next
    commit (a group commit, or any other change, which includes them first) takes
    them all in one transaction and settles the ticket.
    """

    def __init__(self) -> None:
        self.changes: List[Change] = []
        self.payload: List[Any] = []
        self.ticket: CommitTicket | None = None

    def __bool__(self) -> bool:
        return bool(self.changes)

    def add(self, change: Change, payload: Sequence[Any] = ()) -> None:
        """Defer ``change``; ``payload`` (the caller's objects it concerns) comes back with it."""
        self.changes.append(change)
        self.payload.extend(payload)
        if self.ticket is None:
            self.ticket = CommitTicket()

    def take(self) -> tuple[List[Change], CommitTicket | None, List[Any]]:
        """Everything deferred (changes, ticket, payload), leaving nothing behind."""
        out = (self.changes, self.ticket, self.payload)
        self.changes, self.ticket, self.payload = [], None, []
        return out


class PersistLock:
    """The exclusive claim of one process on a ``--persist`` database, for its lifetime.

    An ``flock`` on ``PATH.lock`` (a sidecar file: SQLite's own locks are per
    transaction, so two servers could otherwise both open the file and each
    serve a queue the other is changing). The holder's pid is written into the
    file so that the refused process can name it. The operating system drops the
    lock when the holder exits, ``kill -9`` included; the file itself stays.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(f"{path}.lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create the lock file {self.path} of --persist: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise StorageError(
                f"the --persist database {path} is in use by another run-api (pid {holder}); "
                f"stop that process or give this one another --persist path"
            ) from None
        except OSError as e:
            os.close(fd)
            raise StorageError(
                f"cannot lock the --persist database {path} ({self.path}): {e}"
            ) from e
        self._fd: int | None = fd
        # The pid, for the message of a refused process, written over the same 16 bytes each
        # time: a full disk has no block for a new one (the lock holds all the same).
        try:
            os.pwrite(fd, f"{os.getpid()}".ljust(15).encode() + b"\n", 0)
            os.ftruncate(fd, 16)
        except OSError:
            pass

    def release(self) -> None:
        """Give the database up (closing the descriptor drops the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SqlitePersistence:
    """Durable storage of queue, buffers and registry in one SQLite file.

    ``lock`` (from :func:`~atroposlib.api.recovery.open_persistence`) is released
    by :meth:`close`.
    """

    def __init__(self, path: str | Path, lock: PersistLock | None = None) -> None:
        self.path = Path(path)
        self.lock = lock
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(
                str(self.path), isolation_level=None, check_same_thread=False
            )
            # A group is ~26 KiB: 16 KiB pages hold it in two overflow pages instead of seven
            # (about a tenth less CPU per insert and per batch read). SQLite applies the size
            # only to a database without tables, so existing files keep theirs.
            self._conn.execute(f"PRAGMA page_size={_PAGE_SIZE}")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            # Checkpoint at the WAL size of SQLite's default (1,000 pages of 4 KiB).
            page = self._conn.execute("PRAGMA page_size").fetchone()[0]
            self._conn.execute(f"PRAGMA wal_autocheckpoint={_WAL_CHECKPOINT_BYTES // page}")
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(groups)")}
            if "crc" not in columns:  # a database written before group checksums
                self._conn.execute("ALTER TABLE groups ADD COLUMN crc INTEGER")
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

    def _read(self, seqs: Sequence[int], delete: bool = False) -> dict[int, bytes]:
        """Bodies of ``seqs`` by seq, one statement per chunk of rows (inside a transaction)."""
        conn = self._conn
        found: dict[int, bytes] = {}
        for i in range(0, len(seqs), _IN_CHUNK):
            chunk = list(seqs[i : i + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            if delete:
                conn.execute(f"DELETE FROM groups WHERE seq IN ({marks})", chunk)
            else:
                found.update(
                    conn.execute(f"SELECT seq, body FROM groups WHERE seq IN ({marks})", chunk)
                )
        return found

    def bodies(self, seqs: Sequence[int]) -> list[bytes]:
        """The stored JSON of the groups ``seqs``, in that order (all must exist)."""
        return self.swap_batch((), seqs, None)

    def swap_batch(
        self, consume: Sequence[int], serve: Sequence[int], meta: dict[str, Any] | None
    ) -> list[bytes]:
        """Atomically delete the acknowledged groups ``consume``, read ``serve`` and set ``meta``.

        The served groups stay in the table: they are deleted only when the
        trainer acknowledges them (a later call's ``consume``).
        """
        conn = self._conn
        try:
            conn.execute("BEGIN")
            if consume:
                self._read(consume, delete=True)
            found = self._read(serve)
            missing = [seq for seq in serve if seq not in found]
            if missing:
                raise sqlite3.IntegrityError(f"groups {missing} are missing from the database")
            bodies = [bytes(found[seq]) for seq in serve]
            if meta:
                self._set_meta(meta)
            conn.execute("COMMIT")
            return bodies
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.error("persistence batch read failed: %s", e)
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
        self.commit_many(
            [
                Change(
                    insert=list(insert),
                    move_to_queue=move_to_queue,
                    delete=delete,
                    meta=meta,
                    clear_groups=clear_groups,
                )
            ]
        )

    def commit_many(self, changes: Sequence[Change]) -> None:
        """Apply ``changes`` in order, all in one transaction (all or none).

        One transaction for several posts is what ``run-api`` does with the
        posts answered in the same event-loop turn (group commit): the commit's
        fixed cost is paid once for all of them.
        """
        conn = self._conn
        try:
            conn.execute("BEGIN")
            for change in changes:
                self._apply(change)
            conn.execute("COMMIT")
        except sqlite3.Error as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            logger.error("persistence commit failed: %s", e)
            raise StorageError(f"could not persist the change: {e}") from e

    def _apply(self, change: Change) -> None:
        conn = self._conn
        if change.clear_groups:
            conn.execute("DELETE FROM groups")
        if change.insert:
            conn.executemany(
                "INSERT INTO groups (seq, env_id, size, buffered, body, crc) VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (r.seq, r.env_id, r.size, int(r.buffered), r.body, crc32(r.body or b""))
                    for r in change.insert
                ],
            )
        if change.move_to_queue:
            conn.executemany(
                "UPDATE groups SET seq = ?, buffered = 0 WHERE seq = ?",
                [(new, old) for old, new in change.move_to_queue],
            )
        if change.delete:
            conn.executemany("DELETE FROM groups WHERE seq = ?", [(s,) for s in change.delete])
        if change.meta:
            self._set_meta(change.meta)

    def close(self) -> None:
        """Checkpoint the WAL and close the database."""
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            logger.warning("WAL checkpoint on close failed: %s", e)
        self._conn.close()
        if self.lock is not None:
            self.lock.release()
