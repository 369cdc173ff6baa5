"""The launcher's live status view: one table of processes and the trainer's last step."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Sequence

from .processes import ProcessGroup
from .summary import read_metrics


def status_table(
    run_dir: Path, procs: ProcessGroup, evals: Sequence[Dict[str, Any]], started: float
) -> Any:
    """A rich ``Table``: each child's pid, state and log, with the last step as caption."""
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
    rows = read_metrics(run_dir / "metrics.jsonl")
    if rows:
        last = rows[-1]
        table.caption = (
            f"step {last['step']}  loss {last.get('train/loss', float('nan')):+.4f}  "
            f"mean score {last.get('train/mean_score', float('nan')):.3f}  "
            f"{last.get('train/tokens_per_second', 0):.0f} tok/s"
        )
    if evals:
        table.caption = (
            (table.caption or "")
            + "   evals: "
            + ", ".join(f"{e['label']}@{e['step']}={e['score']:.2f}" for e in evals)
        )
    return table
