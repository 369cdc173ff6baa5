"""The run's results on disk: ``metrics.jsonl`` reading, ``summary.json``/``summary.md``
and ``curve.png``.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

logger = logging.getLogger(__name__)

RESULT_FILES = ("metrics.jsonl", "summary.json", "summary.md", "curve.png")


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


def clear_previous_run(run_dir: Path) -> None:
    """Remove a previous run's results from ``run_dir`` so a rerun starts clean."""
    for name in RESULT_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in ("logs", "checkpoints"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def write_summary(
    run_dir: Path,
    status: int,
    evals: Sequence[Dict[str, Any]],
    started: float,
    inference_version: int | None,
) -> Dict[str, Any]:
    """``summary.json``, ``summary.md`` and ``curve.png`` in ``run_dir``; prints the summary."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    before = next((e["score"] for e in evals if e["label"] == "before"), None)
    after = next((e["score"] for e in reversed(evals) if e["label"] == "after"), None)
    summary: Dict[str, Any] = {
        "status": "ok" if status == 0 else f"failed ({status})",
        "wall_time_s": round(time.time() - started, 1),
        "steps": rows[-1]["step"] if rows else 0,
        "eval_before": before,
        "eval_after": after,
        "evals": list(evals),
        "first_mean_score": rows[0].get("train/mean_score") if rows else None,
        "last_mean_score": rows[-1].get("train/mean_score") if rows else None,
        "final_loss": rows[-1].get("train/loss") if rows else None,
        "inference_weights_version": inference_version,
        "run_dir": str(run_dir),
    }
    lines = [
        f"# Run summary ({summary['status']})",
        "",
        f"- wall time: {summary['wall_time_s']} s",
        f"- trainer steps: {summary['steps']}",
    ]
    if before is not None and after is not None:
        lines.append(
            f"- eval score: {before:.3f} before → {after:.3f} after ({after - before:+.3f})"
        )
        summary["improvement"] = after - before
        summary["ratio"] = after / before if before > 0 else None
        learned = after >= 2 * before and after - before >= 0.3
        lines.append(f"- learned (after >= 2x before and >= +0.3): {'yes' if learned else 'no'}")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")
    try:
        plot_curve(rows, evals, run_dir / "curve.png")
    except Exception as exc:  # plotting must never hide the run's result
        logger.warning("could not plot the curve: %s", exc)
    print("\n".join(lines))
    return summary


def plot_curve(rows: Sequence[Dict[str, Any]], evals: Sequence[Dict[str, Any]], out: Path) -> None:
    """Reward per step (and its moving average) plus eval points, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    scores = [r.get("train/mean_score", 0.0) for r in rows]
    if steps:
        ax.plot(steps, scores, alpha=0.35, label="batch mean reward")
        k = max(1, len(scores) // 10)
        avg = [
            sum(scores[max(0, i - k + 1) : i + 1]) / len(scores[max(0, i - k + 1) : i + 1])
            for i in range(len(scores))
        ]
        ax.plot(steps, avg, label=f"reward (moving avg {k})")
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["score"] for e in evals],
            "o-",
            color="black",
            label="eval score",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
