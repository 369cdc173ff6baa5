"""``run-api --persist-recover``: every readable group is restored and every lost one is counted.

A database of small groups (dozens per 16 KiB page) is damaged page by page at
chosen places; the salvage must restore exactly the rows a row-by-row read of
the damaged file can still read, and report the others as lost, by seq.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
from pathlib import Path

import pytest

from atroposlib.api.persistence import GroupRow, SqlitePersistence, recover_database

STORED = 1000


def _seq(i: int) -> int:
    # Seqs with gaps, as a queue has after batches, buffers and drops.
    return 1 + 3 * i + (i % 7)


def _database(tmp_path: Path) -> tuple[Path, list[int]]:
    db = tmp_path / "api.db"
    store = SqlitePersistence(db)
    seqs = [_seq(i) for i in range(STORED)]
    rows = [
        GroupRow(seq, 0, 2, False, json.dumps({"tokens": [[seq] * 20] * 2, "n": seq}).encode())
        for seq in seqs
    ]
    store.commit(insert=rows, meta={"state": {"registered": True, "pending": None}})
    store.close()
    return db, seqs


def _pages(db: Path, name: str) -> list[int]:
    """Leaf pages of table or index ``name``, in key order."""
    conn = sqlite3.connect(db)
    try:
        return [
            p
            for (p,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY path",
                (name,),
            )
        ]
    finally:
        conn.close()


def _overwrite(db: Path, pages: list[int]) -> None:
    size = sqlite3.connect(db).execute("PRAGMA page_size").fetchone()[0]
    noise = random.Random(11)
    with db.open("r+b") as f:
        for page in pages:
            f.seek((page - 1) * size)
            f.write(noise.randbytes(size))


def _readable(db: Path, seqs: list[int]) -> set[int]:
    """Seqs whose row a one-by-one read of the damaged file returns intact."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    found = set()
    for seq in seqs:
        try:
            row = conn.execute(
                "SELECT body FROM groups NOT INDEXED WHERE seq = ?", (seq,)
            ).fetchone()
        except sqlite3.Error:
            continue
        if row is not None and json.loads(row[0]).get("n") == seq:
            found.add(seq)
    conn.close()
    return found


def _pick(leaves: list[int], where: str) -> list[int]:
    n = len(leaves)
    return {
        "first": [leaves[0]],
        "middle": [leaves[n // 2]],
        "last": [leaves[-1]],
        "two adjacent in the middle": leaves[n // 2 : n // 2 + 2],
        "several apart": [leaves[1], leaves[n // 3], leaves[2 * n // 3], leaves[-2]],
        "first and last": [leaves[0], leaves[-1]],
    }[where]


@pytest.mark.parametrize(
    "where",
    ["first", "middle", "last", "two adjacent in the middle", "several apart", "first and last"],
)
def test_recovery_restores_every_readable_group_and_counts_every_lost_one(tmp_path, where):
    db, seqs = _database(tmp_path)
    leaves = _pages(db, "groups")
    assert len(leaves) > 10  # dozens of groups per page: a page holds many groups
    _overwrite(db, _pick(leaves, where))
    readable = _readable(db, seqs)
    assert 0 < len(readable) < STORED

    report = recover_database(db)

    assert report.exact
    assert report.restored == len(readable)
    assert sorted(report.lost) == sorted(set(seqs) - readable)
    assert report.restored + len(report.lost) == STORED
    fresh = SqlitePersistence(db)
    assert [g.seq for g in fresh.load().groups] == sorted(readable)
    fresh.close()


def test_recovery_with_the_ledger_damaged_reads_everything_from_the_table(tmp_path):
    db, seqs = _database(tmp_path)
    _overwrite(db, _pages(db, "groups_ledger"))
    report = recover_database(db)
    assert report.exact and report.restored == STORED and not report.lost


def test_recovery_with_both_copies_of_a_range_damaged_says_the_count_is_unknown(tmp_path):
    db, seqs = _database(tmp_path)
    table = _pages(db, "groups")
    _overwrite(db, [*_pages(db, "groups_ledger"), table[len(table) // 2]])
    readable = _readable(db, seqs)
    report = recover_database(db)
    assert report.restored == len(readable)  # still every readable row
    assert not report.exact
    gone = set(seqs) - readable - set(report.lost)
    assert gone and all(any(a <= s <= b for a, b in report.unknown) for s in gone)


def test_recovery_log_names_the_lost_seq_ranges(tmp_path, caplog):
    db, seqs = _database(tmp_path)
    _overwrite(db, _pick(_pages(db, "groups"), "middle"))
    readable = _readable(db, seqs)
    lost = sorted(set(seqs) - readable)
    with caplog.at_level(logging.WARNING):
        report = recover_database(db)
    line = " ".join(r.getMessage() for r in caplog.records if "--persist-recover" in r.getMessage())
    assert f"restored {len(readable)} groups, lost {len(lost)}" in line
    assert f"{lost[0]}-{lost[-1]}" in line and report.lost_ranges() == [(lost[0], lost[-1])]
