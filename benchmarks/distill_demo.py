"""The CPU distillation demo's bar over several runs, beside RL alone from the same start.

Runs ``atropos-grpo-run --config example_trainer/configs/distill_cpu.yaml`` ``--runs``
times in a row (each in its own directory under ``--out``), then the teacher's own RL
(``teacher_cpu.yaml``: the same warm-up, task, eval and trainer settings, no teacher)
``--rl-runs`` times with the same number of trainer steps. Every run's ``summary.json``
gives held-out greedy accuracy (200 sums) before → after (after = mean of the last three
evals) and, for the distillation runs, the teacher's accuracy on the same eval.

The bar (docs/performance.md): the student's after >= 80 % of the teacher's, status
ok, within 10 minutes of distillation (the run's wall time less the one-time making of the
teacher, which the first run does when ``.cache/teacher`` holds none), in at least 4 of 5
runs. Each run also reports the first eval step at which it reached 80 % of the teacher,
and the 1-minute load average sampled every 5 s while it ran (other jobs share the CPU).

Usage::

    python benchmarks/distill_demo.py --runs 5
    python benchmarks/distill_demo.py --runs 5 --rl-runs 2 --json distill.json
    python benchmarks/distill_demo.py --summaries runs/distill-demo/*/summary.json
    python benchmarks/distill_demo.py --summaries A/summary.json B/summary.json --budget-steps 150
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.demo_runs import fmt, run_demo, spread  # noqa: E402

CONFIGS = ROOT / "example_trainer" / "configs"
DISTILL = CONFIGS / "distill_cpu.yaml"
RL_ALONE = CONFIGS / "teacher_cpu.yaml"
MAX_WALL_S = 600.0
SHARE = 0.8  # the student's after as a share of the teacher's accuracy


@dataclass
class Run:
    """One run's figures, read from its ``summary.json``."""

    kind: str  # "distill" or "rl"
    run_dir: str
    status: str
    teacher: float | None
    before: float | None
    after: float | None
    wall_s: float  # the run's wall time less the teacher's making
    teacher_build_s: float | None = None
    steps: int | None = None
    evals: List[Dict[str, Any]] = field(default_factory=list)
    load: List[float] = field(default_factory=list)

    @property
    def share(self) -> float | None:
        """after / teacher."""
        if self.after is None or not self.teacher:
            return None
        return self.after / self.teacher

    def first_step_at(self, score: float | None) -> int | None:
        """The first eval step (during or after training) scoring at least ``score``."""
        if score is None:
            return None
        hits = [e["step"] for e in self.evals if e["label"] != "before" and e["score"] >= score]
        return min(hits) if hits else None

    @property
    def meets_bar(self) -> bool:
        """Status ok, after >= 80 % of the teacher, within 10 minutes."""
        share = self.share
        return (
            self.status == "ok"
            and share is not None
            and share >= SHARE
            and self.wall_s <= MAX_WALL_S
        )


def run_from_summary(
    kind: str, summary: Mapping[str, Any], teacher: float | None = None, load: Sequence[float] = ()
) -> Run:
    """A :class:`Run` from a parsed ``summary.json``; ``teacher`` when the summary has none
    (RL alone is measured against the distillation runs' teacher)."""
    phases = summary.get("phases_s") or {}
    build = phases.get("teacher")
    t = summary.get("teacher") or {}
    return Run(
        kind=kind,
        run_dir=str(summary.get("run_dir", "")),
        status=str(summary.get("status", "missing")),
        teacher=t.get("eval", teacher),
        before=summary.get("eval_before"),
        after=summary.get("eval_after"),
        wall_s=float(summary.get("wall_time_s", float("inf"))) - float(build or 0.0),
        teacher_build_s=build,
        steps=summary.get("steps"),
        evals=list(summary.get("evals") or []),
        load=list(load),
    )


def at_step_budget(run: Run, steps: int) -> Run:
    """``run`` as if it had stopped at ``steps``: after = mean of its last three evals at or
    before that step (how a longer run, e.g. the teacher's own RL, compares at the
    distillation's step budget)."""
    evals = [e for e in run.evals if e["step"] <= steps]
    points = [e for e in evals if e["label"] != "before"][-3:]
    after = sum(e["score"] for e in points) / len(points) if points else None
    return Run(
        **{**asdict(run), "after": after, "evals": evals, "steps": min(run.steps or 0, steps)}
    )


def command(config: Path, run_dir: Path, steps: int | None) -> List[str]:
    """The ``atropos-grpo-run`` command line of one run."""
    cmd = [sys.executable, "-m", "example_trainer.run", "--config", str(config)]
    cmd += ["--run-dir", str(run_dir)]
    return cmd + (["--training-steps", str(steps)] if steps is not None else [])


