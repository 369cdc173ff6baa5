"""The trainer step reads device values back to the host once per optimizer step.

On a GPU every ``.item()``/``float(tensor)`` waits for the device to drain, so a
step with one per metric per micro-batch leaves the GPU idle between launches. The
CPU cannot count device syncs, so this counts every tensor→Python conversion made
by the trainer's own code during a step (library internals such as AdamW's CPU step
counter are not the trainer's and are not counted).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch

from example_trainer.config import TrainingConfig
from example_trainer.trainers import GRPOTrainer
from tests.example_trainer.conftest import make_batch

PACKAGE = str(Path(__file__).resolve().parents[2] / "example_trainer")
CONVERSIONS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")


def _train_counting(trainer: GRPOTrainer, batch) -> Tuple[Dict[str, Any], List[str]]:
    """Metrics of one step and the conversions example_trainer/ code made during it."""
    calls: List[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counting(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE):
                calls.append(f"{name} in {caller.co_name}")
            return original(self, *args, **kwargs)

        return counted

    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    try:
        metrics = trainer.train_on_batch(batch)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return metrics, calls


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_one_host_read_per_optimizer_step(tiny_model_dir, tiny_tokenizer, tmp_path, kl_coef):
    trainer = GRPOTrainer(
        TrainingConfig(
            model_name=str(tiny_model_dir),
            save_path=str(tmp_path),
            device="cpu",
            optimizer="adamw",
            batch_size=3,  # 8 sequences: three micro-batches
            gradient_accumulation_steps=3,
            pad_to_multiple=8,
            kl_coef=kl_coef,
            progress=False,
        )
    )
    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4, with_logprobs=True)
    batch[0]["overrides"] = [{"temperature": 0.7}] * 4  # the temperature path too
    metrics, calls = _train_counting(trainer, batch)
    # The one read also carries the gradient norm that decides whether the step is applied.
    assert calls == ["tolist in read_back"], calls
    assert metrics["train/num_tokens"] > 0 and metrics["train/grad_norm"] > 0
    assert "alignment/diff_max" in metrics and ("train/kl" in metrics) == (kl_coef > 0)
