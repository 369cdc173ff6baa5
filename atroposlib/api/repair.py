"""In-place repair of a ``--persist`` database whose damage SQLite reads past.

Much damage leaves SQLite's own view of the database sound: a WAL cut short
or garbled after its intact prefix (SQLite stops reading there), or a main
file with a torn page past the size its header declares. The salvaged state
then differs from that view only by the groups the page probes read beyond it
(and the unfinished batch it gives back), so one SQLite transaction on the
database itself writes it: no second copy of the database, and a disk with
room for a few pages but not for a copy still recovers.

What the repair overwrites is kept first: the WAL's bytes past its intact
prefix (where the next transaction writes), the WAL index as the server left
it, and a torn main file's bytes past its declared size. They are written as
``PATH.repair-*`` and synced, then ``PATH.repairing`` names them. A failed
repair writes them back byte for byte and removes its own files; a repair cut
short before it renames them to ``PATH.damaged-<time>-*`` is undone by the
next start (:func:`undo_interrupted`), leaving the damage for the check to find.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atroposlib.api.compression import crc32
from atroposlib.api.errors import StorageError
from atroposlib.api.salvage import WAL_FRAME_HEADER, WAL_HEADER, read_only, shm_frames

logger = logging.getLogger(__name__)

__all__ = ["InPlacePlan", "RecoveryFailedError", "plan_in_place", "repair_in_place"]

_KEPT = ("wal", "shm", "main")
"""The ``PATH.repair-<name>`` files a repair keeps: WAL tail, WAL index, main-file tail."""


class RecoveryFailedError(StorageError):
    """``--persist-recover`` could not write the recovered database; nothing was moved."""


def fsync_path(path: Path, directory: bool = False) -> None:
    """Flush ``path`` (a file, or with ``directory`` its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class InPlacePlan:
    """What an in-place repair writes and what it must keep first (see :func:`plan_in_place`)."""

    insert: list[tuple]
    """Salvaged rows SQLite's view lacks: ``(seq, env_id, size, buffered, body)``."""
    meta: dict[str, Any]
    """Meta records whose salvaged value differs from SQLite's view."""
    wal_at: int
    """Offset of the WAL's first byte past its intact prefix: the next frames go there."""
    wal_size: int
    wal_exists: bool
    main_at: int | None
    """A torn main file's declared size, when bytes past it are to be cut (None: none)."""

    def need(self, path: Path) -> int:
        """Bytes the repair may write: its kept copies, the new rows, and a margin of pages."""
        shm = Path(f"{path}-shm")
        copies = self.wal_size - self.wal_at + (shm.stat().st_size if shm.is_file() else 0)
        if self.main_at is not None:
            copies += path.stat().st_size - self.main_at
        return copies + sum(len(row[4]) for row in self.insert) * 5 // 4 + (256 << 10)


def _view(path: Path) -> tuple[set[int], dict[str, Any], int, int] | None:
    """SQLite's view (seqs, meta), its page size and intact WAL frames; None when unsound.

    Sound means SQLite's page check passes and every row it reads matches its
    checksum: the damage lies outside what SQLite reads.
    """
    shm = Path(f"{path}-shm")
    left = shm.read_bytes() if shm.is_file() else None
    try:
        conn = read_only(path)
    except sqlite3.Error:
        return None
    try:
        if [row[0] for row in conn.execute("PRAGMA quick_check(1)")] != ["ok"]:
            return None
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        frames = shm_frames(shm) if shm.is_file() else None
        meta = {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}
        seqs = set()
        for seq, body, crc in conn.execute("SELECT seq, body, crc FROM groups"):
            if crc is not None and crc32(body) != crc:
                return None
            seqs.add(seq)
        return seqs, meta, page, frames[0] if frames is not None else 0
    except (sqlite3.Error, ValueError):
        return None
    finally:
        conn.close()
        # Opening rebuilt the WAL index; the server's is the evidence a later check reads.
        if left is not None and shm.is_file() and shm.read_bytes() != left:
            shm.write_bytes(left)


def plan_in_place(path: Path, meta: dict[str, Any], rows: list[tuple]) -> InPlacePlan | None:
    """How to bring ``path`` to the salvaged state (``meta``, ``rows``) in place, or None.

    Possible when SQLite's view of the database is sound and holds no row the
    salvage counts as lost: then the salvage is that view plus rows it adds,
    and an insert and a meta update make the database equal to what a fresh
    copy would hold.
    """
    view = _view(path)
    if view is None:
        return None
    seqs, view_meta, page, frames = view
    salvaged = {row[0] for row in rows}
    if not seqs <= salvaged or not set(view_meta) <= set(meta):
        return None
    wal = Path(f"{path}-wal")
    wal_size = wal.stat().st_size if wal.is_file() else 0
    # An empty prefix makes SQLite start the WAL over from its header.
    wal_at = min(wal_size, WAL_HEADER + frames * (page + WAL_FRAME_HEADER)) if frames else 0
    main_at = None
    size = path.stat().st_size
    if size % page:
        if frames:
            return None  # a torn main file with pages in the WAL starts as it is; not this
        with path.open("rb") as f:
            header = f.read(100)
        pages, change, valid_for = (struct.unpack_from(">I", header, at)[0] for at in (28, 24, 92))
        if change != valid_for or not pages or pages * page > size:
            return None  # the torn page is part of the database: only a fresh copy reads past it
        main_at = pages * page
    return InPlacePlan(
        insert=[row for row in rows if row[0] not in seqs],
        meta={k: v for k, v in meta.items() if view_meta.get(k, object()) != v},
        wal_at=wal_at,
        wal_size=wal_size,
        wal_exists=wal.is_file(),
        main_at=main_at,
    )


def _kept(path: Path, name: str) -> Path:
    return Path(f"{path}.repair-{name}")


def _marker(path: Path) -> Path:
    return Path(f"{path}.repairing")


def _remove_own(path: Path) -> None:
    for name in _KEPT:
        _kept(path, name).unlink(missing_ok=True)
    _marker(path).unlink(missing_ok=True)


def _read_range(path: Path, at: int) -> bytes:
    with path.open("rb") as f:
        f.seek(at)
        return f.read()


def _keep(path: Path, plan: InPlacePlan) -> None:
    """Write and sync what the repair overwrites, then the marker that names it."""
    shm, wal = Path(f"{path}-shm"), Path(f"{path}-wal")
    parts = {
        "wal": _read_range(wal, plan.wal_at) if plan.wal_exists else None,
        "shm": shm.read_bytes() if shm.is_file() else None,
        "main": _read_range(path, plan.main_at) if plan.main_at is not None else None,
    }
    for name, data in parts.items():
        if data is not None:
            _kept(path, name).write_bytes(data)
            fsync_path(_kept(path, name))
    marker = {
        "wal_at": plan.wal_at,
        "wal_size": plan.wal_size,
        "kept": [name for name, data in parts.items() if data is not None],
    }
    _marker(path).write_text(json.dumps(marker))
    fsync_path(_marker(path))
    fsync_path(path.parent, directory=True)


def _put_back(path: Path) -> None:
    """Write the kept bytes back where they were and remove the repair's own files.

    Overwrites and truncations only: blocks the files already had, so a full
    disk does not stop it.
    """
    marker = json.loads(_marker(path).read_text())
    kept = set(marker["kept"])
    wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
    if "wal" in kept:
        with wal.open("r+b") as f:
            f.seek(marker["wal_at"])
            f.write(_kept(path, "wal").read_bytes())
            f.truncate(marker["wal_size"])
            os.fsync(f.fileno())
    else:
        wal.unlink(missing_ok=True)  # the repair's own WAL: there was none
    if "shm" in kept:
        shm.write_bytes(_kept(path, "shm").read_bytes())
    else:
        shm.unlink(missing_ok=True)
    # The main file is cut only after the repair is final: nothing to put back there.
    _remove_own(path)
    fsync_path(path.parent, directory=True)


def undo_interrupted(path: Path) -> None:
    """Undo an in-place repair a crash cut short, leaving the damage as it was found."""
    if _marker(path).exists():
        logger.warning("undoing the in-place recovery of %s that was interrupted", path)
        _put_back(path)
    elif any(_kept(path, name).exists() for name in _KEPT):
        _remove_own(path)  # cut short while keeping: nothing was changed yet


def _transaction(conn: sqlite3.Connection, plan: InPlacePlan) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(
            "INSERT INTO groups (seq, env_id, size, buffered, body, crc) VALUES (?, ?, ?, ?, ?, ?)",
            [
                (s, env, size, int(buf), body, crc32(body))
                for s, env, size, buf, body in plan.insert
            ],
        )
        conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            [(k, json.dumps(v)) for k, v in plan.meta.items()],
        )
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _finish(path: Path, conn: sqlite3.Connection, plan: InPlacePlan) -> Path:
    """Make the committed repair final: kept files renamed aside, then checkpoint and cut."""
    aside = Path(f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    for name in _KEPT:
        if _kept(path, name).exists():
            os.replace(_kept(path, name), f"{aside}-{name}")
    _marker(path).unlink()
    fsync_path(path.parent, directory=True)
    try:  # best effort: a WAL the full disk keeps is read whole at the next start
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as e:
        logger.warning("the checkpoint after the in-place recovery of %s failed: %s", path, e)
    wal = Path(f"{path}-wal")
    if plan.main_at is not None and (not wal.exists() or wal.stat().st_size == 0):
        if path.stat().st_size > plan.main_at:
            os.truncate(path, plan.main_at)
            fsync_path(path)
    return aside


def repair_in_place(path: Path, plan: InPlacePlan) -> Path:
    """Bring ``path`` to the planned state in place; returns the prefix of the kept files.

    Raises :class:`RecoveryFailedError` (every file as it was) when the kept
    copies or the transaction cannot be written.
    """
    need = plan.need(path)
    try:
        _keep(path, plan)
    except OSError as e:
        _remove_own(path)
        raise _failed(path, need, e) from e
    # A second, read-only connection stays open throughout: SQLite checkpoints and removes
    # the WAL when its last connection closes, which a failed repair must not do.
    guard = read_only(path)
    try:
        guard.execute("SELECT count(*) FROM sqlite_master").fetchone()
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA wal_autocheckpoint=0")
            conn.execute("PRAGMA synchronous=FULL")
            try:
                if plan.insert or plan.meta:
                    _transaction(conn, plan)
            except (sqlite3.Error, OSError) as e:
                conn.close()
                guard.close()
                _put_back(path)
                raise _failed(path, need, e) from e
            return _finish(path, conn, plan)
        finally:
            conn.close()
    finally:
        guard.close()


def _failed(path: Path, need: int, error: BaseException) -> RecoveryFailedError:
    free = shutil.disk_usage(path.parent).free
    return RecoveryFailedError(
        f"--persist-recover could not repair {path} in place ({error}); nothing was moved or "
        f"deleted. Free at least {-(-need // (1 << 20))} MiB on the filesystem of {path.parent} "
        f"({free // (1 << 20)} MiB free now) and start again with --persist-recover"
    )
