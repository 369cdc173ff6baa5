"""Per-file test times and the default tier's wall-clock budget (a pytest plugin).

Every session sums each test file's time (setup + call + teardown of its tests), writes the
totals, slowest first, to ``--file-times`` (``.cache/test-times.json`` by default) and prints
the slowest files at the end. With ``--budget`` (``make test`` passes it) a session whose wall
time passes the budget fails, naming its slowest files. The budget is the ini option
``time_budget_s`` (pyproject.toml), or ``ATROPOS_TEST_BUDGET_S`` when set (to raise it on a
slow machine).

Under pytest-xdist the workers' reports reach the controller, which alone writes and judges.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

BUDGET_ENV = "ATROPOS_TEST_BUDGET_S"
DEFAULT_BUDGET_S = 480.0
SHOWN = 15  # slowest files printed at the end, and named when the budget is passed


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("timing", "per-file test times and the time budget")
    group.addoption(
        "--file-times",
        default=".cache/test-times.json",
        help="where to write each test file's total time as JSON ('' to skip)",
    )
    group.addoption(
        "--budget",
        action="store_true",
        help=f"fail the session when its wall time passes time_budget_s (or ${BUDGET_ENV})",
    )
    parser.addini(
        "time_budget_s",
        help=f"the default tier's wall-clock budget in seconds ({DEFAULT_BUDGET_S:.0f})",
        default=str(DEFAULT_BUDGET_S),
    )


def budget_seconds(config: pytest.Config) -> float:
    """The budget: ``$ATROPOS_TEST_BUDGET_S`` when set, else the ini's ``time_budget_s``."""
    raw = os.environ.get(BUDGET_ENV) or config.getini("time_budget_s")
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise pytest.UsageError(f"{BUDGET_ENV} / time_budget_s must be positive seconds: {raw!r}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its reports go to the controller
    budget = budget_seconds(config) if config.getoption("budget") else None
    config.pluginmanager.register(FileTimes(config, budget), "atropos-file-times")


class FileTimes:
    """Sums seconds per test file; writes them, prints the slowest, judges the budget."""

    def __init__(self, config: pytest.Config, budget: float | None) -> None:
        self.config = config
        self.budget = budget
        self.seconds: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.started = time.monotonic()
        self.wall_s = 0.0
        self.over_budget: str | None = None

    def slowest(self) -> list[tuple[str, float]]:
        return sorted(self.seconds.items(), key=lambda item: (-item[1], item[0]))

    def pytest_sessionstart(self) -> None:
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.seconds[path] += report.duration
        if report.when == "call":
            self.tests[path] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.wall_s = time.monotonic() - self.started
        self._write()
        if self.budget is not None and self.wall_s > self.budget:
            slowest = "\n".join(
                f"  {seconds:8.1f}s  {path}" for path, seconds in self.slowest()[:SHOWN]
            )
            self.over_budget = (
                f"the session took {self.wall_s:.0f}s, over its budget of {self.budget:.0f}s "
                f"(time_budget_s in pyproject.toml; ${BUDGET_ENV} raises it on a slow "
                f"machine). Make these files faster or mark their heavy tests tier2:\n{slowest}"
            )
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _write(self) -> None:
        target = self.config.getoption("file_times")
        if not target or not self.seconds:
            return
        path = Path(target)
        if not path.is_absolute():
            path = self.config.rootpath / path
        files = [
            {"path": name, "seconds": round(seconds, 2), "tests": self.tests[name]}
            for name, seconds in self.slowest()
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"wall_s": round(self.wall_s, 2), "files": files}, indent=1) + "\n",
            encoding="utf-8",
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.seconds:
            terminalreporter.write_sep("=", f"slowest {SHOWN} test files (setup+call+teardown)")
            for path, seconds in self.slowest()[:SHOWN]:
                terminalreporter.write_line(f"{seconds:8.1f}s {self.tests[path]:5d} tests  {path}")
        if self.over_budget is not None:
            terminalreporter.write_sep("=", "time budget exceeded", red=True)
            terminalreporter.write_line(self.over_budget)
