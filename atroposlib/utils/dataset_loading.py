"""Load environment data from the Hugging Face hub or a local jsonl file, skipping bad rows.

Environments call :func:`load_rows` in ``setup()``. A local ``data_path`` (jsonl, one
JSON object per line, the same schema as the hub dataset) wins over the hub name, so
everything runs offline. :class:`SkipCounter` counts the rows an environment rejects,
by reason, and logs each reason once with an example.

Example::

    skips = SkipCounter("gsm8k")
    rows = load_rows("gsm8k", "main", "train", data_path=cfg.data_path, skips=skips)
    items = [r for r in rows if skips.require(r, "question", "answer")]
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping

logger = logging.getLogger(__name__)


class SkipCounter:
    """Counts skipped rows/items per reason; the first of each reason is logged as a warning."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.counts: Counter[str] = Counter()

    def skip(self, reason: str, detail: str = "") -> None:
        """Record one skipped row."""
        self.counts[reason] += 1
        log = logger.warning if self.counts[reason] == 1 else logger.debug
        log("%s: skipping a row (%s)%s", self.source, reason, f": {detail}" if detail else "")

    def require(self, row: Mapping[str, Any], *fields: str) -> bool:
        """True when every field is present and non-empty; otherwise the row is counted."""
        for name in fields:
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                self.skip(f"missing_{name}", repr(row)[:120])
                return False
        return True

    @property
    def total(self) -> int:
        """All skipped rows."""
        return sum(self.counts.values())

    def metrics(self, prefix: str = "train/data_rows_skipped") -> Dict[str, float]:
        """``{prefix: total, prefix/reason: n, ...}`` for W&B."""
        out: Dict[str, float] = {prefix: float(self.total)}
        out.update({f"{prefix}/{reason}": float(n) for reason, n in self.counts.items()})
        return out

    def summary(self) -> str:
        """A one-line description, e.g. ``"2 skipped (missing_answer=1, not_json=1)"``."""
        if not self.counts:
            return "0 skipped"
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"{self.total} skipped ({parts})"


def read_jsonl(path: str | Path, skips: SkipCounter | None = None) -> List[Dict[str, Any]]:
    """Rows of a jsonl file; blank lines are ignored, unparsable or non-object lines skipped.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
    """
    skips = skips or SkipCounter(str(path))
    rows: List[Dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                skips.skip("not_json", f"line {lineno}: {err}")
                continue
            if not isinstance(row, dict):
                skips.skip("not_an_object", f"line {lineno}")
                continue
            rows.append(row)
    return rows


def load_rows(
    dataset_name: str | None,
    dataset_config: str | None = None,
    split: str = "train",
    data_path: str | None = None,
    skips: SkipCounter | None = None,
    shuffle_seed: int | None = None,
) -> List[Dict[str, Any]]:
    """Rows from ``data_path`` (local jsonl) or ``load_dataset(dataset_name, dataset_config, split=split)``.

    With ``shuffle_seed`` the rows are shuffled deterministically (the hub path uses
    ``Dataset.shuffle(seed=...)`` as the original environments do).

    Raises:
        ValueError: when neither a path nor a dataset name is given.
    """
    if data_path:
        rows = read_jsonl(data_path, skips)
        if shuffle_seed is not None:
            import random

            random.Random(shuffle_seed).shuffle(rows)
        return rows
    if not dataset_name:
        raise ValueError("no data: set a dataset name or a local data_path")
    from datasets import load_dataset

    dataset = load_dataset(dataset_name, dataset_config, split=split)
    if shuffle_seed is not None:
        dataset = dataset.shuffle(seed=shuffle_seed)
    return [dict(row) for row in dataset]


__all__ = ["SkipCounter", "load_rows", "read_jsonl"]
