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
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.demo_runs import DemoRun as _DemoRun  # noqa: E402
from benchmarks.demo_runs import fmt, record_fields, run_demo, summary_line  # noqa: E402

CONFIG = ROOT / "example_trainer" / "configs" / "demo_cpu_vllm.yaml"
MAX_WALL_S = 900.0


@dataclass
class DemoRun(_DemoRun):
    """One run: its summary's figures, its wall time and the load average during it; the
    bar's limit is 15 minutes, vLLM's start included."""

    MAX_WALL_S = MAX_WALL_S

    phases_s: Dict[str, float] = field(default_factory=dict)
    load_mean: float = 0.0
    load_max: float = 0.0


def run_once(config: Path, run_dir: Path, log: Path, load_every: float) -> DemoRun:
    """Run the demo once (output to ``log``) and read the summary it wrote."""
    cmd = [sys.executable, "-m", "example_trainer.run", "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    done = run_demo(cmd, run_dir, log, ROOT, {"WANDB_MODE": "disabled"}, load_every)
    loads = {"load_mean": statistics.mean(done.load), "load_max": max(done.load)}
    if done.summary is None:
        status = f"no summary (exit {done.rc})"
        return DemoRun(str(run_dir), status, None, None, done.wall_s, **loads)
    fields = {**record_fields(done.summary), "run_dir": str(done.summary.get("run_dir", run_dir))}
    phases = {k: float(v) for k, v in (done.summary.get("phases_s") or {}).items()}
    return DemoRun(**fields, wall_s=done.wall_s, phases_s=phases, **loads)


def report(runs: Sequence[DemoRun]) -> str:
    """A Markdown table of the runs and a line of medians and ranges."""
    lines = [
        "| run | before | after | gain | ratio | wall | load mean / max | learned | bar |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {fmt(r.before)} | {fmt(r.after)} | {fmt(r.gain, '+.3f')} | "
            f"{fmt(r.ratio, '.2f')}x | {r.wall_s:.0f} s | {r.load_mean:.1f} / {r.load_max:.1f} | "
            f"{'yes' if r.learned else 'no'} | {'yes' if r.meets_bar else 'no (' + r.status + ')'} |"
        )
    keys = (
        ("after", ".3f"),
        ("gain", "+.3f"),
        ("ratio", ".2f"),
        ("wall_s", ".0f"),
        ("load_mean", ".1f"),
    )
    return "\n".join(lines + ["", summary_line(runs, keys)])


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
            f"run {i}: {fmt(r.before)} -> {fmt(r.after)} ({fmt(r.ratio, '.2f')}x, "
            f"{fmt(r.gain, '+.3f')}), {r.wall_s:.0f} s, load {r.load_mean:.1f} mean / "
            f"{r.load_max:.1f} max, {r.status}",
            flush=True,
        )
    print(report(runs))
    if ns.json:
        ns.json.write_text(json.dumps([{**asdict(r), "ratio": r.ratio} for r in runs], indent=2))
    return 0 if sum(r.meets_bar for r in runs) >= 0.8 * len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
