"""End to end with real processes: run-api, atropos-serve-model, the arithmetic env and the trainer.

Also the launcher's process hygiene: killing it leaves no child behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]

TRAINER_ARGS = [
    "--batch-size",
    "16",
    "--gradient-accumulation-steps",
    "1",
    "--lr",
    "1e-3",
    "--optimizer",
    "adamw",
    "--vllm-restart-interval",
    "1",
    "--batch-poll-interval",
    "0.2",
    "--pad-to-multiple",
    "8",
    "--checkpoint-interval",
    "2",
]


def _write_config(
    tmp_path: Path, steps: int, with_eval: bool, trainer_procs: int = 1, extra_args=()
) -> Path:
    cfg = {
        "trainer_procs": trainer_procs,
        "run_dir": str(tmp_path / "run"),
        "model": "tiny",
        "api_port": 0,
        "inference_port": 0,
        "envs": ["environments/arithmetic_server.py"],
        # A random-init model rarely scores; keep all-equal groups so batches form quickly.
        "env_args": [
            "--env.ensure_scores_are_not_same",
            "false",
            "--env.max_batches_offpolicy",
            "2",
        ],
        "trainer": {"training_steps": steps},
        "trainer_args": [*TRAINER_ARGS, *extra_args],
        "startup_timeout": 120,
        "cpu_threads": 1,
        "max_wall_time": 240,
    }
    if with_eval:
        cfg["eval"] = {"function": "environments/arithmetic_server.py:greedy_eval"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_one_command_run_trains_syncs_weights_and_writes_summary(tmp_path):
    """With two trainer processes (torchrun, FSDP2 on gloo) and a KL reference: rank 0 syncs
    and logs. Micro-batches of 4 (API batches of 16): the ranks' micro-batch counts may
    differ, which aborted KL runs before."""
    kl = ["--kl-coef", "0.05", "--batch-size", "4", "--gradient-accumulation-steps", "4"]
    config = _write_config(tmp_path, steps=3, with_eval=True, trainer_procs=2, extra_args=kl)
    proc = subprocess.run(
        [sys.executable, "-m", "example_trainer.run", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    run_dir = tmp_path / "run"
    logs = "\n".join(
        f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}"
        for p in (run_dir / "logs").glob("*.log")
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:] + logs

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert all(math.isfinite(r["train/kl"]) for r in rows)
    # Every step pushed weights over HTTP and the server's version advanced each time.
    versions = [r["train/weights_version"] for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["inference_weights_version"] == versions[-1] >= 3
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert (run_dir / "curve.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "step_2" / "trainer_state.pt").exists()
    assert "rank 1 of 2" in (run_dir / "logs" / "trainer.log").read_text()
    assert (run_dir / "checkpoints" / "final_model" / "config.json").exists()
    for name in ("api", "inference", "env", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").exists()


def _descendants_when_ready(
    runner: psutil.Process, names: int, timeout: float
) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = runner.children(recursive=True)
        if len(kids) >= names:
            return kids
        time.sleep(0.3)
    raise AssertionError(f"runner started only {len(runner.children(recursive=True))} children")


@pytest.mark.parametrize("sig, n_children", [(signal.SIGKILL, 4)])
def test_killing_the_runner_leaves_no_child_processes(tmp_path, sig, n_children):
    """SIGKILL of a one-process run (no cleanup possible: the kernel's parent-death signal).
    SIGTERM, and SIGKILL of the launcher with torchrun, are test_supervision.py's, mid-training
    with two ranks."""
    config = _write_config(tmp_path, steps=1000, with_eval=False)
    runner = subprocess.Popen(
        [sys.executable, "-m", "example_trainer.run", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kids: list[psutil.Process] = []
    try:
        kids = _descendants_when_ready(psutil.Process(runner.pid), n_children, timeout=90)
        os.kill(runner.pid, sig)
        runner.wait(timeout=30)
        _, alive = psutil.wait_procs(kids, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
        for p in kids:  # never leave our own processes behind, even when the assertion failed
            if p.is_running():
                p.kill()


def test_a_run_at_max_wall_time_ends_with_a_final_model_and_says_why(tmp_path):
    """The whole stack with more steps than the limit allows: the trainer ends after its
    step at max_wall_time, saves final_model, the run exits 124 and the summary names the
    limit as the reason (the first run's one-time work, the tiny model's build, not counted)."""
    config = _write_config(tmp_path, steps=100_000, with_eval=False)
    cfg = yaml.safe_load(config.read_text())
    cfg["max_wall_time"] = 75
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "example_trainer.run", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    run_dir = tmp_path / "run"
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0 < rows[-1]["step"] < 100_000
    assert (run_dir / "checkpoints" / "final_model" / "config.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped at max_wall_time" and summary["exit_status"] == 124
    assert summary["stop_reason"].startswith("max_wall_time (75s, one-time work not counted)")
    assert summary["final_model"].endswith("final_model")
    assert "stopped because: max_wall_time" in (run_dir / "summary.md").read_text()
    assert "run stopped at max_wall_time" in proc.stdout
