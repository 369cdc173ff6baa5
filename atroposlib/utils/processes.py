"""Stopping a child process together with everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["stop_process_group"]


def stop_process_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it if ``proc`` has not exited within ``timeout`` s.

    ``proc`` must lead its own group (``start_new_session=True``), so that servers it forked
    (uvicorn workers, torchrun ranks) end with it instead of outliving the run.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
