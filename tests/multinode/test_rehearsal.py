"""A four-node job rehearsed on loopback (docs/multi-node.md, "Rehearsed on one machine").

127.0.0.1 and 127.0.0.4 are the training nodes, 127.0.0.2 and 127.0.0.3 the inference nodes,
each running two ``atropos-serve-model`` on ports 9000 and 9001 (``INFER_TP=4``: 8 // 4 servers
a node). A fake ``scontrol`` lists the nodes; the three environments find the servers through
the original's discovery (``--slurm true``), the trainer through ``--inference-urls-file``
written by the same discovery. run-api persists on 127.0.0.1; the trainer is two ``torchrun``
launchers (``--nnodes 2``, c10d, gloo), one per training node. Real processes throughout.

One scenario, in order: groups of every environment are trained on by both ranks together;
each weight version reaches all four servers; a killed server is failed over with no group
lost and named by the sync; run-api is killed with SIGKILL and restarted on its database with
everything it had acknowledged; stopping one node's launcher ends the trainer on both nodes,
and nothing of the job is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List

import httpx
import pytest

from atroposlib.envs.server_handling.server_manager import slurm_inference_urls
from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.multinode import (
    MARK_ENV,
    fake_slurm,
    marked_processes,
    serve_model_node_cmd,
    signal_processes,
    torchrun_node_cmd,
)
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import wait_http
from atroposlib.utils.parent_death import die_with_parent

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ["127.0.0.1", "127.0.0.4"]
INFERENCE = ["127.0.0.2", "127.0.0.3"]
PORTS = (9000, 9001)
# Lines an environment logs when a group is lost (runner and worker pool).
LOST = ("group is dropped", "item dropped", "collect_trajectories failed", "worker crashed")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As the servers bind (uvicorn): a port in TIME_WAIT after an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _metric(text: str, name: str) -> Dict[str, float]:
    """Prometheus lines of ``name``: label text -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


