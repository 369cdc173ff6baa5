"""What the demo benchmarks share: one run's record, running a demo and reading its summary.

``async_demo.py`` (the default demo under the async-RL knobs) and ``vllm_demo.py`` (the
demo with vLLM serving) both run ``atropos-grpo-run`` several times, read each run's
``summary.json`` (held-out greedy accuracy before → after, after = mean of the last three
evals) and hold it to the same learning bar: after >= 2x before and >= +0.3 (``min_gain``; the
reasoning-gym demo's is +0.2), status ok, within a wall-time limit that each script sets
(``DemoRun.MAX_WALL_S``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Mapping, Sequence, Tuple


@dataclass
class DemoRun:
    """One demo run's outcome: its summary's accuracies, its status and its wall time."""

    MAX_WALL_S: ClassVar[float] = 600.0

    run_dir: str
    status: str
    before: float | None
    after: float | None
    wall_s: float
    min_gain: float = 0.3

    @property
    def gain(self) -> float | None:
        """after - before (None when either is missing)."""
        return None if self.before is None or self.after is None else self.after - self.before

    @property
    def ratio(self) -> float | None:
        """after / before (None when either is missing or before is 0)."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before

    @property
    def learned(self) -> bool:
        """after >= 2x before and >= ``min_gain`` above it (the learning half of the bar)."""
        gain = self.gain
        return gain is not None and gain >= self.min_gain and self.after >= 2 * self.before  # type: ignore[operator]

    @property
    def meets_bar(self) -> bool:
        """Learned, status ok and within ``MAX_WALL_S``."""
        return self.status == "ok" and self.learned and self.wall_s <= self.MAX_WALL_S


class LoadSampler:
    """Samples the 1-minute load average in a background thread until stopped."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.samples: List[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


@dataclass
class Finished:
    """A finished demo process: exit code, wall time, its summary (None if it wrote none)
    and the load samples taken while it ran (empty unless asked for)."""

    rc: int
    wall_s: float
    summary: Dict[str, Any] | None
    load: List[float]


def run_demo(
    cmd: Sequence[str],
    run_dir: Path,
    log: Path,
    cwd: Path,
    env: Mapping[str, str],
    load_every: float | None = None,
) -> Finished:
    """Run one demo command (its output to ``log``) and read the ``summary.json`` it wrote
    under ``run_dir``; with ``load_every``, sample the load average meanwhile."""
    env = {**os.environ, **env}
    sampler = LoadSampler(load_every) if load_every is not None else None
    t0 = time.time()
    with log.open("w") as f, sampler if sampler is not None else contextlib.nullcontext():
        rc = subprocess.call(list(cmd), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    path = run_dir / "summary.json"  # run_dir is a link to the run's own directory
    summary = json.loads(path.read_text()) if path.exists() else None
    return Finished(rc, wall, summary, sampler.samples if sampler is not None else [])


def record_fields(summary: Mapping[str, Any]) -> Dict[str, Any]:
    """The :class:`DemoRun` fields a ``summary.json`` gives (all but the wall time)."""
    return {
        "run_dir": str(summary.get("run_dir", "")),
        "status": str(summary.get("status", "missing")),
        "before": summary.get("eval_before"),
        "after": summary.get("eval_after"),
    }


def fmt(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted, or a dash when it is missing."""
    return "—" if x is None else format(x, spec)


def aggregate(runs: Sequence[DemoRun], keys: Sequence[str]) -> Dict[str, Any]:
    """How many runs meet the bar, and the median/min/max of each attribute in ``keys``
    over the runs that have it."""
    out: Dict[str, Any] = {"runs": len(runs), "meet_bar": sum(r.meets_bar for r in runs)}
    for key in keys:
        values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
        if values:
            out[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    return out


def spread(values: Sequence[float], spec: str) -> str:
    """``median (min to max)`` of ``values`` in format ``spec``; a dash when there are none."""
    if not values:
        return "—"
    med = statistics.median(values)
    return f"{format(med, spec)} ({format(min(values), spec)} to {format(max(values), spec)})"


def summary_line(runs: Sequence[DemoRun], keys: Sequence[Tuple[str, str]]) -> str:
    """ "N of M runs meet the bar; KEY median X (MIN to MAX); ..." for each (key, format)
    that some run has."""
    parts = [f"{sum(r.meets_bar for r in runs)} of {len(runs)} runs meet the bar"]
    for key, spec in keys:
        values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
        if values:
            parts.append(f"{key} median {spread(values, spec)}")
    return "; ".join(parts)
