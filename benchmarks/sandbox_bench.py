"""Sandboxed executions per second vs plain ``subprocess.run`` (the original's way), side by side.

Each execution runs one small Python program (read a number from stdin, print a sum) with
the same interpreter. ``plain`` writes the code to a temporary file and calls
``subprocess.run([python, file], input=..., timeout=5)`` as the original's ``/execute``
did; ``sandbox`` runs it in :class:`atroposlib.sandbox.Sandbox` (bubblewrap: new
namespaces, read-only host, rlimits). Both run ``--concurrency`` executions at once
(threads for plain, asyncio for the sandbox). The modes alternate round by round so
that load changes hit both alike; the script prints executions/s per mode (median and range
over the rounds) and the sandbox/plain ratio of the medians, the figure to compare across
machines and loads. (No CPU-time figure: the sandbox's first process is reaped by
bubblewrap's own reaper, outside this process's waited-for children, so ``getrusage``
cannot see the sandboxed work.)

Usage: python benchmarks/sandbox_bench.py [--rounds 5] [--runs 40] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

from atroposlib.sandbox import Sandbox, SandboxConfig

CODE = "n = int(input())\nprint(sum(range(n)))\n"
STDIN = "100000\n"
EXPECTED = f"{sum(range(100000))}\n"


def plain_once(python: str) -> str:
    """One execution the original's way: a temp file and ``subprocess.run`` with a timeout."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CODE)
    try:
        done = subprocess.run(
            [python, f.name], input=STDIN, capture_output=True, text=True, timeout=5
        )
    finally:
        os.remove(f.name)
    return done.stdout


def plain_round(python: str, runs: int, concurrency: int) -> List[str]:
    """``runs`` plain executions, ``concurrency`` at once."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: plain_once(python), range(runs)))


def sandbox_round(sandbox: Sandbox, runs: int) -> List[str]:
    """``runs`` sandboxed executions (the sandbox bounds how many run at once)."""

    async def all_runs() -> List[str]:
        results = await asyncio.gather(
            *(sandbox.run_python(CODE, stdin=STDIN) for _ in range(runs))
        )
        return [r.stdout for r in results]

    return asyncio.run(all_runs())


def measure(fn: Callable[[], List[str]], runs: int) -> float:
    """Executions/s of one round; every output is checked."""
    wall = time.perf_counter()
    outputs = fn()
    wall = time.perf_counter() - wall
    bad = [o for o in outputs if o != EXPECTED]
    if bad:
        raise SystemExit(f"sandbox_bench: wrong output {bad[0]!r}")
    return runs / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="Rounds per mode (alternating).")
    parser.add_argument("--runs", type=int, default=40, help="Executions per round.")
    parser.add_argument("--concurrency", type=int, default=2, help="Executions at once.")
    args = parser.parse_args()

    sandbox = Sandbox(SandboxConfig(timeout_s=5), max_concurrency=args.concurrency)
    python = sandbox.python  # the same interpreter for both modes
    modes: Dict[str, Callable[[], List[str]]] = {
        "plain": lambda: plain_round(python, args.runs, args.concurrency),
        "sandbox": lambda: sandbox_round(sandbox, args.runs),
    }
    for fn in modes.values():  # warm the page cache and the interpreter's files
        fn()
    rates: Dict[str, List[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, fn in modes.items():
            rates[mode].append(measure(fn, args.runs))
    load = os.getloadavg()
    print(
        f"sandbox_bench: {args.rounds} rounds x {args.runs} executions, concurrency "
        f"{args.concurrency}, {os.cpu_count()} CPUs, python {python}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(f"{'mode':<8} {'exec/s median':>14} {'range':>15}")
    for mode in modes:
        r = rates[mode]
        print(f"{mode:<8} {statistics.median(r):>14.1f} {min(r):>7.1f}-{max(r):<7.1f}")
    ratio = statistics.median(rates["sandbox"]) / statistics.median(rates["plain"])
    per_round = sorted(s / p for s, p in zip(rates["sandbox"], rates["plain"], strict=True))
    print(
        f"sandbox/plain: {ratio:.2f}x the executions/s (per round {per_round[0]:.2f}-"
        f"{per_round[-1]:.2f}x)"
    )


if __name__ == "__main__":
    main()
