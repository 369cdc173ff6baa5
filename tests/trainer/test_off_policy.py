"""Off-policy correction (tis, icepop): weights and statistics against a hand computation,
their effect on the GRPO loss and its gradient, and the trainer flags."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.cli import config_from_args
from example_trainer.data import IGNORE_INDEX
from example_trainer.off_policy import CorrectionConfig, correction_weights
from example_trainer.training import compute_grpo_loss, token_logprobs

# Trainer probabilities p and sampler probabilities b of three label tokens: ratios 2, 0.5, 3.
P = [0.5, 0.2, 0.9]
B = [0.25, 0.4, 0.3]
RATIOS = [2.0, 0.5, 3.0]


def _tensors():
    p = torch.log(torch.tensor([P + [0.7]]))
    b = torch.log(torch.tensor([B + [0.1]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the fourth token is a prompt token
    return p, b, mask


def _hand_kl() -> float:
    return sum(r - 1 - math.log(r) for r in RATIOS) / 3


def test_tis_truncates_ratios_at_the_clip():
    p, b, mask = _tensors()
    w, stats = correction_weights(p, b, mask, "tis", clip=2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 2.5, 0.0]]), atol=1e-5)
    assert stats["mean_ratio"].item() == pytest.approx(11 / 6, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3, rel=1e-5)
    assert stats["mismatch_kl"].item() == pytest.approx(_hand_kl(), rel=1e-5)
    assert not w.requires_grad


def test_icepop_masks_ratios_outside_the_band():
    p, b, mask = _tensors()
    w, stats = correction_weights(p, b, mask, "icepop", clip=2.5, clip_low=0.6)
    assert torch.allclose(w, torch.tensor([[2.0, 0.0, 0.0, 0.0]]), atol=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3, rel=1e-5)


def test_equal_policies_give_unit_weights_and_zero_kl():
    p, _, mask = _tensors()
    for mode in ("tis", "icepop", "none"):
        w, stats = correction_weights(p, p.clone(), mask, mode)
        assert torch.allclose(w, mask)
        assert stats["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-7)
        assert stats["clip_fraction"].item() == 0.0


def test_unknown_mode_and_bad_bounds_are_refused():
    p, b, mask = _tensors()
    with pytest.raises(ValueError, match="not one of"):
        correction_weights(p, b, mask, "ppo")
    with pytest.raises(ValueError):
        CorrectionConfig("icepop", clip=1.0, clip_low=2.0)


def _logits_for(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way logits whose label-0 probability is each of ``probs``."""
    q = torch.tensor(probs)
    logits = torch.stack([q.log(), (1 - q).log()], dim=-1).unsqueeze(0).requires_grad_(True)
    labels = torch.zeros(1, len(probs), dtype=torch.long)
    return logits, labels


def test_tis_loss_is_the_weighted_on_policy_gradient():
    logits, labels = _logits_for(P + [0.7])
    labels[0, 3] = IGNORE_INDEX
    inference = torch.log(torch.tensor([B + [1.0]]))
    adv = torch.ones(1)
    out = compute_grpo_loss(
        logits, labels, adv, inference_logprobs=inference, off_policy=CorrectionConfig("tis", 2.5)
    )
    # ratio to the trainer's own log-probs is 1, so the loss is -(sum of weights * A) / tokens
    assert out.loss.item() == pytest.approx(-(2.0 + 0.5 + 2.5) / 3, rel=1e-5)
    out.loss.backward()
    got = logits.grad.clone()
    logits.grad = None
    w = torch.tensor([[2.0, 0.5, 2.5, 0.0]])
    (-(w * token_logprobs(logits, labels)).sum() / 3).backward()
    assert torch.allclose(got, logits.grad, atol=1e-6)
    assert out.metrics["off_policy/clip_fraction"].item() == pytest.approx(1 / 3, rel=1e-5)
    assert out.metrics["off_policy/mismatch_kl"].item() == pytest.approx(_hand_kl(), rel=1e-5)


def test_without_correction_the_loss_is_unchanged():
    logits, labels = _logits_for(P)
    inference = torch.log(torch.tensor([B]))
    plain = compute_grpo_loss(logits, labels, torch.ones(1), inference_logprobs=inference)
    none = compute_grpo_loss(
        logits,
        labels,
        torch.ones(1),
        inference_logprobs=inference,
        off_policy=CorrectionConfig("none"),
    )
    # PPO clip at 0.2 against the sampler: min(2, 1.2), min(0.5, 0.8), min(3, 1.2)
    assert plain.loss.item() == pytest.approx(-(1.2 + 0.5 + 1.2) / 3, rel=1e-5)
    assert none.loss.item() == pytest.approx(plain.loss.item())
    assert not any(k.startswith("off_policy/") for k in none.metrics)


def test_correction_without_inference_logprobs_is_a_no_op():
    logits, labels = _logits_for(P)
    out = compute_grpo_loss(logits, labels, torch.ones(1), off_policy=CorrectionConfig("tis"))
    assert out.loss.item() == pytest.approx(-1.0, rel=1e-6)
    assert "off_policy/mean_ratio" not in out.metrics


def test_trainer_flags_select_the_correction():
    cfg = config_from_args(
        ["--model-name", "m", "--off-policy-correction", "icepop", "--off-policy-clip", "3"]
    )
    assert (cfg.off_policy_correction, cfg.off_policy_clip, cfg.off_policy_clip_low) == (
        "icepop",
        3.0,
        0.5,
    )
    assert config_from_args(["--model-name", "m"]).off_policy_correction == "none"
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--model-name", "m", "--off-policy-correction", "magic"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        config_from_args(
            ["--model-name", "m", "--off-policy-clip", "1", "--off-policy-clip-low", "2"]
        )


def test_tiny_gaps_still_give_a_positive_mismatch_kl():
    p = torch.tensor([[-1.0, -2.0]])
    _, stats = correction_weights(p, p - 1e-3, torch.ones(1, 2), "tis")
    assert stats["mismatch_kl"].item() == pytest.approx(0.5e-6, rel=1e-2)


def test_batch_staleness_from_policy_versions():
    from example_trainer.off_policy import policy_version_summary, staleness_metrics

    batch = [{"policy_version": [3, 3]}, {"policy_version": [5, 5]}, {"tokens": [[1]]}]
    summary = policy_version_summary(batch)
    assert summary == {"off_policy/policy_version_min": 3.0, "off_policy/policy_version_mean": 4.0}
    assert staleness_metrics(summary, 6) == {
        "off_policy/staleness_max": 3.0,
        "off_policy/staleness_mean": 2.0,
    }
    assert policy_version_summary([{"tokens": [[1]]}]) == {}
    assert staleness_metrics({}, 6) == {}
