"""Print evaluation metrics as a rich table."""

from __future__ import annotations

import io
from typing import Any, Mapping

from rich.console import Console
from rich.table import Table


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def build_metrics_table(
    task_name: str,
    metrics: Mapping[str, Any],
    start_time: float | None = None,
    end_time: float | None = None,
) -> Table:
    """A rich ``Table`` with one row per metric (sorted by name)."""
    title = task_name
    if start_time is not None and end_time is not None:
        title = f"{task_name} ({end_time - start_time:.1f}s)"
    table = Table(title=title)
    table.add_column("Metric", style="cyan")
    table.add_column("Value", justify="right", style="magenta")
    for key in sorted(metrics):
        table.add_row(str(key), _format_value(metrics[key]))
    return table


def display_metrics_table(
    task_name: str,
    metrics: Mapping[str, Any],
    start_time: float | None = None,
    end_time: float | None = None,
    console: Console | None = None,
) -> str:
    """Print the metrics table and return its plain-text rendering."""
    table = build_metrics_table(task_name, metrics, start_time, end_time)
    buffer = io.StringIO()
    Console(file=buffer, width=100, color_system=None).print(table)
    (console or Console()).print(table)
    return buffer.getvalue()


__all__ = ["build_metrics_table", "display_metrics_table"]
