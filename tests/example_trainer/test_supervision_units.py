"""The pieces behind "nothing outlives a run", each with real processes but no training.

- a trainer process asked to stop exits even when its main thread cannot run Python
  (stuck in a C call, like a gloo collective) or its cleanup hangs;
- a process whose parent is killed with SIGKILL stops by itself;
- the launcher's stop reaches descendants that left its child's session (torchrun's
  ranks do) and that ignore SIGTERM;
- the trainer's batch wait stops when asked and gives up on an API that stays gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from atroposlib.testing.ports import free_port
from example_trainer import api
from example_trainer.launch.processes import ProcessGroup

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def _gone(pid: int, timeout: float) -> bool:
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    _, alive = psutil.wait_procs([proc], timeout=timeout)
    return not alive


def test_a_process_whose_main_thread_is_stuck_in_c_exits_after_sigterm():
    # SIGTERM blocked in the main thread: the kernel hands it to another thread, and the
    # Python handler cannot run while the main thread sleeps, as in a gloo collective.
    proc = _python(
        """
        import signal, time
        from example_trainer.launch import supervision
        supervision.install(grace=0.5, watch_parent=False)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_a_process_whose_cleanup_hangs_still_exits_and_takes_its_children():
    proc = _python(
        """
        import subprocess, sys, time
        from example_trainer.launch import supervision
        supervision.install(grace=0.5, watch_parent=False)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        ready = False
        while True:
            try:
                if not ready:  # announced inside the try, so the signal always lands there
                    ready = True
                    print(child.pid, flush=True)
                time.sleep(600)
            except SystemExit:
                pass  # a cleanup that never finishes
        """
    )
    try:
        child = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert _gone(child, timeout=30)
    finally:
        proc.kill()
        proc.wait()


def test_a_supervised_process_stops_when_its_parent_is_killed():
    parent = _python(
        """
        import os, subprocess, sys, time
        code = ("from example_trainer.launch import supervision; supervision.install(grace=5); "
                "print('ready', flush=True); import time; time.sleep(600)")
        env = {**os.environ, "ATROPOS_DIE_WITH_PARENT": "1"}
        child = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "ready"  # the child's own line
        parent.kill()
        parent.wait()
        assert _gone(child, timeout=60)
    finally:
        if not _gone(child, timeout=0):
            os.kill(child, signal.SIGKILL)


def test_stopping_a_child_reaches_descendants_in_other_sessions(tmp_path):
    group = ProcessGroup(tmp_path)
    pidfile = tmp_path / "grandchild.pid"
    grandchild = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    )
    code = (
        "import subprocess, sys, time, pathlib\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], start_new_session=True)\n"
        f"pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    group.start("parent", [sys.executable, "-c", code])
    for _ in range(600):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    try:
        group.stop("parent", timeout=1.0)
        assert _gone(pid, timeout=10)
    finally:
        if not _gone(pid, timeout=0):
            os.kill(pid, signal.SIGKILL)


def test_batch_wait_stops_when_asked():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(api.AtroposAPIError, match="stopped"):
        api.wait_for_batch(url, poll_interval=0.01, should_stop=lambda: True)


def test_batch_wait_gives_up_on_an_api_that_stays_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(api.AtroposAPIError, match="unreachable"):
        api.wait_for_batch(url, poll_interval=0.01, unreachable_timeout=0.0)
