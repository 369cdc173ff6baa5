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
import os
import sqlite3
import struct
import time
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
    "DamagedDatabaseError",
    "GroupRow",
    "PersistedState",
    "RecoveryReport",
    "SqlitePersistence",
    "check_database",
    "open_persistence",
    "recover_database",
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


# ----------------------------------------------------------------- damage and recovery


class DamagedDatabaseError(StorageError):
    """The ``--persist`` database is damaged; starting from it would lose data silently."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"the --persist database {path} is damaged ({problem}); nothing was changed. "
            f"Start again with --persist-recover to salvage every readable group into a fresh "
            f"database (the damaged files are kept beside it)"
        )
        self.path = path
        self.problem = problem


_SQLITE_MAGIC = b"SQLite format 3\x00"
_WAL_HEADER = 32
_WAL_FRAME_HEADER = 24


def _shm_frames(shm: Path) -> tuple[int, int] | None:
    """``(mxFrame, nBackfill)`` from the WAL index a killed server left, or None when unusable.

    The index is shared memory that SQLite updates on every commit, so after
    ``kill -9`` it records how many WAL frames were committed (``mxFrame``) and
    how many of them are already copied into the main file (``nBackfill``).
    """
    try:
        raw = shm.read_bytes()[:136]
    except OSError:
        return None
    if len(raw) < 136 or raw[:48] != raw[48:96]:
        return None  # no index, or one caught mid-update: nothing to compare against
    version, _, _, is_init = struct.unpack_from("<IIIB", raw, 0)
    if version != 3007000 or not is_init:
        return None
    (mx_frame,) = struct.unpack_from("<I", raw, 16)
    (backfill,) = struct.unpack_from("<I", raw, 96)
    return mx_frame, backfill


def _file_problem(path: Path) -> str | None:
    """A damage visible in the files' sizes and headers, without opening them with SQLite."""
    if not path.is_file():
        return None  # absent (a new database) or not a file (opening it reports that)
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty (zero-length)"
    with path.open("rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        return f"{path} is not an SQLite database (bad or truncated header)"
    (page,) = struct.unpack_from(">H", header, 16)
    page = 65536 if page == 1 else page
    if page < 512 or size % page:
        return f"{path} is truncated ({size} bytes is not a whole number of {page}-byte pages)"
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    frames = _shm_frames(shm) if shm.exists() else None
    wal_size = wal.stat().st_size if wal.exists() else 0
    # A checkpoint copies WAL pages into the main file in page order, page 1 (the header)
    # first, and extends the file as it goes: a server killed mid-checkpoint leaves a main
    # file shorter than its header says while the WAL still holds every page. The header's
    # size is only a promise once no committed page lives solely in the WAL.
    pending = frames[0] > frames[1] if frames is not None else wal_size > _WAL_HEADER
    (pages,) = struct.unpack_from(">I", header, 28)
    change, valid_for = (
        struct.unpack_from(">I", header, 24)[0],
        struct.unpack_from(">I", header, 92)[0],
    )
    if pages and change == valid_for and size < pages * page and not pending:
        return f"{path} is truncated ({size} bytes, its header says {pages * page})"
    if frames is not None:
        mx_frame, backfill = frames
        if mx_frame > backfill:
            needed = _WAL_HEADER + mx_frame * (page + _WAL_FRAME_HEADER)
            if not wal.exists():
                return f"{wal} is missing although {mx_frame - backfill} committed pages live only there"
            if wal_size < needed:
                what = "empty (zero-length)" if wal_size == 0 else f"truncated ({wal_size} bytes)"
                return f"{wal} is {what}; its committed transactions need {needed} bytes"
    return None


def _read_only(path: Path) -> sqlite3.Connection:
    """A connection that reads the database and its WAL and never writes (no checkpoint on close)."""
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)


