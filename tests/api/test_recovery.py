"""``run-api --persist-recover``: every readable group is restored and every lost one is counted.

A database of small groups (dozens per 16 KiB page) is damaged page by page at
chosen places; the salvage must restore exactly the rows a row-by-row read of
the damaged file can still read, and report the others as lost, by seq.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sqlite3
from pathlib import Path

import pytest

from atroposlib.api.persistence import GroupRow, SqlitePersistence
from atroposlib.api.recovery import recover_database

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


# ------------------------------------------------ damage SQLite's own walk cannot get past


def _big_seq_database(tmp_path: Path, n: int = 400) -> tuple[Path, list[int]]:
    """``n`` groups of ~6 KB (one per leaf page) with seqs above 2^20, as a long run has."""
    db = tmp_path / "api.db"
    store = SqlitePersistence(db)
    seqs = [(1 << 20) + 5 + 7 * i for i in range(n)]
    rows = [
        GroupRow(s, 0, 2, False, json.dumps({"tokens": [[s] * 1500] * 2, "n": s}).encode())
        for s in seqs
    ]
    store.commit(insert=rows, meta={"state": {"registered": True, "pending": None}})
    store.close()
    return db, seqs


def _root(db: Path, name: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)
        ).fetchone()[0]
    finally:
        conn.close()


def test_recovery_reads_every_intact_leaf_below_damaged_interior_pages_past_seq_2_20(tmp_path):
    db, seqs = _big_seq_database(tmp_path)
    leaves = _pages(db, "groups")
    _overwrite(db, [leaves[len(leaves) // 2], leaves[-1]])
    readable = _readable(db, seqs)  # every row but the two on the damaged leaves
    assert len(readable) == len(seqs) - 2
    # Now the table's root (interior) page and the whole ledger too: SQLite reaches no row.
    _overwrite(db, [_root(db, "groups"), *_pages(db, "groups_ledger")])
    assert _readable(db, seqs) == set()

    report = recover_database(db)

    assert report.restored == len(readable) and report.registration
    fresh = SqlitePersistence(db)
    assert [g.seq for g in fresh.load().groups] == sorted(readable)
    fresh.close()


def test_groups_deleted_before_the_damage_stay_deleted(tmp_path):
    """Freed pages keep their old rows and SQLite reads them when probed: only the seqs the
    ledger still lists come back."""
    from atroposlib.api.page_probe import probe_pages

    db, seqs = _big_seq_database(tmp_path)
    deleted, live = seqs[:150], seqs[150:]
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA secure_delete=OFF")  # as many builds do: freed pages keep their rows
    with conn:
        conn.execute("DELETE FROM groups WHERE seq <= ?", (deleted[-1],))
    conn.close()
    _overwrite(db, [_root(db, "groups")])
    before = db.read_bytes()
    probed = probe_pages(db)
    assert probed is not None and set(deleted) & set(probed.groups)  # the old rows are there
    assert db.read_bytes() == before  # probing reads a copy only

    report = recover_database(db)

    assert report.restored == len(live) and report.exact and not report.lost
    fresh = SqlitePersistence(db)
    assert [g.seq for g in fresh.load().groups] == live
    fresh.close()


def test_recovery_of_a_main_file_truncated_to_half_restores_its_readable_half(tmp_path, caplog):
    db, seqs = _big_seq_database(tmp_path)
    os.truncate(db, db.stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        report = recover_database(db)
    # Each group is a leaf and an overflow page written side by side: about half survive,
    # the ledger (near the file's start) names every one, so the count is exact.
    assert len(seqs) // 3 < report.restored < len(seqs)
    assert report.exact and report.restored + len(report.lost) == len(seqs)
    assert report.registration
    fresh = SqlitePersistence(db)
    state = fresh.load()
    fresh.close()
    assert state.meta["state"]["registered"] and len(state.groups) == report.restored
    assert all(json.loads(fresh_body)["n"] == s for s, fresh_body in _bodies(db, state.groups))


def _bodies(db: Path, groups) -> list[tuple[int, bytes]]:
    store = SqlitePersistence(db)
    try:
        return [(g.seq, store.body(g.seq)) for g in groups]
    finally:
        store.close()


@pytest.fixture(scope="module")
def crashed_200(tmp_path_factory) -> Path:
    """200 groups posted to a store in a process then killed (its WAL holds them)."""
    from tests.api.test_hardening import _database

    return _database(tmp_path_factory.mktemp("crashed"), groups=200)


def _sqlite_reads(db: Path) -> int:
    """Groups SQLite itself reads from a copy of ``db`` (it stops at a damaged WAL frame)."""
    from tests.api.test_hardening import _copy

    copy = _copy(db, db.parent / "sqlite-view")
    conn = sqlite3.connect(copy)
    try:
        return conn.execute("SELECT count(*) FROM groups").fetchone()[0]
    finally:
        conn.close()


def test_recovery_of_a_damaged_wal_restores_what_sqlite_reads_and_says_the_rest_is_uncounted(
    tmp_path, crashed_200
):
    from tests.api.test_hardening import _copy, _damage

    db = _copy(crashed_200, tmp_path / "copy")
    _damage("garbage mid-WAL", db)
    readable = _sqlite_reads(db)
    report = recover_database(db)
    # SQLite stops at the damaged frame: the committed frames after it are beyond its reach,
    # so their groups are lost, and the report says their number is unknown.
    assert 150 < readable < 200 and report.restored == readable
    assert report.wal_frames_lost > 0 and not report.exact
    assert "WAL frames that are gone" in report.describe()


def test_recovery_of_a_cut_wal_says_its_count_is_not_exact(tmp_path, crashed_200):
    from tests.api.test_hardening import _copy, _damage

    db = _copy(crashed_200, tmp_path / "copy")
    _damage("truncated WAL", db)
    report = recover_database(db)
    assert report.wal_frames_lost > 0 and not report.exact
    assert "WAL frames that are gone" in report.describe()


def test_a_recovery_interrupted_between_its_renames_is_finished_by_the_next_start(tmp_path):
    from atroposlib.api.recovery import _write_replacement, open_persistence

    db, seqs = _database(tmp_path)
    _overwrite(db, _pick(_pages(db, "groups"), "middle"))
    readable = _readable(db, seqs)
    before = db.read_bytes()
    # The new database is written and synced, then the process dies before any rename.
    from atroposlib.api.recovery import _salvage

    meta, rows, _ = _salvage(db)
    _write_replacement(db, meta, rows)
    assert db.read_bytes() == before and Path(f"{db}.recovered").exists()

    store = open_persistence(db)  # no --persist-recover needed: the result is complete
    try:
        assert [g.seq for g in store.load().groups] == sorted(readable)
    finally:
        store.close()
    kept = list(tmp_path.glob("api.db.damaged-*"))
    assert [p.read_bytes() for p in kept if p.name.endswith(tuple("0123456789"))] == [before]
    assert not Path(f"{db}.recovered").exists()


# ------------------------------------------------ in place: SQLite's own view is sound


def _files(db: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(db.parent.iterdir()) if p.name != "api.db.lock"}


def _state(db: Path) -> tuple[dict, list[tuple[int, bytes]]]:
    store = SqlitePersistence(db)
    try:
        state = store.load()
        return state.meta, [(g.seq, store.body(g.seq)) for g in state.groups]
    finally:
        store.close()


def _wal_damaged(tmp_path: Path, crashed: Path, name: str) -> Path:
    from tests.api.test_hardening import _copy, _damage

    db = _copy(crashed, tmp_path / name)
    _damage("garbage mid-WAL", db)
    return db


def test_an_in_place_recovery_leaves_what_a_fresh_copy_holds(tmp_path, crashed_200, monkeypatch):
    from atroposlib.api import recovery

    in_place = _wal_damaged(tmp_path, crashed_200, "in-place")
    fresh = _wal_damaged(tmp_path, crashed_200, "fresh")
    a = recover_database(in_place)
    monkeypatch.setattr(recovery, "plan_in_place", lambda *args: None)
    b = recover_database(fresh)
    assert (a.restored, a.lost) == (b.restored, b.lost) and a.restored > 150
    assert _state(in_place) == _state(fresh)
    assert {p.name.rsplit("-", 1)[-1] for p in in_place.parent.glob("api.db.damaged-*")} == {
        "wal",
        "shm",
    }


def test_a_failed_in_place_recovery_puts_back_every_byte_it_overwrote(
    tmp_path, crashed_200, monkeypatch
):
    from atroposlib.api import repair

    db = _wal_damaged(tmp_path, crashed_200, "copy")
    before = _files(db)
    overwrote = []

    def full_disk(conn: sqlite3.Connection, plan) -> None:
        # A transaction too big for the page cache spills into the WAL before it fails.
        conn.execute("PRAGMA cache_size=2")
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO groups (seq, env_id, size, buffered, body) VALUES (?, 0, 1, 0, ?)",
            [(10**9 + i, b"x" * 40000) for i in range(40)],
        )
        overwrote.append(Path(f"{db}-wal").read_bytes() != before["api.db-wal"])
        raise sqlite3.OperationalError("database or disk is full")

    from atroposlib.api import recovery

    planned = recovery.plan_in_place

    def with_a_change(*args):  # a record to update, so the repair writes a transaction
        plan = planned(*args)
        assert plan is not None and not plan.insert
        plan.meta["state"] = {"registered": True, "pending": None}
        return plan

    monkeypatch.setattr(recovery, "plan_in_place", with_a_change)
    monkeypatch.setattr(repair, "_transaction", full_disk)
    with pytest.raises(repair.RecoveryFailedError, match="nothing was moved or deleted"):
        recover_database(db)
    assert overwrote == [True]
    assert _files(db) == before


def test_an_interrupted_in_place_recovery_is_undone_by_the_next_start(
    tmp_path, crashed_200, monkeypatch
):
    from atroposlib.api import repair
    from atroposlib.api.recovery import DamagedDatabaseError, open_persistence

    db = _wal_damaged(tmp_path, crashed_200, "copy")
    before = _files(db)

    def killed(path, conn, plan):  # committed, then the process dies before it is final
        raise KeyboardInterrupt

    monkeypatch.setattr(repair, "_finish", killed)
    with pytest.raises(KeyboardInterrupt):
        recover_database(db)
    assert Path(f"{db}.repairing").exists()
    monkeypatch.undo()

    with pytest.raises(DamagedDatabaseError):  # the damage is back, for the check to find
        open_persistence(db)
    assert _files(db) == before
    store = open_persistence(db, recover=True)
    try:
        assert len(store.load().groups) > 150
    finally:
        store.close()
