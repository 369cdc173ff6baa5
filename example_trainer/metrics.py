"""Where a run's metrics go: ``metrics.jsonl``, Weights & Biases and the progress bar.

:class:`MetricsWriter` appends one JSON line per step (the file ``atropos-grpo-run``'s
status view and summary read) and mirrors it to W&B when ``--use-wandb``;
:class:`Progress` is the console's rich bar. Rank 0 writes; the loop
(:mod:`example_trainer.trainers`) decides what a step's metrics are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict

logger = logging.getLogger(__name__)


def start_wandb(config: Any) -> Any:
    """Start a W&B run for ``config`` (project, group, the config's values) and return the
    ``wandb`` module, or None when ``use_wandb`` is off."""
    if not getattr(config, "use_wandb", False):
        return None
    import wandb

    wandb.init(
        project=getattr(config, "wandb_project", None),
        group=getattr(config, "wandb_group", None),
        config=config.model_dump() if hasattr(config, "model_dump") else dict(vars(config)),
    )
    return wandb


class MetricsWriter:
    """Append one JSON line per step to ``metrics.jsonl`` and, optionally, to W&B."""

    def __init__(self, config: Any) -> None:
        self.path = Path(config.metrics_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb = start_wandb(config)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        """Record ``metrics`` for ``step``."""
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def summary(self, values: Dict[str, float]) -> None:
        """Final summary values (``benchmark/*``)."""
        if self.wandb is not None:
            self.wandb.run.summary.update(values)

    def close(self) -> None:
        """Finish the W&B run."""
        if self.wandb is not None:
            self.wandb.finish()


class Progress:
    """A rich progress bar showing step, loss, mean score and tokens/s (or log lines)."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
            )
            self._task = self._progress.add_task(
                "train", total=total, completed=completed, info="waiting for data"
            )
            self._progress.start()

    def update(self, step: int, info: str) -> None:
        """Move the bar to ``step`` with a status line."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            logger.info("step %d %s", step, info)

    def close(self) -> None:
        """Stop rendering."""
        if self._progress is not None:
            self._progress.stop()
