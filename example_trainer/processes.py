"""Child processes of the one-command launcher, and their clean shutdown.

Every child runs in its own process group (so a signal reaches its own children
too), writes to its own log file, and is told by the kernel to exit if the
launcher dies without cleaning up (``PR_SET_PDEATHSIG`` on Linux), so even
``kill -9`` of the launcher leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

import httpx

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    """A named child process with its log file."""

    name: str
    cmd: List[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def pid(self) -> int | None:
        """Process id, once started."""
        return self.proc.pid if self.proc else None

    def returncode(self) -> int | None:
        """Exit status, or None while running."""
        return self.proc.poll() if self.proc else None

    def log_tail(self, n_chars: int = 2000) -> str:
        """The end of the child's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


class ProcessGroup:
    """Starts children and guarantees they are all gone after :meth:`stop_all`."""

    def __init__(self, run_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.children: Dict[str, Child] = {}

    def start(
        self, name: str, cmd: Sequence[str], extra_env: Mapping[str, str] | None = None
    ) -> Child:
        """Start ``cmd`` as child ``name`` (log: ``run_dir/logs/{name}.log``)."""
        child = Child(name=name, cmd=list(cmd), log_path=self.logs / f"{name}.log")
        with child.log_path.open("ab") as out:
            out.write(("$ " + " ".join(child.cmd) + "\n").encode())
            out.flush()
            child.proc = subprocess.Popen(
                child.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(extra_env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.children[name] = child
        logger.info("started %s (pid %d): %s", name, child.pid, " ".join(child.cmd))
        return child

    def wait_healthy(self, name: str, url: str, timeout: float) -> None:
        """Wait until ``url`` answers 200, failing early if the child exits."""
        child = self.children[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = child.returncode()
            if rc is not None:
                raise RuntimeError(
                    f"{name} exited with code {rc} during startup:\n{child.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(
            f"{name} not healthy at {url} within {timeout:.0f}s:\n{child.log_tail()}"
        )

    def failed(self, ignore: Sequence[str] = ()) -> Child | None:
        """The first child (not in ``ignore``) that has exited, if any."""
        for child in self.children.values():
            if child.name not in ignore and child.returncode() is not None:
                return child
        return None

    def stop(self, name: str, timeout: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL after ``timeout`` s."""
        child = self.children.get(name)
        if child is None or child.proc is None:
            return
        proc = child.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing", name, timeout)
        # The leader may be gone while members of its group linger: always sweep the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop every child, newest first."""
        for name in reversed(list(self.children)):
            self.stop(name, timeout)
