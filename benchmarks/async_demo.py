"""The CPU demo's learning bar under the async-RL knobs, over several runs.

Runs ``atropos-grpo-run --config example_trainer/configs/demo_cpu.yaml`` ``--runs``
times in a row, each in its own directory under ``--out`` (the plain demo's
``runs/demo`` is left alone), with ``run-api --max-staleness K`` and/or
``atropos-grpo --off-policy-correction MODE [--off-policy-clip C]``. Each run's
``summary.json`` gives held-out greedy accuracy before → after (after = mean of the
last three evals); the bar (docs/performance.md) is after >= 2x before and
>= +0.3 (``--min-gain``: the reasoning-gym demo's is +0.2), within 10 minutes, in at least
4 of 5 runs.

Usage::

    python benchmarks/async_demo.py --max-staleness 1 --off-policy-correction tis --runs 5
    python benchmarks/async_demo.py --off-policy-correction tis --runs 3 --json tis.json
    python benchmarks/async_demo.py --summaries runs/async-demo/tis-s1-*/summary.json
    python benchmarks/async_demo.py --config example_trainer/configs/reasoning_gym_cpu.yaml --min-gain 0.2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.demo_runs import DemoRun, fmt, record_fields, run_demo, summary_line  # noqa: E402
from benchmarks.demo_runs import aggregate as _aggregate  # noqa: E402

DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"
MAX_WALL_S = 600.0
KEYS = ("before", "after", "gain", "ratio", "wall_s")


@dataclass
class RunResult(DemoRun):
    """One demo run's outcome, read from its ``summary.json``; the bar's limit is 10 minutes."""

    MAX_WALL_S = MAX_WALL_S


def result_from_summary(
    summary: Mapping[str, Any], wall_s: float | None = None, min_gain: float = RunResult.min_gain
) -> RunResult:
    """A :class:`RunResult` from a parsed ``summary.json`` (its own wall time unless given),
    held to a gain of at least ``min_gain``."""
    return RunResult(
        **record_fields(summary),
        wall_s=float(wall_s if wall_s is not None else summary.get("wall_time_s", float("inf"))),
        min_gain=min_gain,
    )


def demo_command(
    config: Path,
    run_dir: Path,
    max_staleness: int | None,
    correction: str | None,
    clip: float | None,
    trainer_args: Sequence[str] = (),
) -> List[str]:
    """The ``atropos-grpo-run`` command line of one run."""
    cmd = [sys.executable, "-m", "example_trainer.run", "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    if max_staleness is not None:
        cmd += ["--max-staleness", str(max_staleness)]
    trainer: List[str] = []
    if correction is not None:
        trainer += ["--off-policy-correction", correction]
    if clip is not None:
        trainer += ["--off-policy-clip", str(clip)]
    trainer += list(trainer_args)
    return cmd + (["--", *trainer] if trainer else [])


def run_once(cmd: Sequence[str], run_dir: Path, log: Path, min_gain: float) -> RunResult:
    """Run one demo (its output to ``log``) and read the summary it wrote."""
    done = run_demo(cmd, run_dir, log, ROOT, {"WANDB_MODE": "offline"})
    if done.summary is None:
        status = f"no summary (exit {done.rc})"
        return RunResult(str(run_dir), status, None, None, done.wall_s, min_gain)
    return result_from_summary(done.summary, done.wall_s, min_gain)


def aggregate(results: Sequence[RunResult]) -> Dict[str, Any]:
    """How many runs meet the bar, and median/min/max of before, after, gain, ratio, wall."""
    return _aggregate(results, KEYS)


def report(results: Sequence[RunResult], label: str) -> str:
    """A Markdown table of the runs and a line of aggregates."""
    lines = [
        f"### {label}",
        "",
        "| run | before | after | gain | ratio | wall | bar |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(results, 1):
        lines.append(
            f"| {i} | {fmt(r.before)} | {fmt(r.after)} | {fmt(r.gain, '+.3f')} | "
            f"{fmt(r.ratio, '.2f')}x | {r.wall_s:.0f} s | "
            f"{'yes' if r.meets_bar else 'no (' + r.status + ')' if r.status != 'ok' else 'no'} |"
        )
    keys = (("after", ".3f"), ("gain", "+.3f"), ("ratio", ".2f"), ("wall_s", ".0f"))
    lines += ["", summary_line(results, keys)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit 0 when at least 4 of 5 (80 %) of the runs meet the bar."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEMO, help="Run config (default: the demo).")
    p.add_argument("--runs", type=int, default=5, help="Runs, one after another.")
    p.add_argument("--max-staleness", type=int, help="run-api --max-staleness K.")
    p.add_argument("--off-policy-correction", choices=["none", "tis", "icepop"])
    p.add_argument("--off-policy-clip", type=float, help="atropos-grpo --off-policy-clip C.")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "async-demo")
    p.add_argument("--tag", help="Run directory prefix (default: from the knobs).")
    p.add_argument("--json", type=Path, help="Also write the results here.")
    p.add_argument(
        "--min-gain",
        type=float,
        default=RunResult.min_gain,
        help="The bar's least gain over before (the reasoning-gym demo's: 0.2).",
    )
    p.add_argument(
        "--summaries",
        nargs="+",
        type=Path,
        help="Report on these summary.json files instead of running.",
    )
    ns, trainer_args = p.parse_known_args(argv)
    if ns.summaries:
        results = [
            result_from_summary(json.loads(s.read_text()), min_gain=ns.min_gain)
            for s in ns.summaries
        ]
        print(report(results, "summaries"))
        return 0
    tag = ns.tag or "-".join(
        [
            ns.off_policy_correction or "none",
            *([f"c{ns.off_policy_clip:g}"] if ns.off_policy_clip is not None else []),
            *([f"s{ns.max_staleness}"] if ns.max_staleness is not None else []),
        ]
    )
    ns.out.mkdir(parents=True, exist_ok=True)
    results: List[RunResult] = []
    for i in range(1, ns.runs + 1):
        run_dir = ns.out / f"{tag}-{i}"
        cmd = demo_command(
            ns.config,
            run_dir,
            ns.max_staleness,
            ns.off_policy_correction,
            ns.off_policy_clip,
            trainer_args,
        )
        print(f"[{i}/{ns.runs}] {' '.join(cmd[1:])}", flush=True)
        r = run_once(cmd, run_dir, ns.out / f"{tag}-{i}.log", ns.min_gain)
        results.append(r)
        print(
            f"  before {fmt(r.before)} after {fmt(r.after)} gain {fmt(r.gain, '+.3f')} "
            f"wall {r.wall_s:.0f} s bar {'yes' if r.meets_bar else 'no'} ({r.status})",
            flush=True,
        )
    label = f"{tag}: {' '.join(demo_command(ns.config, ns.out / tag, ns.max_staleness, ns.off_policy_correction, ns.off_policy_clip, trainer_args)[3:])}"
    print(report(results, label))
    if ns.json:
        ns.json.write_text(
            json.dumps(
                {
                    "label": label,
                    "results": [{**asdict(r), "meets_bar": r.meets_bar} for r in results],
                    "aggregate": aggregate(results),
                },
                indent=1,
            )
        )
    return 0 if aggregate(results)["meet_bar"] * 5 >= 4 * len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
