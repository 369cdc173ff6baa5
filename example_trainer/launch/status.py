"""The launcher's view of a run while it goes: a live table on a terminal, plain lines otherwise.

Both show ``step N / total``, an ETA and the time spent per phase (warm-up, RL,
eval). A log file or CI console cannot redraw a table, so without a terminal the
launcher prints a line per progress mark instead (:class:`PlainProgress`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Sequence

from .processes import ProcessGroup
from .summary import format_seconds, read_metrics


def eta_seconds(step: int, total: int, elapsed: float, since_step: int = 0) -> float | None:
    """Seconds left at the pace since ``since_step`` (``elapsed`` seconds ago).

    The pace is measured from the first step seen, not from the trainer's start:
    loading the model and the first rollouts would otherwise make the first
    estimates many times too long. None until a step has been timed.
    """
    if step <= since_step or total <= 0 or elapsed <= 0:
        return None
    return elapsed / (step - since_step) * max(total - step, 0)


def progress_text(
    step: int,
    total: int,
    eta: float | None,
    phases: Dict[str, float],
    last_row: Dict[str, Any] | None = None,
    evals: Sequence[Dict[str, Any]] = (),
) -> str:
    """``step 40 / 200  ETA 1m20s  loss … reward …  eval 0.31@40  (warm-up 12s, RL 30s, eval 4s)``."""
    parts = [f"step {step} / {total}" if total else f"step {step}"]
    parts.append(f"ETA {format_seconds(eta)}" if eta is not None else "ETA ?")
    if last_row:
        parts.append(
            f"loss {last_row.get('train/loss', float('nan')):+.4f}  "
            f"reward {last_row.get('train/mean_score', float('nan')):.3f}"
        )
    if evals:
        e = evals[-1]
        parts.append(f"eval {e['score']:.3f}@{e['step']}")
    if phases:
        parts.append("(" + ", ".join(f"{k} {format_seconds(v)}" for k, v in phases.items()) + ")")
    return "  ".join(parts)


class PlainProgress:
    """Decides when to print a plain progress line: at every ``1/marks`` of the run and at
    least every ``interval`` seconds while steps advance, so a log stays short."""

    def __init__(self, total: int, marks: int = 20, interval: float = 30.0) -> None:
        self.every = max(1, total // marks) if total else 1
        self.interval = interval
        self.last_step = -1
        self.last_time = float("-inf")

    def due(self, step: int, now: float) -> bool:
        """True when a line should be printed for ``step`` at time ``now`` (and records it)."""
        if step == self.last_step:
            return False
        crossed = self.last_step < 0 or step // self.every > self.last_step // self.every
        if crossed or now - self.last_time >= self.interval:
            self.last_step, self.last_time = step, now
            return True
        return False


def status_table(
    run_dir: Path,
    procs: ProcessGroup,
    evals: Sequence[Dict[str, Any]],
    started: float,
    progress: str | None = None,
) -> Any:
    """A rich ``Table``: each child's pid, state and log, with the progress line as caption."""
    from rich.table import Table

    table = Table(title=f"atropos-grpo-run  {run_dir}  ({time.time() - started:.0f}s)")
    for col in ("process", "pid", "state", "log"):
        table.add_column(col)
    for child in procs.children.values():
        rc = child.returncode()
        state = (
            "[green]running[/green]"
            if rc is None
            else ("done" if rc == 0 else f"[red]exit {rc}[/red]")
        )
        table.add_row(child.name, str(child.pid), state, str(child.log_path.relative_to(run_dir)))
    if progress is None:
        rows = read_metrics(run_dir / "metrics.jsonl")
        progress = progress_text(
            rows[-1]["step"] if rows else 0, 0, None, {}, rows[-1] if rows else None
        )
    caption = progress
    if evals:
        caption += "\nevals: " + ", ".join(
            f"{e['label']}@{e['step']}={e['score']:.2f}" for e in evals
        )
    table.caption = caption
    return table
