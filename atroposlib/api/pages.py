"""Reading a ``--persist`` database page by page, without SQLite's B-tree walk.

``--persist-recover`` falls back on this where SQLite cannot reach a row: an
interior page is damaged (every leaf below it is cut off), the main file is
truncated (SQLite refuses the file), or the WAL has a damaged frame (SQLite
stops reading the WAL there, and every later commit is dropped).

The database's latest image is rebuilt from the main file overlaid with the
WAL frames the server committed: frames up to the ``mxFrame`` its WAL index
recorded (or the last valid commit frame when there is no index), each
checked against its own checksum, seeded by the previous frame's, so a
damaged frame costs that frame and the next one, never the rest of the WAL.
Every leaf page of that image is parsed: table rows (by their shape: a group
row, a meta row) and ledger index entries (``(seq, size, rowid)``). Pages on
the free list are skipped, so a deleted (consumed) group never comes back.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

__all__ = ["PageScan", "scan_pages"]

_WAL_MAGIC = (0x377F0682, 0x377F0683)
_WAL_HEADER = 32
_FRAME_HEADER = 24
_TABLE_LEAF, _INDEX_LEAF = 13, 10


@dataclass
class PageScan:
    """What the leaf pages of a database's latest image hold.

    ``groups`` maps seq to ``(env_id, size, buffered, body, crc)`` (the body as
    stored, unchecked); ``ledger`` is every seq a ledger entry names; ``meta``
    the raw ``key -> value`` text of the meta table; ``damaged`` counts pages of
    the image that could not be read (a torn main-file page, a damaged frame).
    """

    groups: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    ledger: set[int] = field(default_factory=set)
    meta: dict[str, str] = field(default_factory=dict)
    damaged: int = 0
    wal_frames: int = 0
    """Whole frames in the WAL file (the committed ones beyond them are gone)."""
    ledger_complete: bool = False
    """True when every page of the ledger's tree was read: ``ledger`` is then every stored seq."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = 0
    for k in range(8):
        byte = buf[i + k]
        value = (value << 7) | (byte & 0x7F)
        if byte < 0x80:
            return value, i + k + 1
    return (value << 8) | buf[i + 8], i + 9


def _record(payload: bytes) -> list[Any]:
    """The values of one record (SQLite's record format); raises on a malformed one."""
    header_size, i = _varint(payload, 0)
    types = []
    while i < header_size:
        t, i = _varint(payload, i)
        types.append(t)
    if i != header_size or header_size > len(payload):
        raise ValueError("bad record header")
    at, values = header_size, []
    for t in types:
        if t == 0:
            values.append(None)
        elif 1 <= t <= 6:
            n = (1, 2, 3, 4, 6, 8)[t - 1]
            values.append(int.from_bytes(payload[at : at + n], "big", signed=True))
            at += n
        elif t == 7:
            values.append(struct.unpack_from(">d", payload, at)[0])
            at += 8
        elif t in (8, 9):
            values.append(t - 8)
        elif t >= 12:
            n = (t - 12) // 2
            raw = payload[at : at + n]
            values.append(raw if t % 2 == 0 else raw.decode("utf-8"))
            at += n
        else:
            raise ValueError("reserved serial type")
        if at > len(payload):
            raise ValueError("record runs past its payload")
    return values


