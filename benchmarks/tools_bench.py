"""Throughput of the inspection tools on a large `process` output.

Writes a synthetic rollout file (GROUPS groups of 8 sequences of 1,024 tokens with messages,
masks and inference logprobs), then times `generate_html` (jsonl2html), building the
`view-run --file` index, and a text search over every group. Each is printed as wall seconds
and as CPU seconds (``time.process_time`` of this process, which does the work): the CPU
figure is the one to compare across runs on a loaded machine.

Usage: python benchmarks/tools_bench.py [--groups 1000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from atroposlib.frontend.jsonl2html import generate_html
from atroposlib.frontend.rollouts import RolloutIndex

T = TypeVar("T")

GROUP_SIZE, SEQ_LEN, PROMPT_LEN = 8, 1024, 200


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()``, its wall seconds and this process's CPU seconds (all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def write_rollouts(path: Path, n_groups: int, seed: int = 0) -> None:
    """Write ``n_groups`` synthetic scored groups in the format `process` writes."""
    rng = random.Random(seed)
    words = ["a", "b", "**c**", "`d`", "e"]
    with path.open("w") as f:
        for g in range(n_groups):
            tokens = [[rng.randrange(256) for _ in range(SEQ_LEN)] for _ in range(GROUP_SIZE)]
            messages = [
                [
                    {"role": "system", "content": "You are a careful math tutor. " * 20},
                    {"role": "user", "content": f"question {g}: " + "what is x? " * 30},
                    {
                        "role": "assistant",
                        "content": " ".join(rng.choice(words) for _ in range(300))
                        + "\n```py\nx=1\n```",
                    },
                ]
                for _ in range(GROUP_SIZE)
            ]
            row = {
                "tokens": tokens,
                "masks": [[-100] * PROMPT_LEN + t[PROMPT_LEN:] for t in tokens],
                "scores": [rng.choice([1.0, -1.0]) for _ in range(GROUP_SIZE)],
                "inference_logprobs": [[1.0] * PROMPT_LEN + [-0.5] * (SEQ_LEN - PROMPT_LEN)]
                * GROUP_SIZE,
                "messages": messages,
            }
            f.write(json.dumps(row) + "\n")


def main() -> None:
    """Write the rollout file, run the three tools on it and print wall and CPU seconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rollouts.jsonl"
        write_rollouts(path, args.groups)
        mb = path.stat().st_size / 1e6
        html_path, t_html, c_html = timed(lambda: generate_html(str(path)))
        index, t_index, c_index = timed(lambda: RolloutIndex.build([path]))
        _, t_query, c_query = timed(lambda: index.filter(query=f"question {args.groups - 1}"))
        print(f"input: {args.groups} groups x {GROUP_SIZE} x {SEQ_LEN} tokens = {mb:.0f} MB jsonl")
        print(
            f"generate_html: {t_html:.2f} s ({args.groups / t_html:.0f} groups/s), "
            f"CPU {c_html:.2f} s ({args.groups / max(c_html, 1e-9):.0f} groups/CPU-s), "
            f"html {Path(html_path).stat().st_size / 1e6:.1f} MB"
        )
        print(
            f"view-run --file index: {t_index:.2f} s ({mb / t_index:.0f} MB/s), "
            f"CPU {c_index:.2f} s ({mb / max(c_index, 1e-9):.0f} MB/CPU-s)"
        )
        print(f"text search over all groups: {t_query:.2f} s, CPU {c_query:.2f} s")


if __name__ == "__main__":
    main()