def check_database(path: str | Path) -> str | None:
    """What is damaged in the database at ``path`` (None when sound or absent).

    Checks the files' sizes and headers, that every WAL transaction the server
    committed is still in the WAL, SQLite's ``quick_check`` (page structure),
    and every group's checksum. Reads only: the files are left as they are.
    """
    path = Path(path)
    problem = _file_problem(path)
    if problem is not None or not path.is_file():
        return problem
    shm = Path(f"{path}-shm")
    # Opening rebuilds the WAL index from the WAL, stopping at the first damaged frame.
    # Keep the index the server left, to compare, and to put back when frames are lost so
    # that the evidence survives this check (a second start must refuse too).
    left = shm.read_bytes() if shm.is_file() else None
    before = _shm_frames(shm) if left is not None else None
    restore = False
    try:
        conn = _read_only(path)
    except sqlite3.Error as e:
        return f"{path} cannot be opened: {e}"
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        after = _shm_frames(shm) if before is not None else None
        if before is not None and after is not None and before[0] > before[1]:
            if after[0] < before[0]:
                restore = True
                return (
                    f"{path}-wal is damaged: {before[0]} WAL frames were committed, only "
                    f"{after[0]} are intact"
                )
        verdict = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
        if verdict != ["ok"]:
            return f"{path} fails SQLite's check: " + "; ".join(verdict)[:300]
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if "groups" not in tables:
            return None
        columns = {row[1] for row in conn.execute("PRAGMA table_info(groups)")}
        if "crc" in columns:
            for seq, body, crc in conn.execute("SELECT seq, body, crc FROM groups"):
                if crc is not None and crc32(body) != crc:
                    return f"{path}: group {seq} does not match its checksum (garbage in the file)"
    except sqlite3.Error as e:
        return f"{path} cannot be read: {e}"
    finally:
        conn.close()
        if restore and left is not None:
            shm.write_bytes(left)
    return None


_SALVAGE_CHUNK = 256
"""Rows read per statement while salvaging; a damaged page costs a re-read of one chunk."""
_NO_SEQ = -(1 << 63)
_POINT_SCAN = 1 << 20
"""Largest seq range looked up one seq at a time where the table and its ledger both fail."""


@dataclass
class RecoveryReport:
    """What :func:`recover_database` restored and what it lost.

    ``lost`` lists the seqs of groups that were stored but could not be read
    intact (their page is damaged, or their checksum or shape does not match).
    ``unknown`` lists seq ranges (inclusive) where neither the table nor its
    ledger could be read: groups there may have been lost without a trace of
    how many. ``restored + len(lost)`` is the number of groups stored when
    ``unknown`` is empty.
    """

    restored: int = 0
    lost: list[int] = field(default_factory=list)
    unknown: list[tuple[int, int]] = field(default_factory=list)
    registration: bool = False

    @property
    def exact(self) -> bool:
        """True when every stored group is accounted for (restored or listed as lost)."""
        return not self.unknown

    kept: list[int] = field(default_factory=list, repr=False)
    """Seqs of the restored groups (what separates one lost range from the next)."""

    def lost_ranges(self) -> list[tuple[int, int]]:
        """``lost`` as inclusive ``(first, last)`` seq ranges with no restored group inside."""
        ranges: list[tuple[int, int]] = []
        kept = sorted(self.kept)
        k = 0
        for seq in sorted(self.lost):
            start_new = not ranges
            while k < len(kept) and kept[k] < seq:
                start_new = start_new or kept[k] > ranges[-1][1]
                k += 1
            if start_new:
                ranges.append((seq, seq))
            else:
                ranges[-1] = (ranges[-1][0], seq)
        return ranges

    def describe(self) -> str:
        """One line for the log: counts, and the seq ranges of what was lost."""
        shown = ", ".join(a if a == b else f"{a}-{b}" for a, b in _str_ranges(self.lost_ranges()))
        text = f"restored {self.restored} groups, lost {len(self.lost)}"
        if self.lost:
            text += f" (seqs {shown})"
        if self.unknown:
            where = ", ".join(a if a == b else f"{a}-{b}" for a, b in _str_ranges(self.unknown))
            text += (
                f", and an unknown number of groups among seqs {where} (neither the table nor "
                "its ledger is readable there)"
            )
        return text


def _str_ranges(ranges: list[tuple[int, int]]) -> list[tuple[str, str]]:
    return [(str(a), str(b)) for a, b in ranges]