class _Image:
    """Pages of the latest committed image: main file overlaid with the WAL's committed frames."""

    def __init__(self, path: Path, mx_frame: int | None) -> None:
        self.main: BinaryIO | None = path.open("rb") if path.is_file() else None
        self.main_size = path.stat().st_size if self.main else 0
        header = self._main_bytes(0, 100)
        self.page = 0
        if len(header) == 100 and header.startswith(b"SQLite format 3\x00"):
            (page,) = struct.unpack_from(">H", header, 16)
            self.page = 65536 if page == 1 else page
            self.usable = self.page - header[20]
        self.frames: dict[int, int] = {}
        self.bad: set[int] = set()
        self.wal_frames = 0
        self.db_pages = self.main_size // self.page if self.page else 0
        wal = Path(f"{path}-wal")
        self.wal: BinaryIO | None = wal.open("rb") if wal.is_file() else None
        if self.wal is not None:
            self._index_wal(mx_frame)
        if self.page and not hasattr(self, "usable"):
            self.usable = self.page

    def _main_bytes(self, at: int, n: int) -> bytes:
        if self.main is None:
            return b""
        self.main.seek(at)
        return self.main.read(n)

    def _index_wal(self, mx_frame: int | None) -> None:
        assert self.wal is not None
        head = self.wal.read(_WAL_HEADER)
        if len(head) < _WAL_HEADER:
            return
        magic, _, page = struct.unpack_from(">III", head, 0)
        if magic not in _WAL_MAGIC or (self.page and page != self.page) or page < 512:
            return
        self.page = self.page or page
        order = ">" if magic & 1 else "<"
        salts = head[16:24]
        seed = struct.unpack_from(">II", head, 24)
        if _checksum(order, head[:24], (0, 0)) != seed:
            return
        frame_size = _FRAME_HEADER + page
        candidates: list[tuple[int, int, int, bool]] = []  # (frame, pgno, commit, valid)
        k = 0
        while True:
            at = _WAL_HEADER + k * frame_size
            self.wal.seek(at)
            raw = self.wal.read(frame_size)
            if len(raw) < frame_size or (mx_frame is not None and k >= mx_frame):
                break
            pgno, commit = struct.unpack_from(">II", raw, 0)
            stored = struct.unpack_from(">II", raw, 16)
            valid = raw[8:16] == salts and _checksum(order, raw[:8] + raw[24:], seed) == stored
            if raw[8:16] == salts:
                candidates.append((k, pgno, commit, valid))
            seed = stored
            k += 1
        self.wal_frames = k
        if mx_frame is None:  # no WAL index: committed up to the last valid commit frame
            ends = [c[0] for c in candidates if c[2] and c[3]]
            last = ends[-1] if ends else -1
        else:
            last = k - 1
        for frame, pgno, commit, valid in candidates:
            if frame > last:
                break
            if valid:
                self.frames[pgno] = _WAL_HEADER + frame * frame_size + _FRAME_HEADER
                self.bad.discard(pgno)
                if commit:
                    self.db_pages = commit
            else:
                self.frames.pop(pgno, None)
                self.bad.add(pgno)

    def read(self, pgno: int) -> bytes | None:
        """Page ``pgno`` of the image, None when its latest version is unreadable."""
        if pgno < 1 or pgno > self.db_pages or pgno in self.bad:
            return None
        if pgno in self.frames and self.wal is not None:
            self.wal.seek(self.frames[pgno])
            return self.wal.read(self.page)
        data = self._main_bytes((pgno - 1) * self.page, self.page)
        return data if len(data) == self.page else None

    def close(self) -> None:
        for f in (self.main, self.wal):
            if f is not None:
                f.close()


