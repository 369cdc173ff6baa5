"""Start real server processes for integration tests and benchmarks, and stop them.

Every integration test in this repository talks to real processes on loopback.
These helpers start a command in its own process group, wait until an HTTP health
URL answers, and make sure the process (and its children) are gone afterwards.
Ports come from :mod:`atroposlib.testing.ports`, command lines from
:mod:`atroposlib.testing.launch`.

Example::

    port = free_port()
    with running_process(run_api_cmd(port), health_url=f"http://127.0.0.1:{port}/health"):
        ...
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import httpx

from atroposlib.utils.processes import stop_process_group

__all__ = ["PYTHON", "running_process", "start_process", "stop_process", "wait_http"]

PYTHON = sys.executable
"""The interpreter running the tests: every child process uses the same environment."""


def wait_http(
    url: str,
    timeout: float = 30.0,
    proc: subprocess.Popen | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Poll ``url`` until it answers with a status below 500, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=2.0, headers=dict(headers or {}))
            if r.status_code < 500:
                return
        except httpx.HTTPError as e:  # not up yet
            last_error = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s (last error: {last_error})")


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate ``proc`` and its process group; kill it if it does not exit in time."""
    stop_process_group(proc, timeout)


def start_process(
    cmd: Sequence[str],
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, output to ``log_path`` (or discarded)."""
    full_env = dict(os.environ)
    full_env.setdefault("WANDB_MODE", "disabled")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        if log_path:
            out.close()


@contextlib.contextmanager
def running_process(
    cmd: Sequence[str],
    health_url: str | None = None,
    timeout: float = 60.0,
    log_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    health_headers: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` for the duration of the block; wait for ``health_url`` first."""
    proc = start_process(cmd, log_path=log_path, env=env, cwd=cwd)
    try:
        if health_url:
            try:
                wait_http(health_url, timeout=timeout, proc=proc, headers=health_headers)
            except Exception:
                if log_path and Path(log_path).exists():
                    sys.stderr.write(Path(log_path).read_text(errors="replace")[-4000:])
                raise
        yield proc
    finally:
        stop_process(proc)