def _intact(row: tuple) -> bool:
    """True when a salvaged row's body matches its checksum and holds ``size`` sequences."""
    _, _, size, _, body, crc = row
    if crc is not None and crc32(body) != crc:
        return False
    try:
        tokens = json.loads(body)["tokens"]
        return isinstance(tokens, list) and len(tokens) == size
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


class _Salvager:
    """Reads every readable row of a damaged ``groups`` table (see :func:`_salvage_rows`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        columns = {row[1] for row in conn.execute("PRAGMA table_info(groups)")}
        self.has_table = bool(columns)
        crc = "crc" if "crc" in columns else "NULL"
        cols = f"seq, env_id, size, buffered, body, {crc}"
        # NOT INDEXED: the table's own B-tree, never the ledger, so the two sources are independent.
        self.rows_after = (
            f"SELECT {cols} FROM groups NOT INDEXED WHERE seq > ? ORDER BY seq "
            f"LIMIT {_SALVAGE_CHUNK}"
        )
        self.row_at = f"SELECT {cols} FROM groups NOT INDEXED WHERE seq = ?"
        self.table_keys = (
            f"SELECT seq FROM groups NOT INDEXED WHERE seq > ? ORDER BY seq LIMIT {_SALVAGE_CHUNK}"
        )
        try:
            names = {
                r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")
            }
        except sqlite3.Error:
            names = set()
        self.ledger_keys = (
            "SELECT seq FROM groups INDEXED BY groups_ledger WHERE seq > ? ORDER BY seq "
            f"LIMIT {_SALVAGE_CHUNK}"
            if "groups_ledger" in names
            else None
        )
        self.rows: list[tuple] = []
        self.report = RecoveryReport()

    def _query(self, sql: str | None, arg: int) -> list[tuple] | None:
        if sql is None:
            return None
        try:
            return self.conn.execute(sql, (arg,)).fetchall()
        except sqlite3.Error:
            return None

    def _take(self, row: tuple) -> None:
        seq, env_id, size, buffered, body, crc = row
        row = (seq, env_id, size, buffered, bytes(body) if body is not None else b"", crc)
        if _intact(row):
            self.rows.append(row[:5])
        else:
            self.report.lost.append(seq)

    def _keys_after(self, last: int) -> list[int] | None:
        """Stored seqs after ``last`` from the ledger, else from the table's keys (no bodies read)."""
        for sql in (self.ledger_keys, self.table_keys):
            keys = self._query(sql, last)
            if keys is not None:
                return [k for (k,) in keys]
        return None

    def _readable_after(self, x: int) -> bool:
        return any(self._query(sql, x) is not None for sql in (self.ledger_keys, self.table_keys))

    def _skip_unreadable(self, last: int) -> int | None:
        """The smallest probe point past ``last`` from which keys can be read again (None: none).

        Only reached where both the table and the ledger fail: probes at growing distances
        find a readable point, and a bisection brings it back to the first readable one.
        """
        bad, step = last, 1
        while bad + step < (1 << 62):
            x = bad + step
            if self._readable_after(x):
                good = x
                while good - bad > 1:
                    mid = (good + bad) // 2
                    if self._readable_after(mid):
                        good = mid
                    else:
                        bad = mid
                return good
            bad, step = x, step * 2
        return None

    def run(self) -> None:
        if not self.has_table:
            return
        last = _NO_SEQ
        while True:
            chunk = self._query(self.rows_after, last)
            if chunk:
                for row in chunk:
                    self._take(row)
                last = chunk[-1][0]
                continue
            # The table holds nothing more past ``last``, or cannot be read there: ask the
            # ledger (or the table's keys alone) which groups follow, and read them one by one.
            keys = self._keys_after(last)
            if keys:
                for seq in keys:
                    try:
                        row = self.conn.execute(self.row_at, (seq,)).fetchone()
                    except sqlite3.Error:
                        row = None
                    if row is None:
                        self.report.lost.append(seq)
                    else:
                        self._take(row)
                last = keys[-1]
                continue
            if chunk is not None or keys is not None:
                return  # one source read to the end and found nothing more
            resume = self._skip_unreadable(last)
            first = max(last + 1, 1)  # the store numbers groups from 1
            end = resume if resume is not None else first + _POINT_SCAN - 1
            self.report.unknown.append((first, end))
            if end - first < _POINT_SCAN:
                # Rows on intact pages inside the range are still found by their own seq.
                for seq in range(first, end + 1):
                    try:
                        row = self.conn.execute(self.row_at, (seq,)).fetchone()
                    except sqlite3.Error:
                        continue
                    if row is not None:
                        self._take(row)
            else:
                logger.warning(
                    "--persist-recover: seqs %d-%d are unreadable in both the table and its "
                    "ledger, too many to look up one by one; rows there are not restored",
                    first,
                    end,
                )
            if resume is None:
                return
            last = resume


