"""``run-api --persist`` on a full disk, a torn main file, a second server, and a recovery
that cannot write: real run-api processes throughout.

The full-disk tests mount a small tmpfs (root only); they are skipped, with mount's
reason, where mounting is not permitted.
"""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest

from atroposlib.api.salvage import shm_frames as _shm_frames
from atroposlib.testing.persist_soak import run_rounds, small_disk
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON
from tests.api.conftest import start_api
from tests.api.test_hardening import _copy, _damage, _database, _garbage


@pytest.fixture
def disk(tmp_path: Path):
    try:
        with small_disk(tmp_path / "disk", 8) as mounted:
            yield mounted
    except OSError as e:
        pytest.skip(f"needs a small tmpfs: {e}")


def _run_api(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "atroposlib.cli.run_api", "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fill(directory: Path) -> Path:
    """Write a ballast file until the filesystem refuses a byte more."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for chunk in (65536, 4096, 1):
            try:
                while os.write(fd, b"\0" * chunk):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return ballast


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.name != "ballast"
    }


def test_disk_full_kill_9_and_sigterm_then_restart_keep_every_acknowledged_group(disk):
    """One soak round: posts until 503 "disk is full", kill -9, a restart on the still-full
    disk (stopped by SIGTERM, whose checkpoint meets the full disk too), space freed, the
    queue drained; then kill -9 while posting. A main file the full disk left mid-page was
    refused at the restart before."""
    counts = run_rounds(disk, rounds=1, log=lambda line: None)
    assert counts.disk_full == 1 and counts.full_restarts == 1
    assert counts.acknowledged > 20 and counts.lost == []
    assert counts.restored == counts.acknowledged


def test_a_main_file_ending_mid_page_with_its_pages_in_the_wal_starts(tmp_path):
    """What a checkpoint stopped by a full disk leaves: the main file grown by part of a page,
    every committed page still in the WAL."""
    db = _copy(_database(tmp_path, groups=40), tmp_path / "copy")
    with db.open("ab") as f:
        f.write(b"\0" * 6000)
    ctx, url = start_api(tmp_path, "--persist", str(db))
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/status").json()["queue_size"] == 40


def test_a_second_run_api_on_the_same_database_exits_2_naming_the_first(tmp_path):
    db = tmp_path / "api.db"
    ctx, url = start_api(tmp_path, "--persist", str(db))
    with ctx as first:
        second = _run_api("--persist", str(db))
        out = second.stdout + second.stderr
        assert second.returncode == 2, out
        assert f"pid {first.pid}" in out and str(db) in out and "Traceback" not in out
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/status").status_code == 200  # the first is untouched
    # Once the first has stopped, the database is free again.
    ctx, url = start_api(tmp_path, "--persist", str(db))
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/status").status_code == 200


def _garbage_in_main(tmp_path: Path, disk: Path) -> Path:
    """A checkpointed database (no WAL) with garbage in the middle of its main file: SQLite's
    own view is damaged, so only a fresh copy recovers it."""
    damaged = _copy(_database(tmp_path, groups=40, how="close"), disk / "db")
    _garbage(damaged, at=0.5)
    return damaged


def _garbage_in_wal(tmp_path: Path, disk: Path) -> Path:
    damaged = _copy(_database(tmp_path, groups=40), disk / "db")
    _damage("garbage mid-WAL", damaged)
    return damaged


def _sqlite_reads(db: Path, scratch: Path) -> int:
    """Groups SQLite itself reads from a copy of ``db`` (it stops at a damaged WAL frame)."""
    conn = sqlite3.connect(_copy(db, scratch))
    try:
        return conn.execute("SELECT count(*) FROM groups").fetchone()[0]
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


@pytest.mark.parametrize(
    "damage, how",
    [(_garbage_in_wal, "in place"), (_garbage_in_main, "into a fresh")],
    ids=["WAL damage (in place)", "main-file damage (fresh copy)"],
)
def test_recovery_on_a_full_disk_moves_nothing_and_says_what_to_free(tmp_path, disk, damage, how):
    damaged = damage(tmp_path, disk)
    readable = _sqlite_reads(damaged, tmp_path / "sqlite-view")
    ballast = _fill(disk)
    before = _snapshot(damaged.parent)

    run = _run_api("--persist", str(damaged), "--persist-recover")

    out = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "Free at least" in line]
    assert len(lines) == 1 and "nothing was moved or deleted" in lines[0]
    assert str(damaged.parent) in lines[0]
    after = _snapshot(damaged.parent)
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }

    ballast.unlink()  # space freed: the same command now recovers every readable group
    ctx, url = start_api(tmp_path, "--persist", str(damaged), "--persist-recover")
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        queued = c.get("/status").json()["queue_size"]
    assert list(damaged.parent.glob("api.db.damaged-*"))
    log = "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
    assert f"restored {queued} groups" in log and how in log
    if how == "in place":  # every group SQLite reads; those past the damaged frame are gone
        assert queued == readable > 10 and "WAL frames that are gone" in log
    else:
        assert f"restored {queued} groups, lost {40 - queued}" in log and queued >= 1


def _leave_free(ballast: Path, nbytes: int) -> None:
    os.truncate(ballast, max(0, ballast.stat().st_size - nbytes))


@pytest.fixture
def big_disk(tmp_path: Path):
    try:
        with small_disk(tmp_path / "big", 16) as mounted:
            yield mounted
    except OSError as e:
        pytest.skip(f"needs a small tmpfs: {e}")


def test_wal_damage_is_recovered_in_place_with_less_room_than_a_copy_needs(tmp_path, big_disk):
    """200 groups (4.6 MB main file, 4.3 MB WAL) with a frame near the WAL's committed end
    garbled; 3 MiB free, where a fresh copy needs about 7.5 MiB: the recovery cuts the WAL
    where SQLite stops reading it, in the database itself, and run-api serves every group
    SQLite reads (the few committed past the damaged frame are gone)."""
    damaged = _copy(_database(tmp_path, groups=200), big_disk / "db")
    committed = _shm_frames(Path(f"{damaged}-shm"))[0]
    with open(f"{damaged}-wal", "r+b") as f:
        f.seek(32 + (committed - 3) * (16384 + 24) + 24 + 100)
        f.write(random.Random(3).randbytes(2000))
    readable = _sqlite_reads(damaged, tmp_path / "sqlite-view")
    assert 190 < readable < 200
    ballast = _fill(big_disk)
    _leave_free(ballast, 3 << 20)

    ctx, url = start_api(tmp_path, "--persist", str(damaged), "--persist-recover")
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/status").json()["queue_size"] == readable
    log = "".join(p.read_text() for p in tmp_path.glob("api-*.log"))
    assert f"restored {readable} groups, lost 0, and the groups committed in" in log
    assert "in place" in log
    kept = {p.name.rsplit("-", 1)[-1] for p in damaged.parent.glob("api.db.damaged-*")}
    assert kept == {"wal", "shm"}
    # Repaired for good: a plain start on the same (still nearly full) disk opens it.
    ctx, url = start_api(tmp_path, "--persist", str(damaged))
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/status").json()["queue_size"] == readable


def test_a_torn_page_past_the_declared_size_is_cut_in_place_on_a_nearly_full_disk(tmp_path, disk):
    """A checkpointed main file with part of a page past the size its header declares (no
    WAL): with 256 KiB free, far less than a copy, the torn bytes are kept aside and cut."""
    db = _copy(_database(tmp_path, groups=40, how="close"), disk / "db")
    size = db.stat().st_size
    with db.open("ab") as f:
        f.write(random.Random(5).randbytes(6000))
    _leave_free(_fill(disk), 256 << 10)

    ctx, url = start_api(tmp_path, "--persist", str(db), "--persist-recover")
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/status").json()["queue_size"] == 40
    assert db.stat().st_size == size
    (kept,) = db.parent.glob("api.db.damaged-*-main")
    assert kept.stat().st_size == 6000
