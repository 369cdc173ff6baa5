"""Soak of ``run-api --persist`` through full disks, stops and ``kill -9`` (needs root: it
mounts a small tmpfs).

Each round fills the disk until run-api answers 503 "disk is full", stops it
(``kill -9`` and SIGTERM in turn), restarts it on the still-full disk, frees the
ballast, drains the queue, then ``kill -9`` s it while posting and drains again
(:mod:`atroposlib.testing.persist_soak`). Prints acknowledged / restored / lost
counts and fails on any lost group.

    .venv/bin/python benchmarks/persist_soak.py --rounds 10
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from atroposlib.testing.persist_soak import run_rounds, small_disk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--disk-mib", type=int, default=8, help="size of the tmpfs")
    p.add_argument("--ballast-mib", type=int, default=3, help="freed after each disk-full restart")
    args = p.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, small_disk(Path(tmp) / "disk", args.disk_mib) as d:
        counts = run_rounds(d, args.rounds, ballast_mib=args.ballast_mib)
    print(counts.describe())
    print(f"wall time {time.monotonic() - start:.1f} s")
    if counts.lost:
        raise SystemExit(f"FAILED: {len(counts.lost)} acknowledged groups lost: {counts.lost[:20]}")
    print("OK: every acknowledged group was served after its restart")


if __name__ == "__main__":
    main()
