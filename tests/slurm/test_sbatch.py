"""examples/slurm/atropos.sbatch under a real Slurm (docs/multi-node.md, examples/slurm/README.md).

A one-node cluster (``slurmctld`` + ``slurmd`` from Debian's ``slurm-wlm``, started here on
loopback) runs the template as submitted with ``sbatch``: the node plays every role
(``NUM_TRAINING_NODES=0``), one ``atropos-serve-model`` on the tiny model (``INFER_TP=8``),
run-api with ``--persist``, the arithmetic environment and a one-rank trainer through
``srun torchrun --rdzv-backend c10d``, all on CPU. The job must complete, the trainer step to
the end on groups the environment sent through run-api, and nothing of the job stay behind.

Where Slurm is missing or its daemons cannot start, the test skips with the reason; under CI
(``CI`` set) it fails instead, so CI never passes without running it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from atroposlib.testing.multinode import MARK_ENV, marked_processes, signal_processes
from atroposlib.testing.ports import free_port
from atroposlib.testing.slurm import LocalSlurm, SlurmUnavailable

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "slurm" / "atropos.sbatch"
STEPS = 3


@pytest.fixture
def cluster(tmp_path):
    slurm = LocalSlurm(tmp_path / "slurm")
    try:
        slurm.start()
    except SlurmUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm must run under CI: {e}")
        pytest.skip(str(e))
    try:
        yield slurm
    finally:
        slurm.stop()


def _job_env(run: Path, model: Path, mark: str) -> dict:
    """The template's variables for one CPU node playing every role, on free loopback ports."""
    venv_bin = str(Path(os.sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        MARK_ENV: mark,
        "MODEL": str(model),
        "NUM_TRAINING_NODES": "0",
        "INFER_TP": "8",
        "DEVICE": "cpu",
        "TRAINER_PROCS": "1",
        "TRAINING_STEPS": str(STEPS),
        "BIND_HOST": "127.0.0.1",
        "INFER_BASE_PORT": str(free_port()),
        "API_PORT": str(free_port()),
        "RDZV_PORT": str(free_port()),
        "RUN": str(run),
        "HEALTH_TIMEOUT": "240",
        "ENVS": "environments/arithmetic_server.py",
        # The untrained tiny model mostly scores a group all 0: keep those too.
        "ENV_ARGS": "--env.group_size 4 --env.ensure_scores_are_not_same false",
        "SERVE_ARGS": "--cpu-threads 1 --seed 0",
        "TRAINER_ARGS": (
            "--optimizer adamw --lr 1e-4 --batch-size 4 --gradient-accumulation-steps 2 "
            "--seq-len 128 --pad-to-multiple 8 --vllm-restart-interval 1 "
            "--checkpoint-interval 0 --batch-poll-interval 0.2 --progress false "
            "--torch-threads 1"
        ),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _logs(run: Path, out: Path) -> str:
    parts = [f"== job\n{out.read_text(errors='replace') if out.exists() else ''}"]
    for path in sorted((run / "logs").glob("*.log")):
        parts.append(f"== {path.name}\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


def test_template_runs_under_slurm(cluster, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    out = tmp_path / "job.out"
    mark = uuid.uuid4().hex
    try:
        job = cluster.submit(
            ["--nodes=1", f"--output={out}", str(TEMPLATE)],
            env=_job_env(run, tiny_model_dir, mark),
            cwd=ROOT,
        )
        fields = cluster.wait_job(job, timeout=600)
        context = f"{fields}\n{_logs(run, out)}\n{cluster.logs()}"
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", context
        text = out.read_text()
        assert "run-api and 1 inference server(s) healthy" in text, context
        assert f"trainer finished: {STEPS} steps" in text, context
        # The job's output is also in the run directory, whole (not in the submit directory).
        assert f"trainer finished: {STEPS} steps" in (run / "job.log").read_text(), context

        # The trainer stepped to the end, on groups the environment sent through run-api.
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
        assert [r["step"] for r in rows][-1] == STEPS, rows
        assert sum(r.get("train/groups_env_0", 0) for r in rows) > 0, rows
        # run-api's persisted state: the trainer registered and took its STEPS batches there.
        with sqlite3.connect(run / "api.db") as db:
            (raw,) = db.execute("select value from meta where key = 'state'").fetchone()
        state = json.loads(raw)
        assert state["registered"] and state["step"] == STEPS, state
        env_log = next((run / "logs").glob("env-0-*.log")).read_text(errors="replace")
        assert "registered as env 0" in env_log, context

        # Nothing of the job is left: the servers, run-api, the environment, torchrun and
        # its rank all ended with the job (the clean-up trap stopped their steps).
        left = marked_processes(mark)
        for _ in range(30):
            if not left:
                break
            time.sleep(0.5)
            left = marked_processes(mark)
        assert left == [], [" ".join(p.cmdline())[:120] for p in left]
    finally:
        signal_processes([p.pid for p in marked_processes(mark)])
