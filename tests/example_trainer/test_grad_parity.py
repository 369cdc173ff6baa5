"""N trainer processes compute the one-process gradient (torchrun, gloo on the CPU, FSDP2):
with a KL reference model on ranks that get different numbers of micro-batches, and with
the batch cut into several mini-batches (the cut is global, not per rank)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from atroposlib.testing.processes import PYTHON
from tests.example_trainer.conftest import make_batch

ROOT = Path(__file__).resolve().parents[2]


def _batch(tokenizer):
    """9 sequences of uneven lengths: the two ranks get different micro-batch counts."""
    groups = make_batch(tokenizer, n_groups=3, group_size=3, seed=5, with_logprobs=True)
    for k, g in enumerate(groups):
        extra = k * 3
        for key in ("tokens", "masks"):
            g[key] = [row + [0] * extra for row in g[key]]
        g["inference_logprobs"] = [row + [-1.0] * extra for row in g["inference_logprobs"]]
        g["env_id"] = k
    return groups


def _run(tmp: Path, name: str, procs: int, batch, config: Dict[str, Any]) -> Dict[str, Any]:
    run = tmp / name
    run.mkdir()
    (run / "batch.json").write_text(json.dumps(batch))
    (run / "config.json").write_text(json.dumps({**config, "save_path": str(run)}))
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        if procs > 1
        else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    out = run / "out.pt"
    proc = subprocess.run(
        [PYTHON, *launcher, "-m", "tests.example_trainer.grad_worker", str(run / "batch.json"),
         str(run / "config.json"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _relative_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(a[k].pow(2).sum()) for k in a)
    return (num / den) ** 0.5


def test_two_processes_with_kl_and_mini_batches_compute_the_one_process_gradient(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    # 9 sequences in mini-batches of 4 and 5; micro-batches of 2: in the second mini-batch
    # one rank runs 2 micro-batches and the other 1 plus an empty one.
    mini_batches = 2
    config = {
        "model_name": str(tiny_model_dir),
        "device": "cpu",
        "optimizer": "adamw",
        "lr": 1e-2,
        "batch_size": 2,
        "gradient_accumulation_steps": 5,
        "pad_to_multiple": 8,
        "kl_coef": 0.05,
        "mini_batches": mini_batches,
        "max_grad_norm": 1e9,
        "progress": False,
    }
    batch = _batch(tiny_tokenizer)
    one = _run(tmp_path, "one", 1, batch, config)
    two = _run(tmp_path, "two", 2, batch, config)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["grads"]) == len(two["grads"]) == mini_batches
    for g1, g2 in zip(one["grads"], two["grads"], strict=True):
        assert _relative_difference(g1, g2) <= 1e-6
    assert two["metrics"]["train/kl"] > 0  # the second step's policy has moved: KL is live
    assert two["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], rel=1e-5)