def _checksum(order: str, data: bytes, seed: tuple[int, int]) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes) continuing from ``seed``."""
    s1, s2 = seed
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for i in range(0, len(words), 2):
        s1 = (s1 + words[i] + s2) & mask
        s2 = (s2 + words[i + 1] + s1) & mask
    return s1, s2


def _free_pages(image: _Image) -> set[int]:
    """Pages on the free list (their old content is stale: a freed leaf still shows its rows)."""
    page1 = image.read(1)
    free: set[int] = set()
    if page1 is None:
        return free
    trunk, total = struct.unpack_from(">II", page1, 32)
    seen = 0
    while trunk and trunk not in free and seen <= total:
        free.add(trunk)
        data = image.read(trunk)
        if data is None:
            break
        nxt, count = struct.unpack_from(">II", data, 0)
        count = min(count, (image.page - 8) // 4)
        free.update(struct.unpack_from(f">{count}I", data, 8))
        seen += 1 + count
        trunk = nxt
    return free


def _cells(
    image: _Image, data: bytes, start: int, kind: int
) -> Iterator[tuple[int | None, bytes, bool]]:
    """``(rowid or None, payload, whole)`` of each cell of a leaf page, overflow chains
    followed; ``whole`` is False when the chain is cut (the payload is its local part)."""
    u = image.usable
    x = u - 35 if kind == _TABLE_LEAF else ((u - 12) * 64 // 255) - 23
    m = ((u - 12) * 32 // 255) - 23
    (count,) = struct.unpack_from(">H", data, start + 3)
    for c in range(count):
        try:
            (at,) = struct.unpack_from(">H", data, start + 8 + 2 * c)
            size, i = _varint(data, at)
            rowid = None
            if kind == _TABLE_LEAF:
                rowid, i = _varint(data, i)
                rowid = rowid - (1 << 64) if rowid >= 1 << 63 else rowid
            if size <= x:
                yield rowid, data[i : i + size], True
                continue
            k = m + (size - m) % (u - 4)
            local = k if k <= x else m
            parts = [data[i : i + local]]
            (nxt,) = struct.unpack_from(">I", data, i + local)
            have, hops = local, 0
            while have < size and nxt and hops <= image.db_pages:
                page = image.read(nxt)
                if page is None:
                    break
                parts.append(page[4:u])
                have += u - 4
                (nxt,) = struct.unpack_from(">I", page, 0)
                hops += 1
            yield rowid, b"".join(parts)[:size], have >= size
        except (struct.error, IndexError):
            continue


def scan_pages(path: str | Path, mx_frame: int | None = None) -> PageScan:
    """Parse every leaf page of the database at ``path`` (see the module's docstring).

    ``mx_frame`` is the number of committed WAL frames from the server's WAL
    index (None when there is none). Reads only.
    """
    image = _Image(Path(path), mx_frame)
    scan = PageScan(wal_frames=image.wal_frames)
    try:
        if not image.page:
            return scan
        free = _free_pages(image)
        for pgno in range(1, image.db_pages + 1):
            if pgno in free:
                continue
            data = image.read(pgno)
            if data is None:
                scan.damaged += 1
                continue
            start = 100 if pgno == 1 else 0
            if data[start] not in (_TABLE_LEAF, _INDEX_LEAF):
                continue
            for rowid, payload, whole in _cells(image, data, start, data[start]):
                _classify(scan, data[start], rowid, payload, whole)
        root = _root_page(image, "groups_ledger")
        scan.ledger_complete = root is not None and _tree_complete(image, root)
    finally:
        image.close()
    return scan


def _root_page(image: _Image, name: str) -> int | None:
    """The root page of table or index ``name`` from the schema on page 1 (None: unreadable)."""
    page1 = image.read(1)
    if page1 is None or page1[100] != _TABLE_LEAF:
        return None
    for _, payload, whole in _cells(image, page1, 100, _TABLE_LEAF):
        try:
            values = _record(payload) if whole else []
        except (ValueError, IndexError, UnicodeDecodeError, struct.error):
            continue
        if len(values) == 5 and values[1] == name and isinstance(values[3], int):
            return values[3]
    return None


def _tree_complete(image: _Image, root: int) -> bool:
    """True when every page of the index tree at ``root`` reads as an index page."""
    todo, seen = [root], set()
    while todo:
        pgno = todo.pop()
        if pgno in seen or len(seen) > image.db_pages:
            return False
        seen.add(pgno)
        data = image.read(pgno)
        if data is None:
            return False
        kind = data[0]
        if kind == _INDEX_LEAF:
            continue
        if kind != 2:  # an interior index page
            return False
        (count,) = struct.unpack_from(">H", data, 3)
        todo.append(struct.unpack_from(">I", data, 8)[0])
        for c in range(count):
            (at,) = struct.unpack_from(">H", data, 12 + 2 * c)
            todo.append(struct.unpack_from(">I", data, at)[0])
    return True


def _serial_types(payload: bytes) -> list[int]:
    header_size, i = _varint(payload, 0)
    types = []
    while i < min(header_size, len(payload)):
        t, i = _varint(payload, i)
        types.append(t)
    return types


def _classify(
    scan: PageScan, kind: int, rowid: int | None, payload: bytes, whole: bool = True
) -> None:
    """File one cell under groups, ledger or meta by its shape (anything else is ignored)."""
    if not whole:
        # Overflow pages gone: the record header (in the local part) still says whether
        # this was a group row; if so its seq is counted as stored, with no body.
        try:
            types = _serial_types(payload)
        except IndexError:
            return
        if kind == _TABLE_LEAF and len(types) in (5, 6) and types[0] == 0 and rowid is not None:
            scan.groups.setdefault(rowid, (None, 0, 0, b"", None))
        return
    try:
        values = _record(payload)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error):
        return
    if kind == _INDEX_LEAF:
        if len(values) == 3 and all(isinstance(v, int) for v in values) and values[0] == values[2]:
            scan.ledger.add(values[0])
        return
    if (
        len(values) in (5, 6)
        and values[0] is None
        and isinstance(values[2], int)
        and isinstance(values[4], bytes)
    ):
        crc = values[5] if len(values) == 6 else None
        scan.groups[rowid] = (values[1], values[2], values[3], values[4], crc)
    elif len(values) == 2 and all(isinstance(v, str) for v in values):
        scan.meta[values[0]] = values[1]
