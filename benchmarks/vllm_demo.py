"""The vLLM CPU demo's learning bar over several runs, with the machine's load beside each.

Runs ``atropos-grpo-run --config example_trainer/configs/demo_cpu_vllm.yaml`` ``--runs``
times, one after another, each in its own directory under ``--out``. Each run's
``summary.json`` gives held-out greedy accuracy before → after (after = mean of the last
three evals, as the default demo measures); the bar is after >= 2x before and >= +0.3
within 15 minutes, vLLM's start included. The load average (1 minute) is sampled every
``--load-every`` seconds during each run and reported as its mean and maximum, because the
wall time on a shared 2-core machine says little without it::

    python benchmarks/vllm_demo.py --runs 5
    python benchmarks/vllm_demo.py --runs 1 --json one.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "example_trainer" / "configs" / "demo_cpu_vllm.yaml"
MAX_WALL_S = 900.0


@dataclass
class DemoRun:
    """One run: its summary's figures, its wall time and the load average during it."""

    run_dir: str
    status: str
    before: float | None
    after: float | None
    wall_s: float
    phases_s: Dict[str, float] = field(default_factory=dict)
    load_mean: float = 0.0
    load_max: float = 0.0

    @property
    def gain(self) -> float | None:
        """after - before (None when either is missing)."""
        return None if self.before is None or self.after is None else self.after - self.before

    @property
    def ratio(self) -> float | None:
        """after / before (None when either is missing or before is 0)."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before

    @property
    def learned(self) -> bool:
        """after >= 2x before and >= +0.3 (the learning half of the bar)."""
        gain = self.gain
        return gain is not None and gain >= 0.3 and self.after >= 2 * self.before  # type: ignore[operator]

    @property
    def meets_bar(self) -> bool:
        """Learned, status ok and within 15 minutes."""
        return self.status == "ok" and self.learned and self.wall_s <= MAX_WALL_S


class LoadSampler:
    """Samples the 1-minute load average in a background thread until stopped."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.samples: List[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


def run_once(config: Path, run_dir: Path, log: Path, load_every: float) -> DemoRun:
    """Run the demo once (output to ``log``) and read the summary it wrote."""
    cmd = [sys.executable, "-m", "example_trainer.run", "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    t0 = time.time()
    with LoadSampler(load_every) as load, log.open("w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    loads = {"load_mean": statistics.mean(load.samples), "load_max": max(load.samples)}
    path = run_dir / "summary.json"  # run_dir links to the run's own directory
    if not path.exists():
        return DemoRun(str(run_dir), f"no summary (exit {rc})", None, None, wall, **loads)
    s: Dict[str, Any] = json.loads(path.read_text())
    return DemoRun(
        run_dir=str(s.get("run_dir", run_dir)),
        status=str(s.get("status", "missing")),
        before=s.get("eval_before"),
        after=s.get("eval_after"),
        wall_s=wall,
        phases_s={k: float(v) for k, v in (s.get("phases_s") or {}).items()},
        **loads,
    )


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _spread(values: Sequence[float], spec: str) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    return f"{format(med, spec)} ({format(min(values), spec)} to {format(max(values), spec)})"


def report(runs: Sequence[DemoRun]) -> str:
    """A Markdown table of the runs and a line of medians and ranges."""
    lines = [
        "| run | before | after | gain | ratio | wall | load mean / max | learned | bar |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {_fmt(r.before)} | {_fmt(r.after)} | {_fmt(r.gain, '+.3f')} | "
            f"{_fmt(r.ratio, '.2f')}x | {r.wall_s:.0f} s | {r.load_mean:.1f} / {r.load_max:.1f} | "
            f"{'yes' if r.learned else 'no'} | {'yes' if r.meets_bar else 'no (' + r.status + ')'} |"
        )
    pick = {
        "after": ([r.after for r in runs if r.after is not None], ".3f"),
        "gain": ([r.gain for r in runs if r.gain is not None], "+.3f"),
        "ratio": ([r.ratio for r in runs if r.ratio is not None], ".2f"),
        "wall_s": ([r.wall_s for r in runs], ".0f"),
        "load_mean": ([r.load_mean for r in runs], ".1f"),
    }
    parts = [f"{sum(r.meets_bar for r in runs)} of {len(runs)} runs meet the bar"]
    parts += [f"{k} median {_spread(v, spec)}" for k, (v, spec) in pick.items()]  # type: ignore[arg-type]
    return "\n".join(lines + ["", "; ".join(parts)])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit 0 when at least 80 % of the runs meet the bar."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", type=Path, default=CONFIG, help="Run config (default: the vLLM demo)."
    )
    p.add_argument("--runs", type=int, default=5, help="Runs, one after another.")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm-demo")
    p.add_argument("--load-every", type=float, default=15.0, help="Seconds between load samples.")
    p.add_argument("--json", type=Path, help="Also write the runs here.")
    ns = p.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: List[DemoRun] = []
    for i in range(1, ns.runs + 1):
        run_dir = ns.out / f"{stamp}-{i}"
        r = run_once(ns.config, run_dir, ns.out / f"{stamp}-{i}.log", ns.load_every)
        runs.append(r)
        print(
            f"run {i}: {_fmt(r.before)} -> {_fmt(r.after)} ({_fmt(r.ratio, '.2f')}x, "
            f"{_fmt(r.gain, '+.3f')}), {r.wall_s:.0f} s, load {r.load_mean:.1f} mean / "
            f"{r.load_max:.1f} max, {r.status}",
            flush=True,
        )
    print(report(runs))
    if ns.json:
        ns.json.write_text(json.dumps([{**asdict(r), "ratio": r.ratio} for r in runs], indent=2))
    return 0 if sum(r.meets_bar for r in runs) >= 0.8 * len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
