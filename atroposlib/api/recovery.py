"""Damage checks and salvage of the ``--persist`` database (``run-api --persist-recover``).

:func:`open_persistence` is how ``run-api`` opens its database: it takes the
exclusive lock (:class:`~atroposlib.api.persistence.PersistLock`), finishes a
recovery that was interrupted between its renames, checks the files
(:func:`check_database`) and, when asked, salvages a damaged database
(:func:`recover_database`).

A recovery reads only until the replacement database is written and synced
beside the damaged one (``PATH.recovering``, then ``PATH.recovered``); only
then are the damaged files renamed to ``PATH.damaged-<time>`` and the new one
renamed into place. A recovery that fails (a disk still full) removes its own
partial file and leaves every other file as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atroposlib.api.compression import crc32
from atroposlib.api.errors import StorageError
from atroposlib.api.pages import PageScan, scan_pages
from atroposlib.api.persistence import GroupRow, PersistLock, SqlitePersistence

logger = logging.getLogger(__name__)

__all__ = [
    "DamagedDatabaseError",
    "RecoveryFailedError",
    "RecoveryReport",
    "check_database",
    "open_persistence",
    "recover_database",
]


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
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    frames = _shm_frames(shm) if shm.exists() else None
    wal_size = wal.stat().st_size if wal.exists() else 0
    pending = frames[0] > frames[1] if frames is not None else wal_size > _WAL_HEADER
    # A checkpoint that ran out of disk space leaves the main file ending mid-page while
    # the WAL still holds every committed page: normal, and SQLite reads it whole. Only
    # without committed pages in the WAL is a torn size damage by itself; otherwise the
    # checks below (SQLite's page check, every group's checksum) decide.
    if page < 512 or (size % page and not pending):
        return f"{path} is truncated ({size} bytes is not a whole number of {page}-byte pages)"
    # A checkpoint copies WAL pages into the main file in page order, page 1 (the header)
    # first, and extends the file as it goes: a server killed mid-checkpoint leaves a main
    # file shorter than its header says while the WAL still holds every page. The header's
    # size is only a promise once no committed page lives solely in the WAL.
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
    wal_frames_lost: int = 0
    """Committed WAL frames that are gone: the groups they added (seqs above ``after_seq``)
    cannot be counted."""
    after_seq: int = 0

    @property
    def exact(self) -> bool:
        """True when every stored group is accounted for (restored or listed as lost)."""
        return not self.unknown and not self.wal_frames_lost

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
        if self.wal_frames_lost:
            text += (
                f", and the groups committed in {self.wal_frames_lost} WAL frames that are gone "
                f"(seqs above {self.after_seq}; their number is unknown)"
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
            # Rows on intact leaves inside the range are read page by page (_salvage).
            self.report.unknown.append((first, resume if resume is not None else 1 << 62))
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


class RecoveryFailedError(StorageError):
    """``--persist-recover`` could not write the recovered database; nothing was moved."""


def _salvage(path: Path) -> tuple[dict[str, Any], list[tuple], RecoveryReport]:
    """Everything readable in the damaged database: meta, intact group rows, and the report.

    Two independent reads: SQLite's (table, then ledger, then one row at a time,
    see :class:`_Salvager`), and a page-by-page parse of the latest image
    (:func:`~atroposlib.api.pages.scan_pages`), which reaches rows SQLite cannot:
    below a damaged interior page, in a truncated main file, in WAL frames after
    a damaged one. A group either read finds intact is restored; every other
    seq either read saw (a row, a ledger entry) is counted as lost.
    """
    # The WAL index as the server left it: SQLite rebuilds it on open (stopping at a
    # damaged frame), so it is read first and put back after, for a later retry to see.
    shm = Path(f"{path}-shm")
    left = shm.read_bytes() if shm.is_file() else None
    frames = _shm_frames(shm) if left is not None else None
    meta: dict[str, Any] = {}
    rows: list[tuple] = []
    report = RecoveryReport()
    try:
        conn = _read_only(path)
        try:
            try:
                for key, value in conn.execute("SELECT key, value FROM meta"):
                    meta[key] = json.loads(value)
            except (sqlite3.Error, ValueError) as e:
                logger.warning("SQLite cannot read the registration record of %s (%s)", path, e)
                meta = {}
            try:
                rows, report = _salvage_rows(conn)
            except sqlite3.Error as e:
                logger.warning("SQLite reads no group of %s (%s)", path, e)
                report.unknown.append((1, 1 << 62))
        finally:
            conn.close()
    except sqlite3.Error as e:
        logger.warning("SQLite cannot open %s (%s)", path, e)
        report.unknown.append((1, 1 << 62))
    finally:
        if left is not None and shm.is_file() and shm.read_bytes() != left:
            shm.write_bytes(left)
    try:
        scan = scan_pages(path, frames[0] if frames is not None else None)
    except (OSError, ValueError, IndexError, OverflowError, struct.error) as e:
        # The page-by-page read is the second opinion: its failure costs only what it adds.
        logger.warning("the page-by-page read of %s stopped (%s)", path, e)
        scan = PageScan()
    have = {row[0] for row in rows}
    for seq, (env_id, size, buffered, body, crc) in sorted(scan.groups.items()):
        row = (seq, env_id, size, buffered, body, crc)
        if seq not in have and body and _intact(row):
            rows.append(row[:5])
            have.add(seq)
    report.lost = sorted((set(report.lost) | set(scan.groups) | scan.ledger) - have)
    if scan.ledger_complete:
        report.unknown = []  # the whole ledger was read: every stored seq is accounted for
    if frames is not None:
        # Committed frames the WAL no longer holds (cut off, or the file emptied): their
        # commits are the newest, so whatever they added follows every seq seen.
        report.wal_frames_lost = max(0, frames[0] - max(scan.wal_frames, frames[1]))
        seen = [*have, *report.lost]
        report.after_seq = max(seen) if seen else 0
    if not meta:
        for key, value in scan.meta.items():
            try:
                meta[key] = json.loads(value)
            except ValueError:
                logger.warning("the registration record %r of %s is damaged", key, path)
    rows.sort(key=lambda row: row[0])
    return meta, rows, report


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_own(base: Path) -> None:
    """Remove a partial replacement database written by this module (and its journal files)."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{base}{suffix}").unlink(missing_ok=True)