def _salvage_rows(conn: sqlite3.Connection) -> tuple[list[tuple], RecoveryReport]:
    """Every readable, intact group row of a damaged database, by seq; and what was lost.

    The table is read in chunks; where a chunk fails, the ledger index (an
    independent B-tree of every stored seq) names the groups that follow, and
    each is read by itself, so a damaged page costs exactly the rows on it and
    each of them is counted. Where the ledger is damaged too, the table's own
    keys are used; where both fail, the range is reported as unknown.
    """
    salvager = _Salvager(conn)
    salvager.run()
    return salvager.rows, salvager.report


def recover_database(path: str | Path) -> RecoveryReport:
    """Salvage a damaged database into a fresh one at ``path``; returns what was restored and lost.

    The damaged files are renamed to ``PATH.damaged-<time>`` (with their
    ``-wal``/``-shm``) and kept. Registration, envs and step are restored when
    their record is readable; a batch that was served but not acknowledged
    goes back onto the queue when any of its groups is lost.
    """
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.replace(src, f"{aside}{suffix}")
    meta: dict[str, Any] = {}
    rows: list[tuple] = []
    report = RecoveryReport()
    try:
        conn = _read_only(aside)
        try:
            try:
                for key, value in conn.execute("SELECT key, value FROM meta"):
                    meta[key] = json.loads(value)
            except (sqlite3.Error, ValueError) as e:
                logger.warning("the registration record of %s is unreadable (%s)", aside, e)
                meta = {}
            try:
                rows, report = _salvage_rows(conn)
            except sqlite3.Error as e:
                logger.warning("no group of %s is readable (%s)", aside, e)
                report.unknown.append((1, 1 << 62))
        finally:
            conn.close()
    except sqlite3.Error as e:
        logger.warning("%s cannot be opened at all (%s)", aside, e)
        report.unknown.append((1, 1 << 62))
    state = meta.get("state")
    if isinstance(state, dict) and state.get("pending"):
        wanted = set(state["pending"].get("seqs", []))
        if not wanted <= {r[0] for r in rows}:
            state["pending"] = None  # incomplete: its surviving groups go back onto the queue
    fresh = SqlitePersistence(path)
    try:
        fresh.commit(
            insert=[
                GroupRow(seq, env, size, bool(buf), body) for seq, env, size, buf, body in rows
            ],
            meta=meta or None,
        )
    finally:
        fresh.close()
    report.restored = len(rows)
    report.kept = [r[0] for r in rows]
    report.registration = bool(state)
    logger.warning(
        "--persist-recover: %s, from %s into a fresh %s (registration %s); the damaged files "
        "are kept as %s*",
        report.describe(),
        aside,
        path,
        "restored" if state else "lost",
        aside,
    )
    return report


def open_persistence(path: str | Path, recover: bool = False) -> SqlitePersistence:
    """Open the ``--persist`` database after checking it (:func:`check_database`).

    A damaged database raises :class:`DamagedDatabaseError` naming the file and
    ``--persist-recover``; with ``recover`` it is salvaged first
    (:func:`recover_database`).
    """
    path = Path(path)
    problem = check_database(path)
    if problem is not None:
        if not recover:
            raise DamagedDatabaseError(path, problem)
        logger.warning("--persist-recover: %s", problem)
        recover_database(path)
    elif recover:
        logger.info("--persist-recover: %s is not damaged; opening it as it is", path)
    return SqlitePersistence(path)
