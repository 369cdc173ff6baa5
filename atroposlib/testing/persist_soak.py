"""Rounds of full disks, stops and ``kill -9`` against ``run-api --persist``.

Each round, on a small tmpfs holding the database and a ballast file:

1. posts groups until run-api answers 503 "disk is full";
2. stops it (``kill -9`` and SIGTERM in turn), starts it again on the still-full
   disk and checks it starts with every acknowledged group queued;
3. frees the ballast, restarts, and drains the queue through ``/batch``;
4. posts from a thread and ``kill -9`` s run-api mid-stream, restarts and drains.

Every group answered 200 must be served after its restart (``lost`` counts
those that are not). Used by ``benchmarks/persist_soak.py`` and, for one round,
by the suite (``tests/api/test_disk_full.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON, running_process

__all__ = ["SoakCounts", "run_rounds", "small_disk"]

TRAINER = {
    "wandb_group": "soak",
    "wandb_project": "soak",
    "batch_size": 4,
    "max_token_len": 4096,
    "checkpoint_dir": "ckpts",
    "save_checkpoint_interval": 5,
    "starting_step": 0,
    "num_steps": 1000000,
}
_SEQ_LEN = 400
_MAX_POSTS = 5000
"""Bound on the posts of one fill (a disk that never fills ends the fill there)."""


@contextmanager
def small_disk(path: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB mounted at ``path`` for the block (needs root).

    Raises :class:`OSError` with mount's reason when the mount is refused.
    """
    path.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode:
        raise OSError(f"cannot mount a {mib} MiB tmpfs at {path}: {run.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@dataclass
class SoakCounts:
    """Groups acknowledged (200), found again after a restart, and lost, over all rounds."""

    acknowledged: int = 0
    restored: int = 0
    lost: list[int] = field(default_factory=list)
    disk_full: int = 0
    kills: int = 0
    terms: int = 0
    full_restarts: int = 0

    def describe(self) -> str:
        """One line for the soak's output."""
        return (
            f"acknowledged {self.acknowledged}, restored {self.restored}, lost {len(self.lost)}; "
            f"disk full {self.disk_full} times, {self.full_restarts} restarts on a full disk, "
            f"{self.kills} kill -9, {self.terms} SIGTERM"
        )


def _group(tag: int, env_id: int) -> dict:
    tokens = [[tag * 10 + i] * _SEQ_LEN for i in range(4)]
    return {
        "tokens": tokens,
        "masks": tokens,
        "scores": [1.0, 0.0, 1.0, 0.0],
        "env_id": env_id,
    }


class _Api:
    """Starts run-api on one database, always on the same port."""

    def __init__(self, db: Path, logs: Path) -> None:
        self.db, self.logs, self.port = db, logs, free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def running(self):
        cmd = [PYTHON, "-m", "atroposlib.cli.run_api", "--port", str(self.port)]
        cmd += ["--log-level", "warning", "--persist", str(self.db)]
        return running_process(cmd, health_url=f"{self.url}/health", log_path=self.logs / "api.log")


def _drain(c: httpx.Client) -> list[int]:
    """Tags of every group served until the queue is empty (each answer acknowledges the last)."""
    tags: list[int] = []
    seen: set[str] = set()
    for _ in range(_MAX_POSTS):
        answer = c.get("/batch")
        answer.raise_for_status()
        body = answer.json()
        if body["batch"] is None:
            return tags
        if body["batch_id"] in seen:
            continue
        seen.add(body["batch_id"])
        tags += [g["tokens"][0][0] // 10 for g in body["batch"]]
    raise AssertionError("the queue did not drain")


def _post_until_full(c: httpx.Client, env_id: int, tag: int, acked: list[int]) -> int:
    """Post until a 503 "disk is full"; returns the next unused tag."""
    for _ in range(_MAX_POSTS):
        r = c.post("/scored_data", json=_group(tag, env_id))
        tag += 1
        if r.status_code == 200:
            acked.append(tag - 1)
        elif r.status_code == 503 and "full" in r.text:
            return tag
        else:
            raise AssertionError(f"post answered {r.status_code}: {r.text[:200]}")
    raise AssertionError(f"the disk was not full after {_MAX_POSTS} posts")


def _post_forever(url: str, env_id: int, tag: int, stop: threading.Event, acked: list[int]):
    with httpx.Client(base_url=url, timeout=5) as c:
        while not stop.is_set():
            try:
                r = c.post("/scored_data", json=_group(tag, env_id))
            except httpx.HTTPError:
                return
            if r.status_code == 200:
                acked.append(tag)
            tag += 1


def _check(counts: SoakCounts, acked: list[int], served: list[int]) -> None:
    counts.acknowledged += len(acked)
    got = set(served)
    counts.restored += sum(1 for t in acked if t in got)
    counts.lost += [t for t in acked if t not in got]


def run_rounds(
    disk: Path, rounds: int, ballast_mib: int = 3, kill_after: int = 20, log=print
) -> SoakCounts:
    """Run ``rounds`` rounds (see the module's docstring) on the mounted tmpfs ``disk``."""
    db, ballast = disk / "api.db", disk / "ballast"
    logs = disk.parent
    api = _Api(db, logs)
    counts = SoakCounts()
    tag, env_id = 1, 0
    for r in range(rounds):
        ballast.write_bytes(b"\0" * (ballast_mib << 20))
        acked: list[int] = []
        how = signal.SIGKILL if r % 2 == 0 else signal.SIGTERM
        with api.running() as proc, httpx.Client(base_url=api.url, timeout=30) as c:
            if r == 0:
                c.post("/register", json=TRAINER).raise_for_status()
                c.get("/batch").raise_for_status()
                env = c.post(
                    "/register-env",
                    json={
                        "max_token_length": 4096,
                        "desired_name": "soak",
                        "weight": 1.0,
                        "group_size": 4,
                    },
                )
                env_id = env.json()["env_id"]
            tag = _post_until_full(c, env_id, tag, acked)
            counts.disk_full += 1
            os.killpg(proc.pid, how)
            proc.wait(timeout=30)
        counts.kills += how == signal.SIGKILL
        counts.terms += how == signal.SIGTERM
        # The disk is still full: the database must open, every acknowledged group queued.
        with api.running(), httpx.Client(base_url=api.url, timeout=30) as c:
            queued = c.get("/status").json()["queue_size"]
            counts.full_restarts += 1
        if queued < len(acked):
            log(f"round {r}: restart on a full disk queued {queued} of {len(acked)}")
        ballast.unlink()
        with api.running(), httpx.Client(base_url=api.url, timeout=30) as c:
            served = _drain(c)
        _check(counts, acked, served)
        # kill -9 while posting.
        acked = []
        with api.running() as proc:
            stop = threading.Event()
            thread = threading.Thread(
                target=_post_forever, args=(api.url, env_id, tag, stop, acked)
            )
            thread.start()
            for _ in range(100000):
                if len(acked) > kill_after or not thread.is_alive():
                    break
                stop.wait(0.005)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            stop.set()
            thread.join(timeout=30)
            counts.kills += 1
        tag = max(acked, default=tag) + 100
        with api.running(), httpx.Client(base_url=api.url, timeout=30) as c:
            served = _drain(c)
        _check(counts, acked, served)
        log(f"round {r + 1}/{rounds}: {counts.describe()}")
    return counts
