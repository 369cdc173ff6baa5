"""``atropos-grpo-run`` on two "nodes" of one machine: the rendezvous flags reach torchrun.

Node 0 (``--node-rank 0``) starts run-api, ``atropos-serve-model``, a feeder environment and
its trainer rank; node 1 starts its trainer rank only and finds run-api at the rendezvous
host. The two ``torchrun`` launchers meet through c10d on 127.0.0.1 (gloo), so global rank 0
may be on either node: the trainer's ``save_path`` is shared, as on a cluster's filesystem.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from atroposlib.testing.multinode import MARK_ENV, marked_processes, signal_processes
from atroposlib.testing.ports import free_port
from atroposlib.utils.parent_death import die_with_parent
from tests.example_trainer.conftest import make_batch

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

FEEDER = """
import json, pathlib, sys, time
import httpx

url = sys.argv[sys.argv.index("--env.rollout_server_url") + 1]
groups = json.loads((pathlib.Path(__file__).parent / "groups.json").read_text())
httpx.post(url + "/scored_data_list", json=groups, timeout=30).raise_for_status()
while True:
    time.sleep(1)
"""


def test_two_node_run_trains_with_both_ranks_and_syncs_the_server(
    tmp_path, tiny_tokenizer, tiny_model_dir
):
    mark = uuid.uuid4().hex
    (tmp_path / "feeder.py").write_text(FEEDER)
    # STEPS batches of 2 groups of 4 (batch size 4 x 2 accumulation steps).
    (tmp_path / "groups.json").write_text(json.dumps(make_batch(tiny_tokenizer, 2 * STEPS, 4)))
    shared = tmp_path / "shared" / "checkpoints"
    endpoint = f"127.0.0.1:{free_port()}"
    api_port, inference_port = free_port(), free_port()
    env = {
        **os.environ,
        MARK_ENV: mark,
        "GLOO_SOCKET_IFNAME": "lo",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launchers = []
    try:
        for rank in (0, 1):
            cfg = {
                "run_dir": str(tmp_path / f"node{rank}"),
                "model": str(tiny_model_dir),
                "api_port": api_port,
                "inference_port": inference_port,
                "envs": [str(tmp_path / "feeder.py")],
                "nnodes": 2,
                "node_rank": rank,
                "rdzv_endpoint": endpoint,
                "rdzv_backend": "c10d",
                "rdzv_id": mark,
                "trainer": {"training_steps": STEPS, "save_path": str(shared)},
                "trainer_args": [
                    "--batch-size", "4", "--gradient-accumulation-steps", "2",
                    "--batch-poll-interval", "0.2", "--vllm-restart-interval", "1",
                    "--checkpoint-interval", "0",
                ],
                "startup_timeout": 180,
                "cpu_threads": 1,
                "status_interval": 0.2,
            }  # fmt: skip
            path = tmp_path / f"node{rank}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            log = (tmp_path / f"node{rank}.log").open("wb")
            launchers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "example_trainer.run", "--config", str(path)],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=die_with_parent,
                )
            )  # fmt: skip
            log.close()

        def logs() -> str:
            parts = []
            for p in sorted(tmp_path.glob("node*.log")) + sorted(tmp_path.glob("node*/logs/*.log")):
                parts.append(f"== {p}\n{p.read_text(errors='replace')[-2500:]}")
            return "\n".join(parts)

        for proc in launchers:
            assert proc.wait(timeout=480) == 0, logs()
        trainer_logs = "".join(
            (tmp_path / f"node{r}" / "logs" / "trainer.log").read_text() for r in (0, 1)
        )
        assert "rank 0 of 2" in trainer_logs and "rank 1 of 2" in trainer_logs, logs()
        # Node 1 started nothing but its trainer.
        assert sorted(p.name for p in (tmp_path / "node1" / "logs").glob("*.log")) == [
            "trainer.log"
        ]
        rows = [
            json.loads(line)
            for r in (0, 1)
            if (tmp_path / f"node{r}" / "metrics.jsonl").exists()
            for line in (tmp_path / f"node{r}" / "metrics.jsonl").read_text().splitlines()
        ]
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), rows
        assert rows[-1]["train/weights_version"] == STEPS
        summary = json.loads((tmp_path / "node0" / "summary.json").read_text())
        assert summary["inference_weights_version"] == STEPS, summary  # the server took each sync
        time.sleep(0.5)
        assert marked_processes(mark) == []
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
        signal_processes([p.pid for p in marked_processes(mark)])
