"""Unit tests of the GRPO loss: clipping, advantage sign, masking, ratio-1 fallback, KL."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.data import IGNORE_INDEX
from example_trainer.loss_config import LossConfig
from example_trainer.training import compute_grpo_loss, token_logprobs


def _setup(seed: int = 0, b: int = 2, t: int = 5, v: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, t), generator=g)
    return logits, labels


def test_token_logprobs_match_log_softmax_and_zero_on_masked():
    logits, labels = _setup()
    labels[0, 0] = IGNORE_INDEX
    lp = token_logprobs(logits, labels)
    ref = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert lp[0, 0].item() == 0.0
    assert torch.allclose(lp[0, 1:], ref[0, 1:], atol=1e-6)


def test_temperature_divides_logits():
    logits, labels = _setup()
    lp = token_logprobs(logits, labels, torch.tensor([2.0, 0.5]))
    ref0 = torch.log_softmax(logits[0] / 2.0, -1).gather(-1, labels[0].unsqueeze(-1)).squeeze(-1)
    ref1 = torch.log_softmax(logits[1] / 0.5, -1).gather(-1, labels[1].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp[0], ref0, atol=1e-5) and torch.allclose(lp[1], ref1, atol=1e-5)


def test_positive_advantage_gradient_raises_label_logprob():
    logits, labels = _setup()
    adv = torch.ones(2, 5)
    out = compute_grpo_loss(logits, labels, adv)
    out.loss.backward()
    # Descending the loss must increase the log-prob of the labels.
    with torch.no_grad():
        before = token_logprobs(logits, labels).sum()
        after = token_logprobs(logits - 0.1 * logits.grad, labels).sum()
    assert after > before


def test_negative_advantage_gradient_lowers_label_logprob():
    logits, labels = _setup()
    out = compute_grpo_loss(logits, labels, -torch.ones(2, 5))
    out.loss.backward()
    with torch.no_grad():
        before = token_logprobs(logits, labels).sum()
        after = token_logprobs(logits - 0.1 * logits.grad, labels).sum()
    assert after < before


def test_without_inference_logprobs_ratio_is_one_and_loss_is_minus_mean_advantage():
    logits, labels = _setup()
    adv = torch.tensor([[0.5] * 5, [-1.5] * 5])
    out = compute_grpo_loss(logits, labels, adv, inference_logprobs=None)
    assert out.metrics["grpo/mean_ratio"] == pytest.approx(1.0)
    assert out.metrics["grpo/clipped_fraction"] == 0.0
    assert out.loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)


def test_masked_positions_get_no_gradient_and_do_not_count():
    logits, labels = _setup()
    labels[:, :3] = IGNORE_INDEX
    adv = torch.ones(2, 5)
    out = compute_grpo_loss(logits, labels, adv)
    out.loss.backward()
    assert torch.all(logits.grad[:, :3] == 0)
    assert torch.any(logits.grad[:, 3:] != 0)
    assert out.metrics["train/num_tokens"] == 4


def test_positive_advantage_is_clipped_above_one_plus_eps():
    logits, labels = _setup()
    lp = token_logprobs(logits, labels).detach()
    old = lp - math.log(1.5)  # ratio 1.5 > 1.2 everywhere
    out = compute_grpo_loss(
        logits, labels, torch.ones(2, 5), inference_logprobs=old, config=LossConfig(clip_eps=0.2)
    )
    out.loss.backward()
    assert out.metrics["grpo/clipped_fraction"] == pytest.approx(1.0)
    assert torch.allclose(logits.grad, torch.zeros_like(logits.grad))
    assert out.loss.item() == pytest.approx(-1.2, abs=1e-5)


def test_negative_advantage_is_clipped_below_one_minus_eps_but_not_above():
    logits, labels = _setup()
    lp = token_logprobs(logits, labels).detach()
    low = compute_grpo_loss(
        logits, labels, -torch.ones(2, 5), inference_logprobs=lp - math.log(0.5)
    )
    low.loss.backward()
    assert torch.allclose(logits.grad, torch.zeros_like(logits.grad))  # ratio 0.5 < 0.8: clipped
    logits.grad = None
    high = compute_grpo_loss(
        logits, labels, -torch.ones(2, 5), inference_logprobs=lp - math.log(1.5)
    )
    high.loss.backward()
    # Pessimistic: a harmful ratio above 1+eps is not clipped, so the loss is 1.5 and there is gradient.
    assert high.loss.item() == pytest.approx(1.5, abs=1e-4)
    assert logits.grad.abs().sum() > 0


def test_per_sequence_advantages_broadcast_like_per_token():
    logits, labels = _setup()
    a = compute_grpo_loss(logits, labels, torch.tensor([1.0, -2.0])).loss
    b = compute_grpo_loss(logits, labels, torch.tensor([[1.0] * 5, [-2.0] * 5])).loss
    assert a.item() == pytest.approx(b.item())


def test_normalizer_scales_loss_for_gradient_accumulation():
    logits, labels = _setup()
    adv = torch.ones(2, 5)
    own = compute_grpo_loss(logits, labels, adv).loss.item()
    shared = compute_grpo_loss(logits, labels, adv, normalizer=40).loss.item()
    assert shared == pytest.approx(own * 10 / 40)


def test_kl_term_is_zero_at_reference_and_positive_away_from_it():
    logits, labels = _setup()
    lp = token_logprobs(logits, labels).detach()
    adv = torch.zeros(2, 5)
    same = compute_grpo_loss(logits, labels, adv, ref_logprobs=lp, config=LossConfig(kl_coef=0.5))
    assert same.metrics["train/kl"] == pytest.approx(0.0, abs=1e-6)
    far = compute_grpo_loss(
        logits, labels, adv, ref_logprobs=lp - 1.0, config=LossConfig(kl_coef=0.5)
    )
    assert far.metrics["train/kl"] > 0.1
    assert far.loss.item() == pytest.approx(0.5 * float(far.metrics["train/kl"]), rel=1e-4)
