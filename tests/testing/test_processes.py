"""``atroposlib.testing.processes``: start, wait until ready, stop (with the children)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process, start_process, stop_process, wait_http

# A parent that starts a child sleeping forever and prints the child's pid.
PARENT = (
    "import subprocess, sys, time;"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    "print(c.pid, flush=True); time.sleep(600)"
)


def _server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]


def test_running_process_waits_for_health_and_stops_the_server():
    port = free_port()
    with running_process(_server(port), health_url=f"http://127.0.0.1:{port}/") as proc:
        assert proc.poll() is None
        wait_http(f"http://127.0.0.1:{port}/", timeout=5)  # answering now, not later
    assert proc.poll() is not None


def test_stop_process_ends_the_children_too(tmp_path):
    log = tmp_path / "parent.log"
    proc = start_process([sys.executable, "-c", PARENT], log_path=log)
    try:
        deadline = time.monotonic() + 60  # a hang guard only: the pid is printed at once
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = psutil.Process(int(log.read_text()))
        assert child.is_running()
    finally:
        stop_process(proc)
    child.wait(timeout=30)
    assert not child.is_running()


def test_a_process_that_exits_before_answering_is_reported(tmp_path):
    proc = start_process([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="code 3"):
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout=60, proc=proc)


def test_wait_http_gives_up_on_a_silent_port():
    with pytest.raises(TimeoutError):
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout=0.2)


def test_the_log_receives_the_output_and_the_environment_is_passed(tmp_path):
    log = tmp_path / "out.log"
    proc = start_process(
        [sys.executable, "-c", "import os; print(os.environ['PROBE'])"],
        log_path=log,
        env={"PROBE": "seen"},
    )
    assert proc.wait(timeout=60) == 0
    assert log.read_text().split() == ["seen"]
