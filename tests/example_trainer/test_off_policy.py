"""Off-policy correction (tis, icepop): the clipped surrogate against the sampler with its
ratio truncated or masked, checked token by token against hand computations (values,
gradients, statistics), its place in the GRPO loss, and the trainer flags."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.cli import config_from_args
from example_trainer.data import IGNORE_INDEX
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import CorrectionConfig, corrected_surrogate
from example_trainer.training import compute_grpo_loss, token_logprobs

EPS = 0.2


def _surrogate(ratios, advantages, mode, clip=2.0, clip_low=0.5, mask=None):
    """Surrogate, d(surrogate)/d(logp) and statistics of tokens with the given ratios to the sampler."""
    b = torch.log(torch.full((1, len(ratios)), 0.1))
    p = (b + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    adv = torch.tensor([advantages])
    mask = torch.ones(1, len(ratios)) if mask is None else torch.tensor([mask])
    surrogate, ratio, stats = corrected_surrogate(
        p, b, adv, mask, EPS, CorrectionConfig(mode, clip, clip_low)
    )
    surrogate.sum().backward()
    return surrogate.detach()[0].tolist(), p.grad[0].tolist(), stats


def test_tis_keeps_the_trust_region_for_a_positive_advantage():
    # r = 1.5 > 1 + eps with A > 0: PPO's clip already took this step; no gradient
    # (the old formulation, a ratio against the trainer's own log-probs, gave 1.5·A).
    value, grad, _ = _surrogate([1.5], [1.0], "tis")
    assert value == pytest.approx([1.2])
    assert grad == [0.0]


def test_tis_bounds_a_negative_advantage_with_a_huge_ratio_by_the_clip():
    # r = 50, A = -2: the plain clipped surrogate would push with 50·A; tis with C·A.
    value, grad, stats = _surrogate([50.0], [-2.0], "tis", clip=2.5)
    assert value == pytest.approx([-5.0])
    assert grad == pytest.approx([-5.0])
    assert stats["clip_fraction"].item() == 1.0
    _, grad_none, _ = _surrogate([50.0], [-2.0], "icepop", clip=100.0, clip_low=0.0)
    assert grad_none == pytest.approx([-100.0], rel=1e-4)


def test_tis_equals_the_plain_surrogate_below_the_clip():
    ratios, adv = [0.5, 0.9, 1.1, 1.5, 1.9], [1.0, -1.0, 1.0, -1.0, -0.5]
    value, grad, stats = _surrogate(ratios, adv, "tis", clip=2.0)
    want = [min(r * a, min(max(r, 1 - EPS), 1 + EPS) * a) for r, a in zip(ratios, adv, strict=True)]
    assert value == pytest.approx(want, rel=1e-5)
    # The unclipped branch has gradient r·A (d r / d logp = r); the clipped one none.
    assert grad == pytest.approx([0.5, -0.9, 1.1, -1.5, -0.95], rel=1e-5)
    assert stats["clip_fraction"].item() == 0.0


def test_a_tis_clip_below_one_plus_eps_truncates_without_opening_the_trust_region():
    value, grad, _ = _surrogate([1.5, 1.15, 1.05, 3.0], [1.0, 1.0, 1.0, -1.0], "tis", clip=1.1)
    assert grad == pytest.approx([0.0, 1.1, 1.05, -1.1], rel=1e-5)
    assert value[0] == pytest.approx(1.2)


def test_icepop_masks_ratios_outside_the_band_and_clips_the_rest_as_ppo():
    value, grad, stats = _surrogate(
        [3.0, 0.3, 1.1, 1.5, 0.7], [1.0, -1.0, 1.0, 1.0, -1.0], "icepop", clip=2.0, clip_low=0.5
    )
    assert value == pytest.approx([0.0, 0.0, 1.1, 1.2, -0.8], rel=1e-5)
    assert grad == pytest.approx([0.0, 0.0, 1.1, 0.0, 0.0], rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)


def test_statistics_against_a_hand_computation_over_label_tokens_only():
    ratios = [2.0, 0.5, 3.0, 7.0]
    _, grad, stats = _surrogate(ratios, [1.0] * 4, "tis", clip=2.5, mask=[1.0, 1.0, 1.0, 0.0])
    assert grad[3] == 0.0
    assert stats["mean_ratio"].item() == pytest.approx(5.5 / 3, rel=1e-5)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3, rel=1e-5)
    kl = sum(r - 1 - math.log(r) for r in ratios[:3]) / 3
    assert stats["mismatch_kl"].item() == pytest.approx(kl, rel=1e-5)


@pytest.mark.parametrize("mode", ["tis", "icepop"])
def test_equal_policies_give_the_plain_surrogate_and_zero_kl(mode):
    value, grad, stats = _surrogate([1.0, 1.0], [1.0, -0.5], mode)
    assert value == pytest.approx([1.0, -0.5]) and grad == pytest.approx([1.0, -0.5])
    assert stats["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert stats["clip_fraction"].item() == 0.0


def test_unknown_mode_and_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="not one of"):
        CorrectionConfig("ppo")
    with pytest.raises(ValueError):
        CorrectionConfig("icepop", clip=1.0, clip_low=2.0)


# Trainer probabilities p and sampler probabilities b of three label tokens: ratios 2, 0.5, 3.
P = [0.5, 0.2, 0.9]
B = [0.25, 0.4, 0.3]


def _logits_for(probs: list[float], dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way logits whose label-0 probability is each of ``probs``."""
    q = torch.tensor(probs)
    logits = torch.stack([q.log(), (1 - q).log()], dim=-1).unsqueeze(0).to(dtype)
    labels = torch.zeros(1, len(probs), dtype=torch.long)
    return logits.requires_grad_(True), labels


