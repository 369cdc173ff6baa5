"""The run's results on disk: ``metrics.jsonl`` reading, ``summary.json``/``summary.md``
and ``curve.png``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

logger = logging.getLogger(__name__)

RESULT_FILES = ("metrics.jsonl", "summary.json", "summary.md", "curve.png")

# "after" is the mean of this many final evals: one eval of 200 problems moves by
# ±0.07 (95 %) from sampling alone, so a single point would over- or under-state a run.
AFTER_EVALS = 3

TIME_LIMIT_EXIT = 124
"""Exit status of a run stopped at ``max_wall_time`` (``timeout``'s: the limit, not a crash)."""


def status_text(status: int) -> str:
    """``ok``, ``stopped at max_wall_time`` or ``failed (N)`` for a run's exit status."""
    if status == 0:
        return "ok"
    if status == TIME_LIMIT_EXIT:
        return "stopped at max_wall_time"
    return f"failed ({status})"


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """Trainer ``metrics.jsonl`` rows (a partial last line is skipped)."""
    rows: List[Dict[str, Any]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def new_run_dir(link: Path, stamp: str | None = None) -> Path:
    """A fresh directory beside ``link`` (``runs/demo`` → ``runs/demo-<time>``); ``link`` → it.

    Each run keeps its own results, and ``link`` always names the latest one. A
    ``link`` that is still a real directory (a run from before run directories were
    per-run) is renamed to ``<link>-<its time>`` first, never deleted.
    """
    link = Path(os.path.abspath(link))
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_dir() and not link.is_symlink():
        kept = _unique(link.parent / f"{link.name}-{_stamp(link.stat().st_mtime)}")
        link.rename(kept)
        logger.warning("previous run directory %s moved to %s", link, kept)
    target = _unique(link.parent / f"{link.name}-{stamp or _stamp(time.time())}")
    target.mkdir()
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, link)  # atomic: a reader sees the old or the new run, never neither
    return target


def resumed_run_dir(link: Path) -> Path:
    """The run directory a resumed run continues in: ``link``'s target (or ``link`` itself)."""
    return Path(os.path.abspath(link)).resolve()


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y%m%d-%H%M%S")


def _unique(path: Path) -> Path:
    n = 1
    out = path
    while out.exists() or out.is_symlink():
        n += 1
        out = path.with_name(f"{path.name}-{n}")
    return out


def clear_previous_run(run_dir: Path) -> None:
    """Remove a previous run's results from ``run_dir`` so a rerun starts clean."""
    for name in RESULT_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in ("logs", "checkpoints"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def wilson_interval(score: float, n: int, z: float = 1.96) -> Tuple[float, float]:
    """95 % (``z`` = 1.96) Wilson score interval of a success rate ``score`` over ``n`` trials.

    Wilson rather than the normal approximation: it stays inside [0, 1] and is
    not zero-width at 0 or 1, where a small eval set often sits.
    """
    if n <= 0:
        return (0.0, 1.0)
    z2 = z * z
    centre = (score + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(score * (1 - score) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def after_score(
    evals: Sequence[Dict[str, Any]], last: int = AFTER_EVALS
) -> Tuple[float | None, List[Dict[str, Any]]]:
    """Mean of the last ``last`` evals after training began, and those evals."""
    points = [e for e in evals if e["label"] != "before"][-last:]
    if not points:
        return None, []
    return sum(e["score"] for e in points) / len(points), points


def format_seconds(s: float) -> str:
    """``75`` → ``1m15s``; ``42.3`` → ``42s``."""
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def write_summary(
    run_dir: Path,
    status: int,
    evals: Sequence[Dict[str, Any]],
    started: float,
    inference_version: int | None,
    eval_set: Dict[str, Any] | None = None,
    phases: Dict[str, float] | None = None,
    total_steps: int | None = None,
    teacher: Dict[str, Any] | None = None,
    record: Dict[str, Any] | None = None,
    training: str | None = None,
) -> Dict[str, Any]:
    """``summary.json``, ``summary.md`` and ``curve.png`` in ``run_dir``; prints the result.

    ``eval_set`` describes what the evals scored (``held_out``, ``size``,
    ``train_size``); ``phases`` the seconds spent per phase (warm-up, RL, eval);
    ``teacher`` a distillation run's teacher (``model``, its ``eval``, ``build_seconds``);
    ``record`` why the run stopped and what it left (``stop_reason``, ``final_model``,
    ``checkpoints``, ``hyperparameters``, ``config``: see ``Launcher.record``).
    ``training`` what was trained (LoRA or full fine-tuning).
    """
    record = record or {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    before = next((e["score"] for e in evals if e["label"] == "before"), None)
    after, after_points = after_score(evals)
    size = (eval_set or {}).get("size")
    evals = [
        {**e, "ci95": list(wilson_interval(e["score"], e.get("n") or size or 0))} for e in evals
    ]
    summary: Dict[str, Any] = {
        "status": status_text(status),
        "exit_status": status,
        "stop_reason": record.get("stop_reason"),
        "wall_time_s": round(time.time() - started, 1),
        "phases_s": {k: round(v, 1) for k, v in (phases or {}).items()},
        "steps": rows[-1]["step"] if rows else 0,
        "total_steps": total_steps,
        "eval_set": eval_set,
        "eval_before": before,
        "eval_after": after,
        "eval_after_steps": [e["step"] for e in after_points],
        "evals": evals,
        "first_mean_score": rows[0].get("train/mean_score") if rows else None,
        "last_mean_score": rows[-1].get("train/mean_score") if rows else None,
        "final_loss": rows[-1].get("train/loss") if rows else None,
        "inference_weights_version": inference_version,
        "run_dir": str(run_dir),
        "final_model": record.get("final_model"),
        "checkpoints": record.get("checkpoints", []),
        "hyperparameters": record.get("hyperparameters", {}),
        "config": record.get("config"),
    }
    if teacher is not None:
        summary["teacher"] = teacher
    if training is not None:
        summary["training"] = training
    phase_text = ", ".join(f"{name} {format_seconds(sec)}" for name, sec in (phases or {}).items())
    if phases and "eval" in phases and "RL" in phases:
        phase_text += "; evals during RL overlap it"
    lines = [
        f"# Run summary ({summary['status']})",
        "",
        f"- run directory: {run_dir}",
        f"- wall time: {format_seconds(summary['wall_time_s'])}"
        + (f" ({phase_text})" if phase_text else ""),
        f"- trainer steps: {summary['steps']}" + (f" / {total_steps}" if total_steps else ""),
    ]
    if summary["stop_reason"]:
        lines.append(f"- stopped because: {summary['stop_reason']}")
    if training is not None:
        lines.append(f"- training: {training}")
    if eval_set:
        lines.append(
            f"- eval set: {eval_set.get('size')} problems, "
            + (
                f"held out from training (train set: {eval_set.get('train_size')})"
                if eval_set.get("held_out")
                else "the same problems the model trains on"
            )
        )
    headline = None
    if before is not None and after is not None:
        steps = ", ".join(str(e["step"]) for e in after_points)
        headline = (
            f"eval score: {before:.3f} before → {after:.3f} after ({after - before:+.3f}"
            + (f", {after / before:.1f}x" if before > 0 else "")
            + f"; after = mean of the evals at steps {steps})"
        )
        lines.append(f"- {headline}")
        summary["improvement"] = after - before
        summary["ratio"] = after / before if before > 0 else None
        learned = after >= 2 * before and after - before >= 0.3
        summary["learned"] = learned
        lines.append(f"- learned (after >= 2x before and >= +0.3): {'yes' if learned else 'no'}")
    t_score = (teacher or {}).get("eval")
    if t_score is not None:
        line = f"- teacher: {t_score:.3f} on the same eval ({teacher.get('model')})"  # type: ignore[union-attr]
        if after is not None and t_score > 0:
            summary["teacher_ratio"] = after / t_score
            line += f"; student after / teacher = {after / t_score:.2f}"
        lines.append(line)
    if evals:
        lines += [
            "",
            "| eval | step | score | 95% interval (Wilson) | n |",
            "|---|---:|---:|---|---:|",
        ]
        for e in evals:
            lo, hi = e["ci95"]
            n = e.get("n") or size
            lines.append(
                f"| {e['label']} | {e['step']} | {e['score']:.3f} | {lo:.3f} – {hi:.3f} | {n or '?'} |"
            )
    lines += _record_lines(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    try:
        plot_curve(rows, evals, run_dir / "curve.png", after=after, after_points=after_points)
    except Exception as exc:  # plotting must never hide the run's result
        logger.warning("could not plot the curve: %s", exc)
    print(
        "\n".join(
            [
                "",
                f"run {summary['status']}: {summary['steps']} steps in "
                f"{format_seconds(summary['wall_time_s'])}"
                + (f" ({phase_text})" if phase_text else ""),
                *([f"stopped because: {summary['stop_reason']}"] if summary["stop_reason"] else []),
                *([headline] if headline else []),
                *([f"final model: {summary['final_model']}"] if summary["final_model"] else []),
                f"curve:   {run_dir / 'curve.png'}",
                f"summary: {run_dir / 'summary.md'}",
            ]
        ),
        flush=True,
    )
    return summary


def _record_lines(summary: Dict[str, Any]) -> List[str]:
    """``summary.md``'s sections on what the run left (model, checkpoints) and how it was set."""
    lines = ["", "## Models", ""]
    final = summary.get("final_model")
    lines.append(f"- final model: {final}" if final else "- final model: none was saved")
    checkpoints = summary.get("checkpoints") or []
    lines.append(
        f"- checkpoints ({len(checkpoints)}): "
        + (", ".join(checkpoints) if checkpoints else "none")
    )
    hyper = summary.get("hyperparameters") or {}
    if hyper:
        lines += ["", "## Key settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in hyper.items()]
    config = summary.get("config")
    if config:
        import yaml

        lines += [
            "",
            "## Configuration",
            "",
            "The run's whole configuration (file and flags merged; every trainer setting not",
            "listed here has its default, see `atropos-grpo --help`):",
            "",
            "```yaml",
            yaml.safe_dump(config, sort_keys=False).rstrip(),
            "```",
        ]
    return lines


LOSS_PANEL = (("train/loss", "loss"), ("train/entropy", "entropy"), ("train/kl", "KL to reference"))
"""The training-signal plots under the reward curve: metric key and title."""


def plot_curve(
    rows: Sequence[Dict[str, Any]],
    evals: Sequence[Dict[str, Any]],
    out: Path,
    after: float | None = None,
    after_points: Sequence[Dict[str, Any]] = (),
) -> None:
    """Reward per step (and its moving average), every eval point with its 95 % interval
    when known, and the "after" mean over the steps it averages; under it the loss, entropy
    and KL per step, each on its own scale (a metric the trainer did not log says so). A PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(9, 6.5))
    grid = fig.add_gridspec(2, len(LOSS_PANEL), height_ratios=(2, 1))
    ax = fig.add_subplot(grid[0, :])
    steps = [r["step"] for r in rows]
    scores = [r.get("train/mean_score", 0.0) for r in rows]
    if steps:
        ax.plot(steps, scores, alpha=0.35, label="batch mean reward")
        ax.plot(steps, _moving_average(scores), label=f"reward (moving avg {_window(scores)})")
    if evals:
        xs = [e["step"] for e in evals]
        ys = [e["score"] for e in evals]
        if all("ci95" in e for e in evals):
            err = [
                [y - e["ci95"][0] for y, e in zip(ys, evals, strict=True)],
                [e["ci95"][1] - y for y, e in zip(ys, evals, strict=True)],
            ]
            ax.errorbar(
                xs, ys, yerr=err, fmt="o-", color="black", capsize=3, label="eval (95% interval)"
            )
        else:
            ax.plot(xs, ys, "o-", color="black", label="eval score")
    if after is not None and after_points:
        span = [after_points[0]["step"], after_points[-1]["step"]]
        if span[0] == span[1]:
            span = [span[0] - 0.5, span[1] + 0.5]
        ax.plot(span, [after, after], color="tab:red", lw=3, label=f"after (mean) {after:.2f}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)
    for i, (key, title) in enumerate(LOSS_PANEL):
        sub = fig.add_subplot(grid[1, i])
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            xs = [x for x, _ in points]
            ys = [y for _, y in points]
            sub.plot(xs, ys, alpha=0.35, color=f"C{i + 2}")
            sub.plot(xs, _moving_average(ys), color=f"C{i + 2}")
        else:
            sub.text(0.5, 0.5, "not logged", ha="center", va="center", transform=sub.transAxes)
        sub.set_title(title, fontsize="small")
        sub.set_xlabel("trainer step", fontsize="small")
        sub.tick_params(labelsize="x-small")
        sub.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _window(values: Sequence[float]) -> int:
    return max(1, len(values) // 10)


def _moving_average(values: Sequence[float]) -> List[float]:
    """Trailing mean over a tenth of the series (at least one point)."""
    k = _window(values)
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
        for i in range(len(values))
    ]
