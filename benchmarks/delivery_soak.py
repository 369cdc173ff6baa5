"""Soak of ``/batch`` delivery: ``kill -9`` of ``run-api --persist`` while it answers batches.

A trainer (``example_trainer.api.BatchClient``) drains pre-posted groups in
batches of 4 groups (~0.8 MB of JSON each); right after each of its requests
the API is killed at a random delay and restarted on the same database. Prints
how many kills landed before the trainer had the answer, and checks that every
acknowledged group reached exactly one trainer step.

    .venv/bin/python benchmarks/delivery_soak.py --kills 40 --groups 200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.api.test_delivery import kill_during_batches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=40)
    p.add_argument("--groups", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=6000)
    p.add_argument("--max-delay", type=float, default=0.05, help="seconds after a request")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        acked, result = kill_during_batches(
            Path(tmp), args.kills, args.groups, args.seq_len, args.seed, args.max_delay
        )
    trained = [tag for step in result.steps for tag in step]
    lost = sorted(set(acked) - set(trained))
    twice = sorted({t for t in trained if trained.count(t) > 1})
    print(f"groups acknowledged      {len(acked)}")
    print(f"trainer steps            {len(result.steps)}")
    print(f"kill -9 done             {result.kills}")
    print(f"  before the answer was received  {result.kills_mid_answer}")
    print(f"groups lost              {len(lost)} {lost[:10]}")
    print(f"groups trained twice     {len(twice)} {twice[:10]}")
    print(f"wall time                {time.monotonic() - start:.1f} s")
    if lost or twice or sorted(trained) != acked:
        raise SystemExit("FAILED: an acknowledged group did not reach exactly one trainer step")
    print("OK: every acknowledged group reached exactly one trainer step")


if __name__ == "__main__":
    main()