def row(i: int, r: Run) -> str:
    """One Markdown table row."""
    load = f"{statistics.mean(r.load):.1f} / {max(r.load):.1f}" if r.load else "—"
    reach = r.first_step_at(None if r.teacher is None else SHARE * r.teacher)
    build = f" (+{r.teacher_build_s:.0f} s teacher)" if r.teacher_build_s else ""
    return (
        f"| {r.kind} {i} | {fmt(r.teacher)} | {fmt(r.before)} | {fmt(r.after)} | "
        f"{fmt(r.share, '.2f')} | {reach if reach is not None else '—'} | "
        f"{r.wall_s:.0f} s{build} | {load} | "
        f"{'yes' if r.meets_bar else 'no' + ('' if r.status == 'ok' else f' ({r.status})')} |"
    )


def report(runs: Sequence[Run]) -> str:
    """A Markdown table of the runs and a line of medians and ranges per kind."""
    lines = [
        "| run | teacher | before | after | after / teacher | first step >= 80 % teacher | "
        "wall | load mean / max | bar |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    counts: Dict[str, int] = {}
    for r in runs:
        counts[r.kind] = counts.get(r.kind, 0) + 1
        lines.append(row(counts[r.kind], r))
    lines.append("")
    for kind in dict.fromkeys(r.kind for r in runs):
        some = [r for r in runs if r.kind == kind]
        met = sum(r.meets_bar for r in some)
        lines.append(
            f"- {kind}: {met} of {len(some)} runs meet the bar; after "
            f"{spread([r.after for r in some if r.after is not None], '.3f')}; after / teacher "
            f"{spread([r.share for r in some if r.share is not None], '.2f')}; wall "
            f"{spread([r.wall_s for r in some], '.0f')} s"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit 0 when at least 4 of 5 (80 %) distillation runs meet the bar."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="Distillation runs, one after another.")
    p.add_argument(
        "--rl-runs", type=int, help="RL-alone runs after them (default: as many as --runs)."
    )
    p.add_argument("--config", type=Path, default=DISTILL, help="The distillation run config.")
    p.add_argument("--rl-config", type=Path, default=RL_ALONE, help="The RL-alone run config.")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "distill-demo")
    p.add_argument("--json", type=Path, help="Also write the results here.")
    p.add_argument(
        "--summaries",
        nargs="+",
        type=Path,
        help="Report on these summary.json files instead of running (with a teacher: distill).",
    )
    p.add_argument(
        "--budget-steps",
        type=int,
        help="With --summaries: score each run by its evals up to this step (its last three).",
    )
    ns = p.parse_args(argv)
    if ns.summaries:
        loaded = [json.loads(s.read_text()) for s in ns.summaries]
        teacher = next((s["teacher"].get("eval") for s in loaded if s.get("teacher")), None)
        runs = [
            run_from_summary("distill" if s.get("teacher") else "rl", s, teacher) for s in loaded
        ]
        if ns.budget_steps is not None:
            runs = [at_step_budget(r, ns.budget_steps) for r in runs]
        print(report(runs))
        return 0
    import yaml

    steps = int((yaml.safe_load(ns.config.read_text()).get("trainer") or {})["training_steps"])
    ns.out.mkdir(parents=True, exist_ok=True)
    runs: List[Run] = []
    plan = [("distill", ns.config, None)] * ns.runs
    plan += [("rl", ns.rl_config, steps)] * (ns.runs if ns.rl_runs is None else ns.rl_runs)
    counts: Dict[str, int] = {}
    for kind, config, n_steps in plan:
        counts[kind] = counts.get(kind, 0) + 1
        run_dir = ns.out / f"{kind}-{counts[kind]}"
        cmd = command(config, run_dir, n_steps)
        print(f"[{kind} {counts[kind]}] {' '.join(cmd[1:])}", flush=True)
        done = run_demo(
            cmd, run_dir, ns.out / f"{kind}-{counts[kind]}.log", ROOT, {}, load_every=5.0
        )
        teacher = next((r.teacher for r in runs if r.teacher is not None), None)
        if done.summary is None:
            r = Run(
                kind, str(run_dir), f"no summary (exit {done.rc})", teacher, None, None, done.wall_s
            )
        else:
            r = run_from_summary(kind, done.summary, teacher, done.load)
        runs.append(r)
        print(row(counts[kind], r), flush=True)
    print(report(runs))
    if ns.json:
        ns.json.write_text(
            json.dumps(
                [{**asdict(r), "share": r.share, "meets_bar": r.meets_bar} for r in runs],
                indent=1,
            )
        )
    distill = [r for r in runs if r.kind == "distill"]
    return 0 if sum(r.meets_bar for r in distill) * 5 >= 4 * len(distill) else 1


if __name__ == "__main__":
    sys.exit(main())
