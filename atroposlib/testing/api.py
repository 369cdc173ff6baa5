"""Run ``run-api`` as a real process, written once for the tests and benchmarks that need one.

:func:`running_api` starts ``python -m atroposlib.cli.run_api`` with the given flags on a
free port (another one when that port is taken before run-api binds it), waits for
``/health`` and stops the process when the block ends. The test suite's shared servers
(``rollout_api`` in ``tests/conftest.py``, the tools' ``keyed_api``) are built on it.

Example::

    with running_api(tmp_path / "api.log", "--persist", str(tmp_path / "api.db")) as api:
        httpx.post(f"{api.url}/register", json=registration)
"""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import httpx

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port, start_on_free_port
from atroposlib.testing.processes import stop_process

__all__ = ["RunningApi", "running_api"]


@dataclass(frozen=True)
class RunningApi:
    """A started run-api process: its base URL (loopback), port, process and log file."""

    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def reset(self, headers: Mapping[str, str] | None = None) -> None:
        """Forget queue, envs and registration (``POST /reset_data``), as a fresh start would."""
        answer = httpx.post(f"{self.url}/reset_data", headers=dict(headers or {}), timeout=10)
        answer.raise_for_status()


@contextlib.contextmanager
def running_api(
    log: Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    health_headers: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> Iterator[RunningApi]:
    """run-api with ``flags`` for the duration of the block, its output in the file ``log``.

    ``port`` fixes the port (no retry on another one); by default a free one is picked.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, bound = start_on_free_port(
        lambda p: run_api_cmd(p, "--log-level", "warning", *flags),
        log_path=log,
        env=env,
        timeout=timeout,
        attempts=1 if port else 5,
        pick_port=(lambda: port) if port else free_port,
        health_headers=health_headers,
    )
    try:
        yield RunningApi(f"http://127.0.0.1:{bound}", bound, proc, log)
    finally:
        stop_process(proc)
