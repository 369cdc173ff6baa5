"""Multi-process training (torchrun, gloo on the CPU, FSDP2) against real run-api and
atropos-serve-model processes: 2 processes learn exactly what 1 process learns from the
same batches, rank 0 alone talks to the API and the inference server, and a 2-process
checkpoint resumes on 1 process.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
import torch
from safetensors.torch import load_file

from atroposlib.testing.launch import run_api_cmd, serve_model_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import PYTHON, running_process
from example_trainer.distributed import split_groups
from tests.example_trainer.conftest import make_batch

ROOT = Path(__file__).resolve().parents[2]
GROUPS_PER_BATCH = 3
GROUP_SIZE = 4
STEPS = 3


def test_split_groups_gives_whole_groups_once_with_balanced_tokens():
    batch = [{"tokens": [[0] * n] * 4} for n in (50, 10, 10, 30, 20, 40)]
    shares = split_groups(batch, 2)
    assert sorted(i for s in shares for i in s) == list(range(6))
    loads = [sum(4 * len(batch[i]["tokens"][0]) for i in s) for s in shares]
    assert loads == [320, 320]
    assert split_groups(batch[:1], 3) == [[0], [], []]


def _groups(tokenizer) -> List[Dict[str, Any]]:
    """STEPS batches' worth of groups with uneven lengths (so the shares differ in size)."""
    groups = make_batch(
        tokenizer,
        n_groups=GROUPS_PER_BATCH * STEPS,
        group_size=GROUP_SIZE,
        seed=11,
    )
    for k, g in enumerate(groups):  # pad some groups' completions to vary the token budget
        extra = (k % 3) * 5
        for key, fill in (("tokens", 0), ("masks", 0)):
            g[key] = [row + [fill] * extra for row in g[key]]
    return groups


def _train(
    tmp: Path,
    name: str,
    model_dir: str,
    inference_url: str,
    groups: List[Dict[str, Any]],
    procs: int,
    extra: List[str] = (),
) -> Path:
    """Start a fresh run-api, queue ``groups``, run the trainer on ``procs`` processes."""
    run = tmp / name
    run.mkdir(exist_ok=True)
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    with running_process(
        run_api_cmd(port),
        health_url=f"{api}/health",
        log_path=run / "api.log",
    ):
        r = httpx.post(f"{api}/scored_data_list", json=groups, timeout=30)
        assert r.status_code == 200, r.text
        flags = [
            "--model-name",
            model_dir,
            "--atropos-url",
            api,
            "--inference-url",
            inference_url,
            "--weight-bridge-mode",
            "http_reload",
            "--training-steps",
            str(STEPS),
            "--vllm-restart-interval",
            "3",
            "--batch-size",
            "4",
            "--gradient-accumulation-steps",
            str(GROUPS_PER_BATCH),
            "--lr",
            "1e-3",
            "--optimizer",
            "adamw",
            "--pad-to-multiple",
            "8",
            "--checkpoint-interval",
            "2",
            "--batch-poll-interval",
            "0.1",
            "--batch-wait-timeout",
            "60",
            "--progress",
            "false",
            "--save-path",
            str(run / "ckpt"),
            "--log-dir",
            str(run),
            *extra,
        ]
        if procs > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        else:
            launcher = []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        proc = subprocess.run(
            [PYTHON, *launcher, "-m", "example_trainer.grpo", *flags],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run


def _losses(run: Path, key: str = "train/loss") -> Dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows}


def _max_weight_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def served(tiny_model_dir, root):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_model_cmd(tiny_model_dir, port, "--weights-root", str(root))
    with running_process(cmd, health_url=f"{url}/health", timeout=180, log_path=root / "serve.log"):
        yield url


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tiny_tokenizer, served, root):
    tmp = root
    groups = _groups(tiny_tokenizer)
    one = _train(tmp, "one", str(tiny_model_dir), served, groups, procs=1)
    two = _train(tmp, "two", str(tiny_model_dir), served, groups, procs=2)
    return one, two, groups, tmp


def test_two_processes_follow_the_one_process_loss_curve(runs, served):
    one, two, _, _ = runs
    l1, l2 = _losses(one), _losses(two)
    assert sorted(l1) == sorted(l2) == [1, 2, 3]
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-3, abs=1e-5), (l1, l2)
    assert l1[1] != l1[3]  # it did train
    # The gradient itself matches, not only its direction (AdamW would hide a scale error).
    g1, g2 = _losses(one, "train/grad_norm"), _losses(two, "train/grad_norm")
    for step in g1:
        assert g2[step] == pytest.approx(g1[step], rel=1e-3), (g1, g2)
    assert _max_weight_diff(one / "ckpt" / "final_model", two / "ckpt" / "final_model") < 1e-4
    # Rank 0 alone logged and pushed the final weights to the inference server.
    rows = (two / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == STEPS
    assert json.loads(rows[-1])["train/weights_version"] >= 1
    assert torch.load(two / "ckpt" / "step_2" / "trainer_state.pt")["world_size"] == 2


def test_two_process_checkpoint_resumes_on_one_process(runs, tiny_model_dir, served):
    _, two, groups, tmp = runs
    resumed = tmp / "resumed"
    resumed.mkdir()
    (resumed / "ckpt").mkdir()
    os.symlink(two / "ckpt" / "step_2", resumed / "ckpt" / "step_2")
    run = _train(
        tmp,
        "resumed",
        str(tiny_model_dir),
        served,
        groups[GROUPS_PER_BATCH * 2 :],
        procs=1,
        extra=["--resume"],
    )
    assert sorted(_losses(run)) == [3]
    assert _losses(run)[3] == pytest.approx(_losses(two)[3], rel=1e-3, abs=1e-5)
    assert _max_weight_diff(run / "ckpt" / "final_model", two / "ckpt" / "final_model") < 1e-4
