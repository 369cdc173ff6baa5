"""The loss options against the formulas of the implementations users switch from, each
re-implemented here from its published definition (TRL's GRPOTrainer, verl's core_algos,
DAPO): KL estimators and their clamps, GSPO's sequence-level ratio, truncated importance
sampling, KL in the reward, the soft overlong penalty, and an fp32 LM head."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from example_trainer.data import group_advantages, group_to_samples, overlong_penalty
from example_trainer.kl import kl_penalty
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import CorrectionConfig
from example_trainer.reward_shaping import shaped_advantages
from example_trainer.training import grpo_loss, token_logprobs


def _case(seed: int = 0, b: int = 3, t: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :2] = -100
    labels[2, -1] = -100
    mask = (labels != -100).float()
    logp = token_logprobs(logits, labels)
    # sampler log-probs 0.4 nats around the trainer's: some ratios leave [0.8, 1.2]
    sampler = (logp + 0.4 * torch.randn(b, t, generator=g)).clamp(max=-1e-3)
    adv = torch.tensor([1.0, -0.7, 0.4]).view(-1, 1).expand(b, t).contiguous()
    return logits, labels, mask, sampler, adv


def _grad(loss_fn, logits):
    x = logits.clone().requires_grad_(True)
    loss = loss_fn(x)
    loss.backward()
    return loss.detach(), x.grad


# --- KL estimators (verl core_algos.kl_penalty) ----------------------------------------------


def _verl_kl(logprob, ref_logprob, kind):
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


@pytest.mark.parametrize("ours, verl", [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")])
def test_kl_estimators_equal_verls(ours, verl):
    logp = -torch.rand(50, dtype=torch.float64) * 5
    ref = logp + torch.linspace(-3, 3, 50, dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, ours), _verl_kl(logp, ref, verl))


def test_k3_is_clamped_where_it_used_to_explode():
    logp = torch.tensor([-16.0, -96.0, -1.0])
    ref = torch.tensor([-1.0, -1.0, -1.5])  # log-ratios ref − policy: 15, 95, −0.5
    kl = kl_penalty(logp, ref, "k3")
    # unclamped: e^15 − 16 ≈ 3.3e6 and inf; clamped to 10; the last is e^−0.5 + 0.5 − 1
    assert kl.tolist() == pytest.approx([10.0, 10.0, math.exp(-0.5) - 0.5])
    # In the loss: one such token among 4 adds kl_coef·10/4, and gets no KL gradient.
    logits = torch.zeros(1, 4, 3)
    logits[0, 0, 0] = -20.0  # label 0 at position 0 is very unlikely under the policy
    labels = torch.zeros(1, 4, dtype=torch.long)
    x = logits.clone().requires_grad_(True)
    ref_lp = token_logprobs(logits, labels).clone()
    ref_lp[0, 0] = -1.0
    out = grpo_loss(
        x, labels, torch.zeros(1, 4), ref_logprobs=ref_lp, config=LossConfig(kl_coef=0.1)
    )
    assert float(out.loss) == pytest.approx(0.1 * 10 / 4)
    out.loss.backward()
    assert float(x.grad[0, 0].abs().max()) == 0.0


# --- GSPO (TRL importance_sampling_level="sequence") -----------------------------------------


def _trl_gspo_loss(logits, labels, adv, old, eps_low, eps_high):
    mask = (labels != -100).float()
    logp = token_logprobs(logits, labels)
    log_ratio = logp - old
    log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    return (per_token * mask).sum() / mask.sum()


def test_sequence_level_ratio_equals_trls_gspo_loss_and_gradient():
    logits, labels, mask, sampler, adv = _case(1)
    ours_loss, ours_grad = _grad(
        lambda x: grpo_loss(x, labels, adv, inference_logprobs=sampler, config=LossConfig(clip_eps=0.05, importance_sampling_level="sequence")).loss,
        logits,
    )  # fmt: skip
    ref_loss, ref_grad = _grad(
        lambda x: _trl_gspo_loss(x, labels, adv, sampler, 0.05, 0.05), logits
    )
    torch.testing.assert_close(ours_loss, ref_loss)
    torch.testing.assert_close(ours_grad, ref_grad)
    # and it is not the token-level loss
    token = grpo_loss(
        logits, labels, adv, inference_logprobs=sampler, config=LossConfig(clip_eps=0.05)
    ).loss
    assert abs(float(token) - float(ref_loss)) > 1e-4


# --- truncated importance sampling (TRL vllm_importance_sampling_correction) -----------------


def _trl_tis_loss(logits, labels, adv, sampler, eps, cap):
    mask = (labels != -100).float()
    logp = token_logprobs(logits, labels)
    old = logp.detach()  # one optimizer step per generation batch
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    is_ratio = torch.clamp(torch.exp(old - sampler), max=cap)
    per_token = per_token * is_ratio
    return (per_token * mask).sum() / mask.sum()


def test_tis_truncate_equals_trls_correction_and_differs_from_clip_zone_zero():
    logits, labels, mask, sampler, adv = _case(2)
    truncate = CorrectionConfig("tis", clip=1.5, tis_mode="truncate")
    ours_loss, ours_grad = _grad(
        lambda x: (
            grpo_loss(
                x, labels, adv, inference_logprobs=sampler, config=LossConfig(off_policy=truncate)
            ).loss
        ),
        logits,
    )
    ref_loss, ref_grad = _grad(lambda x: _trl_tis_loss(x, labels, adv, sampler, 0.2, 1.5), logits)
    torch.testing.assert_close(ours_loss, ref_loss)
    torch.testing.assert_close(ours_grad, ref_grad)
    zero = CorrectionConfig("tis", clip=1.5)
    _, zero_grad = _grad(
        lambda x: (
            grpo_loss(
                x, labels, adv, inference_logprobs=sampler, config=LossConfig(off_policy=zero)
            ).loss
        ),
        logits,
    )
    assert not torch.allclose(zero_grad, ref_grad)  # the clip zone gets 0 there


def test_tis_truncate_under_several_epochs_clips_against_the_trainers_old_policy():
    logits, labels, mask, sampler, adv = _case(3)
    old = token_logprobs(logits, labels) - 0.3 * mask  # the policy before the first update
    cfg = CorrectionConfig("tis", clip=2.0, tis_mode="truncate")
    ours = grpo_loss(
        logits,
        labels,
        adv,
        inference_logprobs=sampler,
        old_logprobs=old,
        config=LossConfig(off_policy=cfg),
    ).loss
    logp = token_logprobs(logits, labels)
    r = torch.exp(logp - old)
    w = torch.exp(old - sampler).clamp(max=2.0)
    expected = (-torch.min(r * adv, r.clamp(0.8, 1.2) * adv) * w * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, expected)


# --- KL in the reward (verl use_kl_in_reward + GRPO outcome advantage) -----------------------


def test_kl_in_reward_shapes_the_scores_before_the_group_advantages():
    scores, groups = [1.0, 0.0, 0.0, 1.0, 0.5, 0.2], [0, 0, 0, 0, 1, 1]
    kl = [2.0, 0.0, 1.0, 0.0, 3.0, 0.0]
    got = shaped_advantages(scores, groups, kl, 0.1, "group")
    g0 = np.array([0.8, 0.0, -0.1, 1.0])
    g1 = np.array([0.2, 0.2])
    expected = list((g0 - g0.mean()) / (g0.std(ddof=1) + 1e-4)) + list(
        (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-4)
    )
    assert got == pytest.approx(expected)
    assert group_advantages([0.8, 0.0, -0.1, 1.0]) == pytest.approx(got[:4])


# --- DAPO soft overlong punishment (verl overlong_buffer) ------------------------------------


def _verl_overlong(valid_response_length, max_resp_len, buffer_len, factor):
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


@pytest.mark.parametrize("length", [10, 80, 81, 90, 100, 110])
def test_overlong_penalty_equals_verls(length):
    assert overlong_penalty(length, 100, 20, 0.5) == pytest.approx(
        _verl_overlong(length, 100, 20, 0.5)
    )
    assert overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)  # by hand


def test_overlong_penalty_enters_the_scores_before_the_advantages():
    tokens = [[1] * 4 + [5] * n for n in (2, 9, 12)]
    masks = [[-100] * 4 + [5] * n for n in (2, 9, 12)]
    group = {"tokens": tokens, "masks": masks, "scores": [1.0, 1.0, 0.0]}
    samples = group_to_samples(group, overlong=(12, 4, 1.0))
    # trained tokens 2, 9, 12 with max 12, buffer 4: penalties 0, −0.25, −1
    shaped = [1.0, 0.75, -1.0]
    assert [s.advantages[0] for s in samples] == pytest.approx(group_advantages(shaped))


# --- fp32 LM head --------------------------------------------------------------------------


def test_fp32_lm_head_computes_the_logits_in_float32_under_bf16_autocast(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from example_trainer.precision import fp32_lm_head

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    seen = {}
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda m, i, o: seen.update(hidden=i[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16
    assert fp32_lm_head(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    expected = seen["hidden"].float() @ head.weight.float().T
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_kl_in_reward_trains_as_if_the_scores_were_shaped(tiny_model_dir, tiny_tokenizer, tmp_path):
    from example_trainer.config import TrainingConfig
    from example_trainer.trainers import GRPOTrainer
    from tests.example_trainer.conftest import make_batch

    def trainer(path, **kw):
        return GRPOTrainer(
            TrainingConfig(
                model_name=str(tiny_model_dir), save_path=str(path), device="cpu",
                optimizer="adamw", batch_size=8, pad_to_multiple=8, progress=False, **kw,
            )
        )  # fmt: skip

    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4, seed=6)
    # Sequence 0 of group 0 has an env reference far below the policy: every trained token's
    # k3 saturates at 10; the others' reference is the (identical) starting policy: KL 0.
    g0 = batch[0]
    g0["ref_logprobs"] = [[-1000.0] * len(g0["tokens"][0])] + [None] * 3
    n0 = sum(1 for m in g0["masks"][0][1:] if m != -100)
    shaped = [{**g, "scores": list(g["scores"])} for g in batch]
    shaped[0]["scores"][0] -= 0.05 * 10 * n0
    for g in shaped:
        g.pop("ref_logprobs", None)
    with_kl = trainer(tmp_path / "a", kl_coef=0.05, kl_in_reward=True).train_on_batch(batch)
    by_hand = trainer(tmp_path / "b").train_on_batch(shaped)
    assert with_kl["train/grad_norm"] == pytest.approx(by_hand["train/grad_norm"], rel=1e-5)
    assert with_kl["train/loss"] == pytest.approx(by_hand["train/loss"], rel=1e-5, abs=1e-7)
    assert with_kl["train/kl"] > 0  # logged, not in the loss


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"kl_in_reward": True}, "kl_coef"),
        ({"importance_sampling_level": "sequence", "off_policy_correction": "icepop"}, "sequence"),
        ({"importance_sampling_level": "sequence", "off_policy_correction": "tis"}, "tis_mode"),
        ({"overlong_penalty_len": 64, "seq_len": 64}, "overlong_penalty_len"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
    ],
)
def test_impossible_loss_option_combinations_are_refused_naming_the_field(fields, named):
    from pydantic import ValidationError

    from example_trainer.config import TrainingConfig

    with pytest.raises(ValidationError, match=named):
        TrainingConfig(model_name="m", device="cpu", **fields)
