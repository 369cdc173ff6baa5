"""CPU time per post into the odd-sized group buffer, as the buffer grows.

Posts groups of 3 sequences (they never add up to the group size 8, the case
that used to slow every post down), in process, and prints the CPU time per
post (``time.process_time``, median of 5 blocks of 200 posts) after 0, 1,500
and 10,000 groups are buffered. "whole buffer" is the original's matching
(:func:`find_groups_summing_to_target` over every buffered group), "store" is
:class:`RolloutStore`'s matching.

    .venv/bin/python benchmarks/api_buffer_bench.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atroposlib.api.models import RegisterEnv, Registration  # noqa: E402
from atroposlib.api.store import IncomingGroup, RolloutStore  # noqa: E402
from atroposlib.api.utils import find_groups_summing_to_target  # noqa: E402

BODY = json.dumps({"tokens": [[1]] * 3, "env_id": 0}).encode()


def _store() -> RolloutStore:
    store = RolloutStore(10**12, max_buffer_bytes=10**12)
    store.register_trainer(
        Registration(
            wandb_group="g",
            wandb_project="p",
            batch_size=8,
            max_token_len=8,
            checkpoint_dir="c",
            save_checkpoint_interval=1,
            starting_step=0,
            num_steps=1,
        )
    )
    store.serve_batch(None)
    store.register_env(RegisterEnv(max_token_length=8, desired_name="b", weight=1.0, group_size=8))
    return store


def _per_post_us(post, blocks: int = 5, per_block: int = 200) -> float:
    times = []
    for _ in range(blocks):
        start = time.process_time()
        for _ in range(per_block):
            post()
        times.append((time.process_time() - start) / per_block * 1e6)
    return statistics.median(times)


def main() -> None:
    print(f"{'buffered groups':>16} {'whole buffer µs/post':>22} {'store µs/post':>15}")
    for fill in (0, 1500, 10000):
        store = _store()
        store.ingest([IncomingGroup(0, 3, BODY) for _ in range(fill)])
        buffer = [{"tokens": range(3)} for _ in range(fill)]

        def original(buffer: list = buffer) -> None:
            buffer.append({"tokens": range(3)})
            find_groups_summing_to_target(buffer, 8)

        def ours(store: RolloutStore = store) -> None:
            store.ingest([IncomingGroup(0, 3, BODY)])

        print(f"{fill:>16} {_per_post_us(original):>22.1f} {_per_post_us(ours):>15.1f}")


if __name__ == "__main__":
    main()
