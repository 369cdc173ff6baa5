"""Statements of README.md and example_trainer/README.md about the trainer, each checked
against a hand computation or a run: what an absurd (−9999) sampler log-prob gets under each
``--off-policy-correction``/``--tis-mode``, what one of ``--training-steps`` is, the KL
reference's dtype and memory under ``--precision``, the clamps of every KL estimator,
GSPO's cap and asymmetric clip, and the loss table's defaults."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from example_trainer import api, trainers
from example_trainer.cli import config_from_args
from example_trainer.kl import kl_penalty
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import CorrectionConfig
from example_trainer.trainers import GRPOTrainer
from example_trainer.training import grpo_loss, token_logprobs
from example_trainer.weight_sync import WeightSync
from tests.trainer.conftest import cpu_config, make_batch


def _two_way(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way logits whose label-0 probability at each position is ``probs[t]``."""
    q = torch.tensor(probs)
    logits = torch.stack([q.log(), (1 - q).log()], dim=-1).unsqueeze(0)
    return logits.requires_grad_(True), torch.zeros(1, len(probs), dtype=torch.long)


def _loss_grad(logits, labels, weights) -> torch.Tensor:
    """The logits' gradient of ``−Σ_t w_t·logp_t / T``: the loss whose token ``t`` gets
    ``w_t·∇logp`` (README's way of stating each mode's gradient)."""
    x = logits.detach().clone().requires_grad_(True)
    (-(torch.tensor([weights]) * token_logprobs(x, labels)).sum() / labels.numel()).backward()
    return x.grad


# --- example_trainer/README.md, "One absurd sampler log-prob" --------------------------------
# "the log-ratio is clamped at ±20 in every mode ... Under `none` and `icepop` such a token then
# gets no gradient; under `tis` a token with `A < 0` gets the truncated `C·A·∇logp` (bounded,
# not zero; with `A > 0` it is in the clip zone: 0), and under `--tis-mode truncate` every such
# token gets `C·A·∇logp`."

C = 2.5
ABSURD_CASES = [
    # (mode, tis_mode, advantage, README's gradient weight of the −9999 token)
    ("none", "clip-zone-zero", -1.5, 0.0),
    ("none", "clip-zone-zero", 1.5, 0.0),
    ("icepop", "clip-zone-zero", -1.5, 0.0),
    ("icepop", "clip-zone-zero", 1.5, 0.0),
    ("tis", "clip-zone-zero", -1.5, C * -1.5),
    ("tis", "clip-zone-zero", 1.5, 0.0),
    ("tis", "truncate", -1.5, C * -1.5),
    ("tis", "truncate", 1.5, C * 1.5),
]


@pytest.mark.parametrize("mode, tis_mode, adv, weight", ABSURD_CASES)
def test_an_absurd_sampler_logprob_gets_the_gradient_readme_states(mode, tis_mode, adv, weight):
    # Token 0: the sampler agrees with the trainer (r = 1, plain A·∇logp in every mode);
    # token 1: the sampler wrote −9999 for a token the trainer gives 0.3.
    logits, labels = _two_way([0.5, 0.3])
    inference = torch.tensor([[math.log(0.5), -9999.0]])
    config = LossConfig(off_policy=CorrectionConfig(mode, clip=C, tis_mode=tis_mode))
    out = grpo_loss(logits, labels, torch.tensor([adv]), inference_logprobs=inference, config=config)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    torch.testing.assert_close(logits.grad, _loss_grad(logits, labels, [adv, weight]))
    # The ratio to the sampler is e^20 (the clamp), not inf; `off_policy/clip_fraction` is
    # README.md's "share truncated or dropped": that token, one of two.
    m = out.metrics
    sampler_ratio = m["off_policy/mean_ratio"] if mode != "none" else m["grpo/mean_ratio"]
    assert float(sampler_ratio) == pytest.approx((1.0 + math.exp(20.0)) / 2, rel=1e-5)
    if mode != "none":
        assert float(m["off_policy/clip_fraction"]) == pytest.approx(0.5)


def test_no_correction_pushes_a_negative_advantage_with_the_whole_ratio():
    # README.md, `--off-policy-correction none`: "a token with `A < 0` and a huge `r` pushes
    # with `r·A`"; `tis` bounds the same token by `C·|A|`.
    logits, labels = _two_way([0.5])
    inference = torch.tensor([[math.log(0.01)]])  # r = 50
    adv = torch.tensor([-2.0])
    for config, weight in (
        (LossConfig(), 50.0 * -2.0),
        (LossConfig(off_policy=CorrectionConfig("tis", clip=C)), C * -2.0),
    ):
        x = logits.detach().clone().requires_grad_(True)
        grpo_loss(x, labels, adv, inference_logprobs=inference, config=config).loss.backward()
        torch.testing.assert_close(x.grad, _loss_grad(logits, labels, [weight]), rtol=1e-4, atol=0)


def test_tis_truncate_weights_every_token_by_the_capped_ratio_to_the_sampler():
    # example_trainer/README.md, `--tis-mode truncate`: "every token's loss is multiplied by the
    # constant `w = min(exp(old − b), C)` and PPO's clip is taken against the trainer's own `old`
    # log-probs ..., so a clip-zone token gets `min(r, C)·A·∇logp`"; README.md's `tis` row: that
    # token gets 0 under the default mode. Ratios to the sampler 1.5, 4 and 0.5, A = +1.
    logits, labels = _two_way([0.6, 0.8, 0.2])
    inference = torch.log(torch.tensor([[0.4, 0.2, 0.4]]))
    adv = torch.tensor([1.0])
    grads = {}
    for tis_mode in ("truncate", "clip-zone-zero"):
        x = logits.detach().clone().requires_grad_(True)
        cfg = LossConfig(off_policy=CorrectionConfig("tis", clip=C, tis_mode=tis_mode))
        grpo_loss(x, labels, adv, inference_logprobs=inference, config=cfg).loss.backward()
        grads[tis_mode] = x.grad
    torch.testing.assert_close(grads["truncate"], _loss_grad(logits, labels, [1.5, C, 0.5]))
    # clip-zone-zero: 1.5 and 4 are past 1 + ε with A > 0 (0); 0.5 is active (0.5·A).
    torch.testing.assert_close(grads["clip-zone-zero"], _loss_grad(logits, labels, [0, 0, 0.5]))
