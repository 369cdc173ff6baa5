"""No process of an ``atropos-grpo-run`` outlives it.

Real processes throughout: the launcher starts run-api, atropos-serve-model, an
environment and ``torchrun`` with two trainer ranks (gloo on the CPU). The
environment is a small feeder that posts exactly one batch and then idles, so the
ranks are mid-training (step 1 done, rank 0 waiting for a batch, rank 1 inside a
collective) when the run is ended: by the environment exiting, by SIGTERM, or by
``kill -9`` of the launcher (and of torchrun with it). Afterwards the process table holds no process of the
run: every process carries a marker in its environment (inherited from the launcher),
so the check finds them all, whoever their parent is by then.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import List

import psutil
import pytest
import yaml

from tests.example_trainer.conftest import make_batch

ROOT = Path(__file__).resolve().parents[2]
MARK = "ATROPOS_TEST_RUN_MARK"

FEEDER = """
import json, pathlib, sys, time
import httpx

url = sys.argv[sys.argv.index("--env.rollout_server_url") + 1]
here = pathlib.Path(__file__).parent
groups = json.loads((here / "groups.json").read_text())
r = httpx.post(url + "/scored_data_list", json=groups, timeout=30)
r.raise_for_status()
while not (here / "exit").exists():
    time.sleep(0.1)
sys.exit(3)
"""


def _marked(mark: str) -> List[psutil.Process]:
    """Every live process whose environment carries ``mark`` (the process table, not a tree)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK) == mark:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _describe(procs: List[psutil.Process]) -> List[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def _ranks(procs: List[psutil.Process]) -> List[psutil.Process]:
    ranks = []
    for p in procs:
        try:
            # torchrun sets RANK for its workers (and what they start inherits it).
            if "RANK" in p.environ() and "example_trainer.grpo" in p.cmdline():
                ranks.append(p)
        except psutil.Error:
            continue
    return ranks


class Run:
    """One ``atropos-grpo-run --trainer-procs 2`` in ``tmp``, its processes marked."""

    def __init__(self, tmp: Path, tokenizer, model_dir: Path, mode: str = "http_reload") -> None:
        self.tmp = tmp
        self.mark = uuid.uuid4().hex
        feeder = tmp / "feeder.py"
        feeder.write_text(FEEDER)
        # One API batch (batch size 4 x 2 accumulation steps = 2 groups of 4): step 1 runs,
        # then the ranks wait for a batch that never comes.
        (tmp / "groups.json").write_text(json.dumps(make_batch(tokenizer, 2, 4)))
        cfg = {
            "trainer_procs": 2,
            "run_dir": str(tmp / "run"),
            "model": str(model_dir),
            "api_port": 0,
            "inference_port": 0,
            "envs": [str(feeder)],
            "weight_bridge_mode": mode,
            "trainer": {"training_steps": 50},
            "trainer_args": [
                "--batch-size",
                "4",
                "--gradient-accumulation-steps",
                "2",
                "--batch-poll-interval",
                "0.2",
                "--vllm-restart-interval",
                "100",
                "--checkpoint-interval",
                "0",
            ],
            "startup_timeout": 120,
            "cpu_threads": 1,
            "status_interval": 0.2,
        }
        (tmp / "run.yaml").write_text(yaml.safe_dump(cfg))
        self.log = (tmp / "launcher.log").open("wb")
        env = {
            **os.environ,
            MARK: self.mark,
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "example_trainer.run", "--config", str(tmp / "run.yaml")],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def logs(self) -> str:
        parts = [f"== launcher\n{(self.tmp / 'launcher.log').read_text(errors='replace')[-3000:]}"]
        for p in sorted((self.tmp / "run" / "logs").glob("*.log")):
            parts.append(f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def wait_mid_training(self, timeout: float = 240) -> List[psutil.Process]:
        """Wait for step 1 to be logged; returns the run's processes at that moment."""
        metrics = self.tmp / "run" / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.logs()
            if metrics.exists() and metrics.read_text().strip():
                procs = _marked(self.mark)
                assert len(_ranks(procs)) == 2, _describe(procs)
                return procs
            time.sleep(0.3)
        raise AssertionError("no training step within the timeout\n" + self.logs())

    def left_behind(self, timeout: float) -> List[str]:
        """The run's processes still alive after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            alive = _marked(self.mark)
            if not alive or time.monotonic() >= deadline:
                return _describe(alive)
            time.sleep(0.3)

    def cleanup(self) -> None:
        """Never leave this run's processes behind, even when an assertion failed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for p in _marked(self.mark):
            try:
                p.kill()
            except psutil.Error:
                pass
        self.log.close()


@pytest.fixture
def run_factory(tmp_path, tiny_tokenizer, tiny_model_dir):
    runs: List[Run] = []

    def start(mode: str = "http_reload") -> Run:
        run = Run(tmp_path, tiny_tokenizer, tiny_model_dir, mode)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.cleanup()


def test_environment_exit_ends_the_run_with_both_ranks(run_factory):
    run = run_factory()
    procs = run.wait_mid_training()
    assert len(procs) >= 6, _describe(procs)  # api, inference, env, torchrun, 2 ranks
    (run.tmp / "exit").touch()
    assert run.proc.wait(timeout=120) == 1, run.logs()
    # The launcher returns only after its whole tree is gone; a moment for the kernel.
    assert run.left_behind(timeout=5) == [], run.logs()
    assert "env exited with code 3" in (run.tmp / "launcher.log").read_text()


def test_sigterm_mid_training_stops_every_process(run_factory):
    run = run_factory()
    run.wait_mid_training()
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.proc.wait(timeout=120) == 130, run.logs()
    assert run.left_behind(timeout=5) == [], run.logs()


def test_kill_9_of_the_launcher_and_torchrun_leaves_no_process(run_factory):
    """Nobody is left to clean up: the launcher and torchrun both die by SIGKILL (as under
    an OOM killer or a scheduler killing the job), so every process must learn of its
    parent's death itself. Weight mode ``none``: rank 0 owns the inference server, a
    process below the ranks."""
    run = run_factory(mode="none")
    procs = run.wait_mid_training()
    ranks = {p.pid for p in _ranks(procs)}
    owned = [p for p in procs if p.ppid() in ranks]
    assert any("serve_model" in " ".join(p.cmdline()) for p in owned), _describe(procs)
    torchrun = [p for p in procs if "torch.distributed.run" in " ".join(p.cmdline())]
    assert len(torchrun) == 1, _describe(procs)
    os.kill(run.proc.pid, signal.SIGKILL)
    torchrun[0].kill()
    run.proc.wait(timeout=10)
    assert run.left_behind(timeout=90) == [], run.logs()
