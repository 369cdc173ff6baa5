"""Files an environment writes: group jsonl dumps, eval results, env checkpoints (docs/design.md, "Files and metrics")."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List

logger = logging.getLogger(__name__)


def unique_path(path: str | Path) -> Path:
    """``path`` if it does not exist, else the first free ``<stem>_1``, ``<stem>_2``, ..."""
    path = Path(path)
    if not path.exists():
        return path
    n = 1
    while True:
        candidate = path.with_name(f"{path.stem}_{n}{path.suffix}")
        if not candidate.exists():
            return candidate
        n += 1


class JsonlGroupWriter:
    """Appends one JSON object per line; parent dirs are created, an existing file is kept.

    The file is flushed after every line so a crash loses nothing already written.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = unique_path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w", encoding="utf-8")
        self.lines = 0

    def write(self, obj: Any) -> None:
        """Write ``obj`` as one line; a value JSON cannot represent raises ``TypeError``.

        Nothing is turned into its ``str()``: a training file must hold the data itself.
        """
        self._fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._fh.flush()
        self.lines += 1

    def close(self) -> None:
        """Close the file."""
        if not self._fh.closed:
            self._fh.close()


def eval_metrics_document(
    metrics: Dict[str, Any],
    task_name: str,
    model_name: str | None,
    total_seconds: float,
    generation_parameters: Dict[str, Any],
) -> Dict[str, Any]:
    """The ``metrics.json`` document of ``evaluate_log`` (lighteval-like layout)."""
    return {
        "config_general": {
            "model_name": model_name,
            "total_evaluation_time_seconds": str(total_seconds),
            "generation_parameters": generation_parameters,
        },
        "results": {f"atropos|{task_name}|0": metrics, "all": metrics},
    }


def write_eval_results(
    directory: str | Path, document: Dict[str, Any], samples: List[Dict[str, Any]] | None
) -> Path:
    """Write ``metrics.json`` (and ``samples.jsonl`` when samples are given) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    metrics_path = directory / "metrics.json"
    metrics_path.write_text(json.dumps(document, indent=2, default=str))
    if samples:
        with open(directory / "samples.jsonl", "w", encoding="utf-8") as fh:
            for sample in samples:
                fh.write(json.dumps(sample, ensure_ascii=False, default=str) + "\n")
    return metrics_path


def checkpoint_path(checkpoint_dir: str | Path, wandb_prepend: str | None, step: int) -> Path:
    """``{checkpoint_dir}/env_checkpoints/{wandb_prepend}/step-{step}.json``."""
    return Path(checkpoint_dir) / "env_checkpoints" / str(wandb_prepend) / f"step-{step}.json"


def latest_checkpoint(
    checkpoint_dir: str | Path, wandb_prepend: str | None, step: int
) -> Path | None:
    """The checkpoint for ``step``, else the newest one at or below it, else None."""
    exact = checkpoint_path(checkpoint_dir, wandb_prepend, step)
    if exact.exists():
        return exact
    folder = exact.parent
    if not folder.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for candidate in folder.glob("step-*.json"):
        try:
            n = int(candidate.stem.split("-", 1)[1])
        except ValueError:
            continue
        if n <= step and (best is None or n > best[0]):
            best = (n, candidate)
    return best[1] if best else None