def _write_replacement(path: Path, meta: dict[str, Any], rows: list[tuple]) -> Path:
    """Write the salvaged state to ``PATH.recovered``, synced (file and directory).

    Written as ``PATH.recovering`` and renamed once complete, so a
    ``PATH.recovered`` is always whole. On any failure the partial file is
    removed and :class:`RecoveryFailedError` says what to free.
    """
    work, done = Path(f"{path}.recovering"), Path(f"{path}.recovered")
    _remove_own(work)
    try:
        fresh = SqlitePersistence(work)
        try:
            fresh.commit(
                insert=[
                    GroupRow(s, env, size, bool(buf), body) for s, env, size, buf, body in rows
                ],
                meta=meta or None,
            )
            conn = fresh._conn
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if busy:
                raise sqlite3.OperationalError("the WAL checkpoint of the new database was refused")
            # A single file: no WAL to carry along in the renames that follow.
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            fresh._conn.close()
        fd = os.open(work, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(work, done)
        _fsync_dir(path.parent)
    except (sqlite3.Error, StorageError, OSError) as e:
        _remove_own(work)
        need = sum(len(row[4]) for row in rows) * 5 // 4 + (1 << 20)
        free = shutil.disk_usage(path.parent).free
        raise RecoveryFailedError(
            f"--persist-recover could not write the recovered database beside {path} ({e}); "
            f"nothing was moved or deleted. Free at least {-(-need // (1 << 20))} MiB on the "
            f"filesystem of {path.parent} ({free // (1 << 20)} MiB free now) and start again "
            f"with --persist-recover"
        ) from e
    return done


def _swap_in(path: Path) -> Path:
    """Rename the damaged files aside and the complete ``PATH.recovered`` into place.

    Renames only: the damaged files are kept whole, and a crash part-way is
    finished by the next start (:func:`open_persistence`), since
    ``PATH.recovered`` exists only once complete.
    """
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    # The WAL and its index first: a main file left without them would look sound.
    for suffix in ("-wal", "-shm", ""):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.replace(src, f"{aside}{suffix}")
    os.replace(f"{path}.recovered", path)
    _fsync_dir(path.parent)
    return aside


def recover_database(path: str | Path) -> RecoveryReport:
    """Salvage a damaged database into a fresh one at ``path``; returns what was restored and lost.

    The damaged files are renamed to ``PATH.damaged-<time>`` (with their
    ``-wal``/``-shm``) and kept, once the new database is written and synced.
    Registration, envs and step are restored when their record is readable; a
    batch that was served but not acknowledged goes back onto the queue when
    any of its groups is lost. Raises :class:`RecoveryFailedError` (every file
    left as it was) when the new database cannot be written.
    """
    path = Path(path)
    meta, rows, report = _salvage(path)
    state = meta.get("state")
    if isinstance(state, dict) and state.get("pending"):
        wanted = set(state["pending"].get("seqs", []))
        if not wanted <= {r[0] for r in rows}:
            state["pending"] = None  # incomplete: its surviving groups go back onto the queue
    _write_replacement(path, meta, rows)
    aside = _swap_in(path)
    report.restored = len(rows)
    report.kept = [r[0] for r in rows]
    report.registration = bool(state)
    logger.warning(
        "--persist-recover: %s, into a fresh %s (registration %s); the damaged files are kept "
        "as %s*",
        report.describe(),
        path,
        "restored" if state else "lost",
        aside,
    )
    return report


def open_persistence(path: str | Path, recover: bool = False) -> SqlitePersistence:
    """Lock, check and open the ``--persist`` database (what ``run-api`` starts with).

    Another process holding the database raises :class:`StorageError` naming
    its pid. A damaged database raises :class:`DamagedDatabaseError` naming the
    file and ``--persist-recover``; with ``recover`` it is salvaged first
    (:func:`recover_database`).
    """
    path = Path(path)
    lock = PersistLock(path)
    try:
        if Path(f"{path}.recovered").exists():
            logger.warning("finishing the recovery of %s that was interrupted", path)
            _swap_in(path)
        problem = check_database(path)
        if problem is not None:
            if not recover:
                raise DamagedDatabaseError(path, problem)
            logger.warning("--persist-recover: %s", problem)
            recover_database(path)
        elif recover:
            logger.info("--persist-recover: %s is not damaged; opening it as it is", path)
        return SqlitePersistence(path, lock=lock)
    except BaseException:
        lock.release()
        raise
