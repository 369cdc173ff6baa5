"""The distillation demo's config, end to end and short: a teacher made by a run config, served
by a second atropos-serve-model, its top-k attached by the arithmetic teacher env and used by
the trainer's distillation term.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DISTILL = ROOT / "example_trainer" / "configs" / "distill_cpu.yaml"

pytestmark = pytest.mark.tier2

SMALL_TRAINER = {
    "batch_size": 8,
    "gradient_accumulation_steps": 1,
    "warmup_steps": 0,
    "checkpoint_interval": 0,
    "batch_poll_interval": 0.2,
}


def test_distill_config_makes_serves_and_distils_from_its_teacher(tmp_path):
    # The teacher: one RL step of the tiny model (the demo's recipe, cut short).
    teacher_cfg = {
        "model": "tiny",
        "api_port": 0,
        "inference_port": 0,
        "envs": ["environments/arithmetic_server.py"],
        "group_size": 4,
        "env_args": ["--env.ensure_scores_are_not_same", "false"],
        "trainer": {**SMALL_TRAINER, "training_steps": 1},
        "cpu_threads": 1,
        "max_wall_time": 240,
    }
    teacher_yaml = tmp_path / "teacher.yaml"
    teacher_yaml.write_text(yaml.safe_dump(teacher_cfg))
    # The student: distill_cpu.yaml as shipped, cut to two steps without the warm-up.
    cfg = yaml.safe_load(DISTILL.read_text())
    cfg.update(
        run_dir=str(tmp_path / "run"),
        warmup=None,
        group_size=4,
        max_wall_time=300,
        eval={"function": "environments/arithmetic_server.py:greedy_eval"},
    )
    cfg["teacher"] = {"from_config": str(teacher_yaml), "cache_dir": str(tmp_path / "teachers")}
    cfg["trainer"] = {**cfg["trainer"], **SMALL_TRAINER, "training_steps": 2}
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "example_trainer.run", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    run = (tmp_path / "run").resolve()
    logs = run / "logs"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The teacher was made by its own run, cached, then served by a second server.
    marker = json.loads(next((tmp_path / "teachers").glob("teacher-*/teacher.json")).read_text())
    assert Path(marker["model"]).name == "final_model" and marker["build_seconds"] > 0
    assert "atroposlib.cli.serve_model" in (logs / "teacher.log").read_text()
    assert marker["model"] in (logs / "teacher.log").read_text()
    env_log = (logs / "env.log").read_text()
    assert "--teacher.base_url" in env_log and "arithmetic_teacher_distill.py" in env_log
    # The teacher's rows reached the trainer and its distillation term was trained and logged:
    # distill/kl is a mean over the tokens with a teacher row, absent when there are none.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all("distill/kl" in r and r["distill/kl"] >= 0 for r in rows), rows
    assert any(r["distill/kl"] > 0 for r in rows), rows
    summary = json.loads((run / "summary.json").read_text())
    assert summary["teacher"]["model"] == marker["model"]
    assert 0.0 <= summary["teacher"]["eval"] <= 1.0
    assert summary["phases_s"]["teacher"] > 0