class Job:
    """The processes of the rehearsal, each marked, each with its own log."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model = tmp, model
        self.mark = uuid.uuid4().hex
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.shared = tmp / "shared"  # the "shared filesystem" of the nodes
        (self.shared / "checkpoints").mkdir(parents=True)
        self.env = {
            **fake_slurm(tmp / "bin", TRAINING + INFERENCE, training_nodes=2, infer_tp=4),
            MARK_ENV: self.mark,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.procs: Dict[str, subprocess.Popen] = {}
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"

    def start(self, name: str, cmd: List[str]) -> subprocess.Popen:
        # Each in its own session, and gone with the test process however that ends.
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=ROOT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tails(self) -> str:
        return "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}"
            for p in sorted(self.logs.glob("*.log"))
        )

    def start_api(self) -> None:
        self.start("api", run_api_cmd(self.api_port, "--persist", str(self.shared / "api.db")))
        wait_http(f"{self.api_url}/health", timeout=120, proc=self.procs["api"])

    def metrics(self) -> List[dict]:
        path = self.shared / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def step(self) -> int:
        rows = self.metrics()
        return int(rows[-1]["step"]) if rows else 0

    def wait_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            for name in ("node0", "node1"):
                assert self.procs[name].poll() is None, f"{name} exited\n{self.tails()}"
            assert time.monotonic() < deadline, f"step {step} not reached\n{self.tails()}"
            time.sleep(0.5)

    def api_state(self) -> Dict[str, Dict[str, float]]:
        text = httpx.get(f"{self.api_url}/metrics", timeout=10).text
        # Zero rows dropped: an env with nothing queued may be listed or not.
        return {
            name: {k: v for k, v in _metric(text, name).items() if v}
            for name in (
                "atropos_queue_groups",
                "atropos_step",
                "atropos_unacknowledged_batch_groups",
            )
        }

    def cleanup(self) -> List[str]:
        """Stop everything; the job's processes still alive after that (should be none)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with_group = proc.pid
                try:
                    os.killpg(with_group, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        signal_processes([p.pid for p in marked_processes(self.mark)])
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return [" ".join(p.cmdline())[:120] for p in marked_processes(self.mark)]


@pytest.fixture
def job(tmp_path, tiny_model_dir):
    if not all(_port_free(h, p) for h in INFERENCE for p in PORTS):
        pytest.skip("ports 9000/9001 on 127.0.0.2-3 are taken (another job on this machine)")
    job = Job(tmp_path, tiny_model_dir)
    yield job
    left = job.cleanup()
    assert left == [], left


def _versions(urls: List[str]) -> List[int | None]:
    out = []
    for url in urls:
        try:
            out.append(httpx.get(f"{url}/health", timeout=5).json().get("version"))
        except httpx.HTTPError:
            out.append(None)
    return out


def test_four_node_job_on_loopback(job, monkeypatch):
    model = str(job.model)
    # -- inference nodes: two servers each, found through the original's discovery
    for host in INFERENCE:
        for port in PORTS:
            job.start(
                f"serve-{host}-{port}",
                serve_model_node_cmd(
                    model, host, port, "--weights-root", str(job.shared / "checkpoints"),
                    "--cpu-threads", "1", "--seed", "0",
                ),
            )  # fmt: skip
    for key in ("PATH", "SLURM_JOB_NODELIST", "NUM_TRAINING_NODES", "INFER_TP"):
        monkeypatch.setenv(key, job.env[key])
    discovered = slurm_inference_urls()
    assert discovered == [f"http://{h}:{p}/v1" for h in INFERENCE for p in PORTS]
    servers = [u[: -len("/v1")] for u in discovered]
    (job.shared / "inference_urls.txt").write_text("\n".join(discovered) + "\n")
    job.start_api()
    for url in servers:
        wait_http(f"{url}/health", timeout=240)

    # -- the trainer: one torchrun per training node, meeting on node 0
    endpoint = f"127.0.0.1:{free_port()}"
    trainer = [
        "--model-name", model, "--device", "cpu", "--optimizer", "adamw", "--lr", "1e-4",
        "--atropos-url", job.api_url, "--weight-bridge-mode", "http_reload",
        "--inference-urls-file", str(job.shared / "inference_urls.txt"),
        "--save-path", str(job.shared / "checkpoints"), "--log-dir", str(job.shared),
        "--batch-size", "4", "--gradient-accumulation-steps", "2", "--seq-len", "128",
        "--pad-to-multiple", "8", "--training-steps", "200", "--vllm-restart-interval", "1",
        "--checkpoint-interval", "0", "--batch-poll-interval", "0.2", "--progress", "false",
        "--torch-threads", "1", "--sync-timeout", "60",
    ]  # fmt: skip
    for i, addr in enumerate(TRAINING):
        job.start(
            f"node{i}",
            torchrun_node_cmd(2, endpoint, "rehearsal", addr, "example_trainer.grpo", *trainer),
        )
    # -- three environments, the inference servers discovered through "Slurm"
    for i in range(3):
        job.start(
            f"env{i}",
            [
                sys.executable, str(ROOT / "environments" / "arithmetic_server.py"), "serve",
                "--slurm", "true", "--openai.model_name", model, "--openai.server_type", "vllm",
                "--openai.api_key", "x", "--env.tokenizer_name", model,
                "--env.rollout_server_url", job.api_url, "--env.group_size", "4",
                "--env.use_wandb", "false", "--env.seed", str(i),
                # The untrained tiny model mostly scores a group all 0: keep those too.
                "--env.ensure_scores_are_not_same", "false",
            ],
        )  # fmt: skip

    # 1. Both ranks step together on groups from every environment; every server gets the
    # weights of each step.
    job.wait_step(3)
    logs = job.log("node0") + job.log("node1")
    assert "rank 0 of 2" in logs and "rank 1 of 2" in logs, job.tails()
    seen = {k for row in job.metrics() for k in row if k.startswith("train/groups_env_")}
    deadline = time.monotonic() + 180
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(1)
        seen = {k for row in job.metrics() for k in row if k.startswith("train/groups_env_")}
    assert seen == {f"train/groups_env_{i}" for i in range(3)}, seen
    step = job.step()
    assert all(v is not None and v >= step for v in _versions(servers)), _versions(servers)

    # 2. One inference server dies mid-run: the environments fail over, the trainer's sync
    # names it and goes on with the other three.
    killed = servers[3]
    job.procs[f"serve-{INFERENCE[1]}-{PORTS[1]}"].send_signal(signal.SIGKILL)
    at_kill = job.step()
    job.wait_step(at_kill + 3)
    assert killed in logs_after(job, "did not take part"), job.tails()
    rows = [r for r in job.metrics() if r["step"] > at_kill + 1]
    assert rows and all(r.get("train/sync_failed_servers") == 1.0 for r in rows), rows[-1]
    later = job.step()
    assert all(v is not None and v >= later for v in _versions(servers[:3]))

    # 3. kill -9 of run-api, restart on its database: everything it acknowledged is back.
    # The ranks are frozen first, so groups pile up on the queue; then the environments, so
    # the state before and after compare.
    ranks = _rank_pids(job)
    envs = [job.procs[f"env{i}"].pid for i in range(3)]
    signal_processes(ranks, signal.SIGSTOP)
    try:
        for _ in range(240):
            if sum(job.api_state()["atropos_queue_groups"].values()) >= 2:
                break
            time.sleep(0.5)
        signal_processes(envs, signal.SIGSTOP)
        before = _settled_state(job)
        assert sum(before["atropos_queue_groups"].values()) >= 2, before
        job.procs["api"].send_signal(signal.SIGKILL)
        job.procs["api"].wait(timeout=10)
        job.start_api()
        assert job.api_state() == before
    finally:
        signal_processes(envs + ranks, signal.SIGCONT)
    job.wait_step(job.step() + 2)
    for i in range(3):
        env_log = job.log(f"env{i}")
        assert not [line for line in env_log.splitlines() if any(k in line for k in LOST)], env_log

    # 4. Stopping one node's launcher ends the trainer on both nodes, leaving nothing.
    job.procs["node1"].send_signal(signal.SIGTERM)
    for name in ("node1", "node0"):
        job.procs[name].wait(timeout=120)
    assert job.procs["node0"].returncode != 0
    time.sleep(1)
    left = [
        " ".join(p.cmdline())[:120]
        for p in marked_processes(job.mark)
        if "example_trainer.grpo" in p.cmdline() or "torch.distributed.run" in p.cmdline()
    ]
    assert left == [], left


def logs_after(job: Job, needle: str) -> str:
    """The trainer's log lines (both nodes) that contain ``needle``."""
    lines = (job.log("node0") + job.log("node1")).splitlines()
    return "\n".join(line for line in lines if needle in line)


def _rank_pids(job: Job) -> List[int]:
    """The trainer ranks (torchrun's workers) of both nodes."""
    pids = []
    for p in marked_processes(job.mark):
        try:
            if "example_trainer.grpo" in p.cmdline() and "RANK" in p.environ():
                pids.append(p.pid)
        except Exception:  # gone meanwhile
            continue
    assert len(pids) == 2, pids
    return pids


def _settled_state(job: Job) -> Dict[str, Dict[str, float]]:
    """run-api's state once two reads a moment apart agree (requests in flight have landed)."""
    state = job.api_state()
    for _ in range(20):
        time.sleep(0.5)
        again = job.api_state()
        if again == state:
            return state
        state = again
    raise AssertionError(f"run-api's state kept changing with every client frozen: {state}")
