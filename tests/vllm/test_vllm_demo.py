"""``atropos-grpo-run`` with vLLM's own server as the inference process, end to end.

A shortened ``example_trainer/configs/demo_cpu_vllm.yaml`` (no warm-up, 5 steps, small
groups): the runner starts vLLM from the vLLM venv (health-gated), run-api, the arithmetic
environment and the trainer; every step's weights are reloaded into vLLM in place and its
weight version advances with the step; the environment's groups are trained on; and when the
run ends no process of it is left. Starts a vLLM of its own (the runner owns it), so it is in
the ``slow`` tier as well.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu_vllm.yaml"

pytestmark = pytest.mark.slow


def _short_config(tmp_path: Path, vllm_python: str) -> Path:
    cfg = yaml.safe_load(DEMO.read_text())
    cfg.pop("warmup")
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["group_size"] = 4
    # A random-init model rarely scores: keep all-equal groups so batches form quickly.
    cfg["env_args"] = [
        "--env.ensure_scores_are_not_same",
        "false",
        # At most one batch ahead: the later batches are sampled from reloaded weights.
        "--env.max_batches_offpolicy",
        "1",
    ]
    cfg["eval"] = {"function": "environments/arithmetic_server.py:greedy_eval"}
    cfg["trainer"].update(training_steps=5, batch_size=8, warmup_steps=0, checkpoint_interval=0)
    cfg["max_wall_time"] = 800
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_grpo_run_serves_with_vllm_and_reloads_weights_every_step(
    tmp_path: Path, vllm_python: str, monkeypatch
) -> None:
    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", vllm_python)
    config = _short_config(tmp_path, vllm_python)
    runner = subprocess.Popen(
        [sys.executable, "-m", "example_trainer.run", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Every process the run starts (vLLM's API server and engine core included), to check
    # that none outlives it; polled once a second, bounded by count.
    seen: dict[int, psutil.Process] = {}
    cmdlines: list[str] = []
    runner_ps = psutil.Process(runner.pid)
    try:
        for _ in range(850):
            if runner.poll() is not None:
                break
            try:
                for child in runner_ps.children(recursive=True):
                    if child.pid not in seen:
                        seen[child.pid] = child
                        cmdlines.append(" ".join(_cmdline(child)))
            except psutil.NoSuchProcess:
                pass
            time.sleep(1.0)
        out = runner.stdout.read() if runner.stdout else ""
    finally:
        if runner.poll() is None:
            runner.kill()
        runner.wait()
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    tails = "\n".join(
        f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs.glob("*.log")
    )
    assert runner.returncode == 0, out[-2000:] + tails

    inference_log = (logs / "inference.log").read_text(errors="replace")
    assert "vllm.entrypoints.openai" in inference_log or "vLLM" in inference_log
    # Every step reloaded the weights in place, between a pause and a resume.
    assert inference_log.count('"POST /collective_rpc HTTP/1.1" 200') == 5
    assert inference_log.count('"POST /resume HTTP/1.1" 200') == 5

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert [r["train/weights_version"] for r in rows] == [1.0, 2.0, 3.0, 4.0, 5.0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["inference_weights_version"] == 5  # vLLM's /weight_info at the end
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    # The environment's rollouts carried vLLM's weight version (the trainer's step; 0 for the
    # weights vLLM started with, which vLLM itself calls "default") into every batch trained
    # on: the trainer measured how stale each was.
    stale = [r.get("off_policy/staleness_max") for r in rows]
    # (at most the updates made before that step: the environment may run ahead of them)
    assert all(s is not None and 0 <= s <= i for i, s in enumerate(stale)), stale
    assert rows[0]["off_policy/policy_version_min"] == 0.0, rows[0]
    # Nothing of the run is left: vLLM's server and engine processes included.
    assert any("vllm.entrypoints.openai.api_server" in c for c in cmdlines), cmdlines
    left = [p for p in seen.values() if _alive(p)]
    assert not left, [(p.pid, _cmdline(p)) for p in left]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_inference_command_runs_vllm_from_its_venv(tmp_path: Path, monkeypatch) -> None:
    """The runner's vLLM command: the vLLM venv's interpreter (``ATROPOS_VLLM_PYTHON``), vLLM's
    OpenAI server module, the RL routes switched on, the config's flags and environment."""
    from example_trainer.launch.launcher import Launcher
    from example_trainer.run import config_from_args

    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", "/opt/vllm-venv/bin/python")
    cfg = config_from_args(["--config", str(DEMO), "--run-dir", str(tmp_path / "run")])
    cmd, env = Launcher(cfg).inference_cmd("/models/tiny", port=9123)
    assert cmd[:3] == ["/opt/vllm-venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--port") + 1] == "9123"
    assert cmd[-4:] == ["--max-model-len", "512", "--max-num-seqs", "256"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "--weights-root" not in cmd  # atropos-serve-model's flag only
