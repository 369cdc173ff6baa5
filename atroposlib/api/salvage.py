"""Reading everything SQLite can still read from a damaged ``--persist`` database.

:func:`salvage` is the read half of ``run-api --persist-recover``
(:mod:`atroposlib.api.recovery` decides how to write what it finds): meta,
every intact group row, and a :class:`RecoveryReport` that counts every
stored group as restored or lost. It reads only; the WAL index SQLite rebuilds
on open is put back as the server left it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atroposlib.api.compression import crc32
from atroposlib.api.page_probe import probe_pages, single_values

logger = logging.getLogger(__name__)

__all__ = ["RecoveryReport", "read_only", "salvage", "shm_frames"]

WAL_HEADER = 32
"""Bytes of a WAL file's header."""
WAL_FRAME_HEADER = 24
"""Bytes of the header in front of each page in a WAL frame."""


def shm_frames(shm: Path) -> tuple[int, int] | None:
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


def read_only(path: Path, lenient: bool = False) -> sqlite3.Connection:
    """A connection that reads the database and its WAL and never writes (no checkpoint on close).

    ``lenient`` turns on ``writable_schema``, with which SQLite reads a main file shorter
    than its header says (otherwise every statement is refused as malformed).
    """
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    if lenient:
        conn.execute("PRAGMA writable_schema=ON")
    return conn


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


def _missing(seq: int, report: RecoveryReport) -> bool:
    """True for a seq SQLite's read counts as lost or cannot account for (an unknown range)."""
    return seq in report.lost or any(a <= seq <= b for a, b in report.unknown)


def salvage(path: Path) -> tuple[dict[str, Any], list[tuple], RecoveryReport]:
    """Everything readable in the damaged database: meta, intact group rows, and the report.

    Two reads, both SQLite's: the tables through their B-trees (table, then
    ledger, then one row at a time, see :class:`_Salvager`), and, where that
    read finds groups missing, every page of the file taken as a table root
    (:func:`~atroposlib.api.page_probe.probe_pages`), which reaches the intact
    leaves below a damaged interior page or in a main file cut short. A group
    either read finds intact is restored; every other seq SQLite saw (a row, a
    ledger entry) is counted as lost. Committed WAL frames past a damaged one
    are beyond SQLite's reach: their groups are reported as an unknown number.
    """
    # The WAL index as the server left it: SQLite rebuilds it on open (stopping at a
    # damaged frame), so it is read first and put back after, for a later retry to see.
    shm = Path(f"{path}-shm")
    left = shm.read_bytes() if shm.is_file() else None
    frames = shm_frames(shm) if left is not None else None
    intact_frames = 0
    meta: dict[str, Any] = {}
    rows: list[tuple] = []
    report = RecoveryReport()
    try:
        conn = read_only(path, lenient=True)
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
            rebuilt = shm_frames(shm) if frames is not None else None
            intact_frames = rebuilt[0] if rebuilt is not None else 0
        finally:
            conn.close()
    except sqlite3.Error as e:
        logger.warning("SQLite cannot open %s (%s)", path, e)
        report.unknown.append((1, 1 << 62))
    finally:
        if left is not None and shm.is_file() and shm.read_bytes() != left:
            shm.write_bytes(left)
    have = {row[0] for row in rows}
    if report.lost or report.unknown or not meta:
        probed = probe_pages(path)
        if probed is not None:
            # Only seqs known to be missing: a page on the free list can hold groups
            # deleted long ago, which must not come back.
            for seq, row in sorted(probed.groups.items()):
                if seq not in have and _missing(seq, report) and _intact(row):
                    rows.append(row[:5])
                    have.add(seq)
            if not meta:
                for key, value in single_values(probed.meta).items():
                    try:
                        meta[key] = json.loads(value)
                    except ValueError:
                        logger.warning("the registration record %r of %s is damaged", key, path)
    report.lost = sorted(set(report.lost) - have)
    if frames is not None:
        # Committed frames SQLite no longer reads (cut off, emptied, or past a damaged
        # frame): their commits are the newest, so whatever they added follows every seq seen.
        report.wal_frames_lost = max(0, frames[0] - max(intact_frames, frames[1]))
        seen = [*have, *report.lost]
        report.after_seq = max(seen) if seen else 0
    rows.sort(key=lambda row: row[0])
    return meta, rows, report
