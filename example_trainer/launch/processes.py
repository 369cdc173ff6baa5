"""Child processes of the one-command launcher, and their clean shutdown.

Every child runs in its own process group (so a signal reaches its own children
too), writes to its own log file, and is told by the kernel to exit if the
launcher dies without cleaning up (``PR_SET_PDEATHSIG`` on Linux), so even
``kill -9`` of the launcher leaves no orphans. Processes that leave their parent's
group (``torchrun`` starts each rank in a session of its own) are found through
``/proc`` and stopped too, and trainer ranks watch for their parent's death
themselves (:mod:`example_trainer.launch.supervision`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Set

import httpx

from . import supervision

logger = logging.getLogger(__name__)

# torchrun gives its ranks this long between SIGTERM and SIGKILL; the launcher waits longer
# for the trainer, so torchrun's own shutdown is never cut short.
TORCHRUN_GRACE = 30.0
STOP_TIMEOUT = 10.0
TRAINER_STOP_TIMEOUT = TORCHRUN_GRACE + 10.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    supervision.die_with_parent()


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
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            supervision.DIE_WITH_PARENT_ENV: "1",
            **(env or {}),
        }
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

    def stop(self, name: str, timeout: float | None = None) -> None:
        """Stop one child and everything it started (see :meth:`stop_many`)."""
        self.stop_many([name], timeout)

    def stop_all(self, timeout: float | None = None) -> None:
        """Stop every child and everything they started, all at once."""
        self.stop_many(list(reversed(list(self.children))), timeout)

    def stop_many(self, names: Sequence[str], timeout: float | None = None) -> None:
        """SIGTERM each child's process group; SIGKILL what is left after its grace period.

        Every descendant seen (also those in sessions of their own, such as torchrun's
        ranks) must be gone before this returns: what outlives the grace period is
        killed. The trainer's grace (:data:`TRAINER_STOP_TIMEOUT`) is longer than
        torchrun's own; other children get :data:`STOP_TIMEOUT` (or ``timeout``).
        """
        start = time.monotonic()
        procs: Dict[str, subprocess.Popen] = {}
        tree: Dict[str, Set[int]] = {}
        for name in names:
            child = self.children.get(name)
            if child is None or child.proc is None:
                continue
            procs[name] = child.proc
            # Listed before signalling: a rank whose torchrun exits is no longer below it.
            tree[name] = set(supervision.descendants(child.proc.pid))
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        for name, proc in procs.items():
            grace = timeout
            if grace is None:
                grace = TRAINER_STOP_TIMEOUT if name == "trainer" else STOP_TIMEOUT
            deadline = start + grace
            while time.monotonic() < deadline:
                tree[name] |= set(supervision.descendants(proc.pid))
                if proc.poll() is not None and not any(supervision.alive(p) for p in tree[name]):
                    break
                time.sleep(0.1)
            else:
                logger.warning("%s did not stop in %.0fs; killing", name, grace)
            self._kill(name, proc, tree[name])

    @staticmethod
    def _kill(name: str, proc: subprocess.Popen, tree: Set[int]) -> None:
        # The leader may be gone while members of its group linger: always sweep the group,
        # then whatever descendant left it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in tree | set(supervision.descendants(proc.pid)):
            if supervision.alive(pid):
                logger.warning("killing pid %d left behind by %s", pid, name)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT)
        for pid in tree:
            supervision.reap(pid)
