"""Choices documented in example_trainer/README.md "Loss and optimizer options": the
environment's ref_logprobs are used when present, and tempered logits are divided in
float32."""

from __future__ import annotations

import pytest
import torch

from example_trainer.config import TrainingConfig
from example_trainer.trainers import GRPOTrainer
from example_trainer.training import token_logprobs
from tests.example_trainer.conftest import make_batch


def _trainer(model_dir, path) -> GRPOTrainer:
    return GRPOTrainer(
        TrainingConfig(
            model_name=str(model_dir),
            save_path=str(path),
            device="cpu",
            optimizer="adamw",
            batch_size=8,
            pad_to_multiple=8,
            kl_coef=0.1,
            progress=False,
        )
    )


def test_env_supplied_ref_logprobs_are_the_kl_reference(tiny_model_dir, tiny_tokenizer, tmp_path):
    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4)
    # At the first step the reference model is the policy: KL 0 without env values.
    assert _trainer(tiny_model_dir, tmp_path / "a").train_on_batch(batch)["train/kl"] == (
        pytest.approx(0.0, abs=1e-6)
    )
    # An environment's reference far below the policy (log-prob −30 on every token) gives
    # a KL of e^x − x − 1 with x = −30 − logp < −20 per token: clamped (x to −20, k3 to 10).
    for group in batch:
        group["ref_logprobs"] = [[-30.0] * len(t) for t in group["tokens"]]
    full = _trainer(tiny_model_dir, tmp_path / "b").train_on_batch(batch)["train/kl"]
    assert full == pytest.approx(10.0)
    # Only one group sends them: its tokens use them, the other's use the reference model.
    del batch[1]["ref_logprobs"]
    half = _trainer(tiny_model_dir, tmp_path / "c").train_on_batch(batch)["train/kl"]
    assert 0.2 * full < half < 0.8 * full


def test_tempered_bf16_logits_are_divided_in_float32():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 6, 50, generator=g) * 8).to(torch.bfloat16)
    labels = torch.randint(0, 50, (1, 6), generator=g)
    t = torch.tensor([0.7])
    exact = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, labels.unsqueeze(-1))[..., 0]
    assert torch.allclose(token_logprobs(logits, labels, t), exact, atol=1e-5)
    in_bf16 = torch.log_softmax((logits / t.to(torch.bfloat16)).float(), -1)
    assert not torch.allclose(
        in_bf16.gather(-1, labels.unsqueeze(-1))[..., 0], exact, atol=1e-5
    )  # what dividing first in bf16 would have given