def test_tis_loss_and_gradient_in_the_grpo_loss():
    logits, labels = _logits_for(P + [0.7])
    labels[0, 3] = IGNORE_INDEX
    inference = torch.log(torch.tensor([B + [1.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    out = compute_grpo_loss(
        logits,
        labels,
        adv,
        inference_logprobs=inference,
        config=LossConfig(off_policy=CorrectionConfig("tis", 2.5)),
    )
    # ratio 2 (A > 0): clipped at 1.2, no gradient; 0.5 (A > 0): 0.5·A; 3 (A < 0): 2.5·A.
    assert out.loss.item() == pytest.approx(-(1.2 + 0.5 - 2.5) / 3, rel=1e-5)
    out.loss.backward()
    got = logits.grad.clone()
    logits.grad = None
    w = torch.tensor([[0.0, 0.5, -2.5, 0.0]])
    (-(w * token_logprobs(logits, labels)).sum() / 3).backward()
    assert torch.allclose(got, logits.grad, atol=1e-6)
    assert out.metrics["off_policy/clip_fraction"].item() == pytest.approx(1 / 3, rel=1e-5)
    # Only the ratio-2 token (A > 0, past 1.2) loses its gradient to PPO's clip.
    assert out.metrics["grpo/clipped_fraction"].item() == pytest.approx(1 / 3, rel=1e-5)


def test_bf16_logits_give_the_fp32_loss_and_gradient_on_the_cpu():
    inference = torch.log(torch.tensor([B]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    grads, losses = [], []
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels = _logits_for(P, dtype)
        out = compute_grpo_loss(
            logits,
            labels,
            adv,
            inference_logprobs=inference,
            config=LossConfig(off_policy=CorrectionConfig("tis")),
        )
        out.loss.backward()
        assert out.loss.dtype == torch.float32 and logits.grad.dtype == dtype
        losses.append(out.loss.item())
        grads.append(logits.grad.float())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)
    assert torch.allclose(grads[1], grads[0], atol=2e-2)


def test_without_correction_the_loss_is_unchanged():
    logits, labels = _logits_for(P)
    inference = torch.log(torch.tensor([B]))
    plain = compute_grpo_loss(logits, labels, torch.ones(1), inference_logprobs=inference)
    none = compute_grpo_loss(
        logits,
        labels,
        torch.ones(1),
        inference_logprobs=inference,
        config=LossConfig(off_policy=CorrectionConfig("none")),
    )
    # PPO clip at 0.2 against the sampler: min(2, 1.2), min(0.5, 0.8), min(3, 1.2)
    assert plain.loss.item() == pytest.approx(-(1.2 + 0.5 + 1.2) / 3, rel=1e-5)
    assert none.loss.item() == pytest.approx(plain.loss.item())
    assert not any(k.startswith("off_policy/") for k in none.metrics)


def test_correction_without_inference_logprobs_is_a_no_op():
    logits, labels = _logits_for(P)
    out = compute_grpo_loss(
        logits, labels, torch.ones(1), config=LossConfig(off_policy=CorrectionConfig("tis"))
    )
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
    _, _, stats = corrected_surrogate(
        p, p - 1e-3, torch.ones(1, 2), torch.ones(1, 2), EPS, CorrectionConfig("tis")
    )
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
