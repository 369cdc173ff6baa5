"""The reasoning-gym generator child ends with its env process, also when it is busy (a
scorer or generator in a loop never reads its closed stdin): a real env in ``process`` mode,
its child spinning, killed with SIGTERM and with kill -9; the child must be gone.

The spin comes from a ``sitecustomize`` on the child's path that makes
``reasoning_gym.create_dataset`` loop in pure Python, in the generator child only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from atroposlib.testing.launch import fake_server_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402
from atroposlib.testing.processes import running_process  # noqa: E402
from atroposlib.utils.parent_death import PARENT_PID_ENV  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

SPIN = """
import os, sys
if "_rg_worker" in " ".join(sys.orig_argv) and os.environ.get("RG_SPIN_MARK"):
    import reasoning_gym

    def create_dataset(*args, **kwargs):
        with open(os.environ["RG_SPIN_MARK"], "w") as mark:
            mark.write(str(os.getpid()))
        while True:  # a generator that never returns
            pass

    reasoning_gym.create_dataset = create_dataset
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (it has ended; its new parent has yet to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_for(condition, what: str, tries: int = 600, pause: float = 0.05) -> None:
    for _ in range(tries):
        if condition():
            return
        time.sleep(pause)
    raise AssertionError(f"{what} (after {tries} polls)")


@pytest.fixture(scope="module")
def inference_url(tmp_path_factory):
    """A fake inference server (reachable; no completion is ever asked of it)."""
    port = free_port()
    with running_process(
        fake_server_cmd(port),
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=tmp_path_factory.mktemp("fake") / "fake.log",
    ):
        yield f"http://127.0.0.1:{port}/v1"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_a_busy_generator_child_ends_with_its_env(tmp_path, tiny_model_dir, inference_url, how):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SPIN)
    mark = tmp_path / "spinning.pid"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
        RG_SPIN_MARK=str(mark),
    )
    argv = [
        sys.executable,
        "-c",
        "from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv; ReasoningGymEnv.cli()",
        "process",
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.use_wandb",
        "false",
        "--env.data_path_to_save_groups",
        str(tmp_path / "out.jsonl"),
        "--env.tasks",
        "chain_sum",
        "--openai.base_url",
        inference_url,
        "--openai.model_name",
        "tiny",
    ]
    log = tmp_path / "env.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        _wait_for(
            lambda: mark.exists() and mark.read_text() or proc.poll() is not None,
            "the generator child never started spinning",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        child = int(mark.read_text())
        assert not _gone(child)
        proc.send_signal(how)
        proc.wait(timeout=30)
        _wait_for(lambda: _gone(child), f"the generator child {child} outlived its env")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mark.exists() and not _gone(int(mark.read_text())):
            os.kill(int(mark.read_text()), signal.SIGKILL)


def _spawn(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_a_forked_grandchild_ends_with_the_chain():
    """parent -> child (armed, with descendants) -> grandchild by os.fork; kill -9 the
    parent: the child and then the grandchild end."""
    parent_code = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=dict(__import__("os").environ, {PARENT_PID_ENV}=str(__import__("os").getpid())))
time.sleep(3600)
"""
    parent = _spawn(parent_code)
    try:
        line = parent.stdout.readline().split()  # "child grandchild"
        child, grandchild = int(line[0]), int(line[1])
        assert not _gone(child) and not _gone(grandchild)
        parent.kill()
        parent.wait(timeout=10)
        _wait_for(lambda: _gone(child), "the child outlived its parent")
        _wait_for(lambda: _gone(grandchild), "the grandchild outlived the child")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


CHILD = """
import os, sys, time
from atroposlib.utils.parent_death import descendants_die_with_parent
assert descendants_die_with_parent()
pid = os.fork()
if pid == 0:
    while True:
        time.sleep(1)
print(os.getpid(), pid, flush=True)
while True:
    pass
"""


def test_an_orphan_arming_the_signal_late_ends_at_once():
    """A child whose parent died before it asked for the signal ends instead of staying."""
    proc = _spawn(
        "from atroposlib.utils.parent_death import die_with_parent\n"
        "import signal\n"
        "die_with_parent(signal.SIGTERM, parent_pid=1)\n"  # never its parent here
        "print('still here')\n"
    )
    out, _ = proc.communicate(timeout=30)
    if sys.platform.startswith("linux"):
        assert proc.returncode == -signal.SIGTERM and "still here" not in out
    else:  # a documented no-op elsewhere
        assert proc.returncode == 0 and "still here" in out
