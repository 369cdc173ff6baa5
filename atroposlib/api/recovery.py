"""Damage checks and recovery of the ``--persist`` database (``run-api --persist-recover``).

:func:`open_persistence` is how ``run-api`` opens its database: it takes the
exclusive lock (:class:`~atroposlib.api.persistence.PersistLock`), finishes or
undoes a recovery a crash cut short, checks the files
(:func:`check_database`) and, when asked, recovers a damaged database
(:func:`recover_database`).

A recovery first reads everything it can (:func:`~atroposlib.api.salvage.salvage`),
then writes it in one of two ways. In place, when SQLite's own view of the
database is sound and the damage lies past it (a WAL cut short or garbled, a
torn page past the declared size): one transaction on the database, after
the bytes it overwrites are kept (:mod:`atroposlib.api.repair`), so it needs
room for those bytes and the rows it adds, not for a copy. Otherwise into a
fresh database written and synced beside the damaged one
(``PATH.recovering``, then ``PATH.recovered``); only then are the damaged
files renamed to ``PATH.damaged-<time>`` and the new one renamed into place.
A recovery that fails (a disk still full) leaves every file as it was and
says how much to free.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import struct
import time
from pathlib import Path
from typing import Any

from atroposlib.api.compression import crc32
from atroposlib.api.errors import StorageError
from atroposlib.api.persistence import GroupRow, PersistLock, SqlitePersistence
from atroposlib.api.repair import (
    RecoveryFailedError,
    fsync_path,
    plan_in_place,
    repair_in_place,
    undo_interrupted,
)
from atroposlib.api.salvage import (
    WAL_FRAME_HEADER,
    WAL_HEADER,
    RecoveryReport,
    read_only,
    salvage,
    shm_frames,
)

_salvage = salvage

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
    frames = shm_frames(shm) if shm.exists() else None
    wal_size = wal.stat().st_size if wal.exists() else 0
    pending = frames[0] > frames[1] if frames is not None else wal_size > WAL_HEADER
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
            needed = WAL_HEADER + mx_frame * (page + WAL_FRAME_HEADER)
            if not wal.exists():
                return f"{wal} is missing although {mx_frame - backfill} committed pages live only there"
            if wal_size < needed:
                what = "empty (zero-length)" if wal_size == 0 else f"truncated ({wal_size} bytes)"
                return f"{wal} is {what}; its committed transactions need {needed} bytes"
    return None


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
    before = shm_frames(shm) if left is not None else None
    restore = False
    try:
        conn = read_only(path)
    except sqlite3.Error as e:
        return f"{path} cannot be opened: {e}"
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        after = shm_frames(shm) if before is not None else None
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
        fsync_path(work)
        os.replace(work, done)
        fsync_path(path.parent, directory=True)
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
    fsync_path(path.parent, directory=True)
    return aside


def recover_database(path: str | Path) -> RecoveryReport:
    """Salvage a damaged database at ``path``, in place or into a fresh one; returns the report.

    In place when the damage allows (see :mod:`atroposlib.api.repair`); the
    bytes the repair overwrites are kept as ``PATH.damaged-<time>-*``.
    Otherwise the damaged files are renamed to ``PATH.damaged-<time>`` (with
    their ``-wal``/``-shm``) and kept, once the new database is written and
    synced. Registration, envs and step are restored when their record is
    readable; a batch that was served but not acknowledged goes back onto the
    queue when any of its groups is lost. Raises :class:`RecoveryFailedError`
    (every file left as it was) when the recovery cannot be written.
    """
    path = Path(path)
    meta, rows, report = salvage(path)
    state = meta.get("state")
    if isinstance(state, dict) and state.get("pending"):
        wanted = set(state["pending"].get("seqs", []))
        if not wanted <= {r[0] for r in rows}:
            state["pending"] = None  # incomplete: its surviving groups go back onto the queue
    plan = plan_in_place(path, meta, rows)
    if plan is not None:
        aside = repair_in_place(path, plan)
        how = f"in place in {path}"
    else:
        _write_replacement(path, meta, rows)
        aside = _swap_in(path)
        how = f"into a fresh {path}"
    report.restored = len(rows)
    report.kept = [r[0] for r in rows]
    report.registration = bool(state)
    logger.warning(
        "--persist-recover: %s, %s (registration %s); the damaged files are kept as %s*",
        report.describe(),
        how,
        "restored" if state else "lost",
        aside,
    )
    return report


def _remove_opened(sidecars: list[Path]) -> None:
    """Remove the empty WAL (and its index) that reading a database without one created.

    SQLite creates both on opening a WAL database; a refused start or a failed
    recovery leaves the files as it found them.
    """
    if any(f.name.endswith("-wal") and f.exists() and f.stat().st_size for f in sidecars):
        return  # frames were written: not only an open's doing
    for file in sidecars:
        file.unlink(missing_ok=True)


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
        undo_interrupted(path)
        if Path(f"{path}.recovered").exists():
            logger.warning("finishing the recovery of %s that was interrupted", path)
            _swap_in(path)
        sidecars = [Path(f"{path}{s}") for s in ("-wal", "-shm") if not Path(f"{path}{s}").exists()]
        problem = check_database(path)
        if problem is not None:
            try:
                if not recover:
                    raise DamagedDatabaseError(path, problem)
                logger.warning("--persist-recover: %s", problem)
                recover_database(path)
            except StorageError:
                _remove_opened(sidecars)
                raise
        elif recover:
            logger.info("--persist-recover: %s is not damaged; opening it as it is", path)
        return SqlitePersistence(path, lock=lock)
    except BaseException:
        lock.release()
        raise
