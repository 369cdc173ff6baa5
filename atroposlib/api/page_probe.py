"""Rows SQLite can read from pages its own B-tree walk no longer reaches (``--persist-recover``).

Below a damaged interior page, or in a main file cut short, whole leaves of
``groups`` are intact but unreachable from the table's root. SQLite reads
them when told that a page is the root of a table: on a copy of the
database, :func:`probe_pages` adds one schema entry per page
(``PRAGMA writable_schema``, each entry a table whose root page is that page)
and reads each as a table. SQLite decodes every page, record and overflow
chain itself; a page that is no table B-tree (an index, an overflow page,
garbage) is refused by SQLite and skipped. The damaged files are only read.

A page probed this way may be a leaf that no tree uses any more (a page on the
free list); its rows can be groups deleted long ago, so the caller takes only
rows whose seq it knows to be missing (see :func:`~atroposlib.api.salvage.salvage`).
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Probed", "probe_pages"]

_PROBES_PER_ROUND = 1000
"""Schema entries added at a time: the schema SQLite parses stays small on a large file."""
_PREFIX = "atropos_probe_"
_COLUMNS = 6
"""Columns of the widest table probed for (``groups``: seq, env_id, size, buffered, body, crc)."""


@dataclass
class Probed:
    """What the probes read: group rows by seq, and meta records by key."""

    groups: dict[int, tuple] = field(default_factory=dict)
    """seq → ``(seq, env_id, size, buffered, body, crc)``."""
    meta: dict[str, list[str]] = field(default_factory=dict)
    """key → every value found for it (more than one: the record is ambiguous)."""
    pages: int = 0
    """Pages probed."""


def _page_count(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """``(pages, page size)`` of the copy as SQLite sees it (the WAL included), at least
    as many pages as the main file holds."""
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    try:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    except sqlite3.Error:
        pages = 0
    return max(pages, path.stat().st_size // size), size


def _take(row: tuple, out: Probed) -> None:
    rowid, *cols = row
    env_id, size, buffered, body, crc = cols[1:6]
    # A groups row: its INTEGER PRIMARY KEY is the rowid (stored as NULL in the record).
    if cols[0] is None and isinstance(size, int) and isinstance(body, (bytes, str)):
        if isinstance(body, str):
            body = body.encode()
        out.groups.setdefault(rowid, (rowid, env_id, size, buffered, bytes(body), crc))
    # A meta row: (key TEXT, value TEXT) and nothing more.
    elif isinstance(cols[0], str) and isinstance(cols[1], str) and all(c is None for c in cols[2:]):
        values = out.meta.setdefault(cols[0], [])
        if cols[1] not in values:
            values.append(cols[1])


def _probe_round(copy: Path, pages: range, out: Probed) -> None:
    conn = sqlite3.connect(copy, isolation_level=None)
    try:
        conn.execute("PRAGMA writable_schema=ON")
        conn.execute("BEGIN")
        conn.execute("DELETE FROM sqlite_master WHERE name LIKE ?", (f"{_PREFIX}%",))
        columns = ", ".join(f"c{i}" for i in range(_COLUMNS))
        conn.executemany(
            "INSERT INTO sqlite_master (type, name, tbl_name, rootpage, sql) "
            "VALUES ('table', ?1, ?1, ?2, ?3)",
            [(f"{_PREFIX}{p}", p, f"CREATE TABLE {_PREFIX}{p}({columns})") for p in pages],
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    # A new connection parses the schema with the probes in it.
    conn = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
    try:
        conn.execute("PRAGMA cell_size_check=ON")
        conn.execute("PRAGMA writable_schema=ON")  # reads a main file cut short, too
        for p in pages:
            try:
                cursor = conn.execute(f"SELECT rowid, {columns} FROM {_PREFIX}{p}")
            except sqlite3.Error:
                continue
            while True:
                try:
                    row = cursor.fetchone()
                except sqlite3.Error:
                    break  # the rows read before the damaged page are kept
                if row is None:
                    break
                _take(row, out)
            out.pages += 1
    finally:
        conn.close()


def probe_pages(path: Path) -> Probed | None:
    """Every row SQLite reads with each page of ``path`` (main file and WAL) taken as a table
    root; None when SQLite cannot open a copy or write its schema (page 1 damaged).

    Works on a copy in a temporary directory; ``path`` and its WAL are only read.
    """
    out = Probed()
    with tempfile.TemporaryDirectory(prefix="atropos-recover-") as tmp:
        copy = Path(tmp) / "copy.db"
        try:
            shutil.copyfile(path, copy)
            wal = Path(f"{path}-wal")
            if wal.is_file():
                shutil.copyfile(wal, f"{copy}-wal")
            conn = sqlite3.connect(copy, isolation_level=None)
            try:
                conn.execute("PRAGMA writable_schema=ON")
                pages, _ = _page_count(conn, copy)
            finally:
                conn.close()
            for start in range(2, pages + 1, _PROBES_PER_ROUND):
                _probe_round(copy, range(start, min(pages, start + _PROBES_PER_ROUND - 1) + 1), out)
        except (sqlite3.Error, OSError) as e:
            logger.warning("SQLite cannot read the pages of %s one by one (%s)", path, e)
            return None if not out.pages else out
    return out


def single_values(meta: dict[str, list[str]]) -> dict[str, Any]:
    """The meta records found exactly once (an ambiguous record is not guessed)."""
    return {key: values[0] for key, values in meta.items() if len(values) == 1}
