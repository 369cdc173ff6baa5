"""The loss options of atropos-grpo against hand computations of the reference formulas
(TRL's GRPOTrainer, verl's core_algos): loss types, reward scaling, clip-higher,
dual-clip, entropy, PPO epochs / mini-batches, truncation masking."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.batching import split_mini_batches
from example_trainer.cli import config_from_args
from example_trainer.config import TrainingConfig
from example_trainer.data import IGNORE_INDEX, group_advantages, group_to_samples
from example_trainer.loss_config import LossConfig
from example_trainer.trainers import GRPOTrainer, prepare_batch
from example_trainer.training import compute_grpo_loss, token_entropy, token_logprobs
from tests.example_trainer.conftest import make_batch


def _two_sequences():
    """Sequence 0 has 2 label tokens with A = 1, sequence 1 has 3 with A = −2 (ratio 1):
    per-token losses −1, −1 and 2, 2, 2."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, requires_grad=True)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [3, 4, 0, IGNORE_INDEX]])
    return logits, labels, torch.tensor([1.0, -2.0])


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("token-mean", (-2 + 6) / 5),  # Σl / N
        ("grpo", (-1 + 2) / 2),  # (1/B) Σ_i mean_t l
        ("seq-mean-token-sum", (-2 + 6) / 2),  # (1/B) Σ_i Σ_t l
        ("dr_grpo", (-2 + 6) / (2 * 10)),  # Σl / (B · max_tokens)
    ],
)
def test_loss_types_match_the_reference_formulas(loss_type, expected):
    logits, labels, adv = _two_sequences()
    out = compute_grpo_loss(
        logits, labels, adv, max_tokens=10, config=LossConfig(loss_type=loss_type)
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["token-mean", "grpo", "seq-mean-token-sum", "dr_grpo"])
def test_loss_types_are_exact_under_gradient_accumulation(loss_type):
    logits, labels, adv = _two_sequences()
    whole = compute_grpo_loss(
        logits, labels, adv, max_tokens=10, config=LossConfig(loss_type=loss_type)
    )
    whole.loss.backward()
    grad = logits.grad.clone()
    logits.grad = None
    for i in range(2):  # one sequence per micro-batch, step-wide counts passed in
        part = compute_grpo_loss(
            logits[i : i + 1],
            labels[i : i + 1],
            adv[i : i + 1],
            normalizer=5,
            num_sequences=2,
            max_tokens=10,
            config=LossConfig(loss_type=loss_type),
        )
        part.loss.backward()
    assert torch.allclose(logits.grad, grad, atol=1e-7)


def test_unknown_loss_type_is_refused():
    logits, labels, adv = _two_sequences()
    with pytest.raises(ValueError, match="loss_type"):
        compute_grpo_loss(logits, labels, adv, config=LossConfig(loss_type="mean"))
    with pytest.raises(SystemExit):
        config_from_args(["--model-name", "m", "--loss-type", "mean"])


def test_reward_scaling_group_batch_and_none():
    # group: (s − mean) / (sample std + 1e-4); [1, 0]: std √0.5.
    assert group_advantages([1.0, 0.0]) == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)]
    )
    # none (Dr. GRPO): only centred.
    assert group_advantages([1.0, 0.0, 0.0, 3.0], "none") == pytest.approx([0.0, -1.0, -1.0, 2.0])
    # batch: centred per group, divided by the std of every score of the batch:
    # [1, 0, 3, 1] has mean 1.25 and sample variance 4.75 / 3.
    groups = [
        {"tokens": [[1, 2, 3]] * 2, "masks": [[-100, 2, 3]] * 2, "scores": [1.0, 0.0]},
        {"tokens": [[1, 2, 3]] * 2, "masks": [[-100, 2, 3]] * 2, "scores": [3.0, 1.0]},
    ]
    std = math.sqrt(4.75 / 3) + 1e-4
    samples = prepare_batch(groups, 1, 4, scale_rewards="batch").shares[0]
    assert [s.advantages[0] for s in samples] == pytest.approx(
        [0.5 / std, -0.5 / std, 1.0 / std, -1.0 / std]
    )
    # A near-constant group no longer blows up to ±1.73.
    assert max(abs(a) for a in group_advantages([1.0, 1.0, 1.0, 1.0 + 1e-7])) < 1e-3


def _ratio_logits(log_ratio: float, adv: float):
    """One label token whose sampler log-prob makes the ratio exp(log_ratio)."""
    logits = torch.tensor([[[0.3, -0.2, 0.1]]], requires_grad=True)
    labels = torch.tensor([[0]])
    old = token_logprobs(logits, labels).detach() - log_ratio
    return logits, labels, torch.tensor([[adv]]), old


def test_clip_higher_widens_only_the_upper_side():
    logits, labels, adv, old = _ratio_logits(math.log(1.25), 1.0)
    sym = compute_grpo_loss(
        logits, labels, adv, inference_logprobs=old, config=LossConfig(clip_eps=0.2)
    )
    assert sym.loss.item() == pytest.approx(-1.2, rel=1e-5)  # clipped at 1 + 0.2
    assert sym.metrics["grpo/clipped_fraction"].item() == 1.0
    high = compute_grpo_loss(
        logits,
        labels,
        adv,
        inference_logprobs=old,
        config=LossConfig(clip_eps=0.2, clip_eps_high=0.28),
    )
    assert high.loss.item() == pytest.approx(-1.25, rel=1e-5)  # inside [0.8, 1.28]
    high.loss.backward()
    assert logits.grad.abs().sum() > 0
    assert high.metrics["grpo/clipped_fraction"].item() == 0.0
    # The lower side stays at 1 − clip_eps: A < 0, ratio 0.75 is clipped at 0.8.
    logits, labels, adv, old = _ratio_logits(math.log(0.75), -1.0)
    low = compute_grpo_loss(
        logits,
        labels,
        adv,
        inference_logprobs=old,
        config=LossConfig(clip_eps=0.2, clip_eps_high=0.28),
    )
    assert low.loss.item() == pytest.approx(0.8, rel=1e-5)
    assert low.metrics["grpo/clipped_fraction"].item() == 1.0


def test_clipped_fraction_counts_only_tokens_whose_gradient_the_clip_removes():
    # A = −1 with ratio 1.5: PPO keeps r·A (the pessimistic side), nothing is clipped.
    logits, labels, adv, old = _ratio_logits(math.log(1.5), -1.0)
    out = compute_grpo_loss(logits, labels, adv, inference_logprobs=old)
    assert out.metrics["grpo/clipped_fraction"].item() == 0.0


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # verl: for A < 0, loss = min(max(−A·r, −A·clip(r)), −A·c).
    logits, labels, adv, old = _ratio_logits(math.log(4.0), -1.0)
    plain = compute_grpo_loss(logits, labels, adv, inference_logprobs=old)
    assert plain.loss.item() == pytest.approx(4.0, rel=1e-5)
    dual = compute_grpo_loss(
        logits, labels, adv, inference_logprobs=old, config=LossConfig(clip_ratio_c=3.0)
    )
    assert dual.loss.item() == pytest.approx(3.0, rel=1e-5)
    dual.loss.backward()
    assert torch.all(logits.grad == 0)
    assert dual.metrics["grpo/dual_clipped_fraction"].item() == 1.0
    # Below c the loss is PPO's; a positive advantage is never dual-clipped.
    logits, labels, adv, old = _ratio_logits(math.log(2.0), -1.0)
    below = compute_grpo_loss(
        logits, labels, adv, inference_logprobs=old, config=LossConfig(clip_ratio_c=3.0)
    )
    assert below.loss.item() == pytest.approx(2.0, rel=1e-5)
    logits, labels, adv, old = _ratio_logits(math.log(4.0), 1.0)
    pos = compute_grpo_loss(
        logits, labels, adv, inference_logprobs=old, config=LossConfig(clip_ratio_c=3.0)
    )
    assert pos.loss.item() == pytest.approx(-1.2, rel=1e-5)
    with pytest.raises(SystemExit):
        config_from_args(["--model-name", "m", "--clip-ratio-c", "0.5"])


def test_entropy_is_logged_and_the_bonus_raises_it():
    # Two-way distribution p = (0.8, 0.2): H = −0.8 ln 0.8 − 0.2 ln 0.2.
    logits = torch.tensor([[[math.log(0.8), math.log(0.2)]]], requires_grad=True)
    labels = torch.tensor([[0]])
    h = -(0.8 * math.log(0.8) + 0.2 * math.log(0.2))
    assert token_entropy(logits).item() == pytest.approx(h, rel=1e-6)
    # At temperature 2 the distribution is ∝ (√0.8, √0.2).
    q = math.sqrt(0.8) / (math.sqrt(0.8) + math.sqrt(0.2))
    h2 = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    assert token_entropy(logits, torch.tensor([2.0])).item() == pytest.approx(h2, rel=1e-6)
    zero = torch.zeros(1, 1)
    logged = compute_grpo_loss(logits, labels, zero, config=LossConfig(log_entropy=True))
    assert logged.metrics["train/entropy"].item() == pytest.approx(h, rel=1e-6)
    assert logged.loss.item() == pytest.approx(0.0, abs=1e-7)
    bonus = compute_grpo_loss(logits, labels, zero, config=LossConfig(entropy_coef=0.1))
    assert bonus.loss.item() == pytest.approx(-0.1 * h, rel=1e-6)
    bonus.loss.backward()
    with torch.no_grad():
        assert token_entropy(logits - logits.grad).item() > h  # descending raises entropy


def test_mask_truncated_drops_the_labels_of_cut_and_length_stopped_sequences():
    group = {
        "tokens": [list(range(1, 21)), [1, 2, 3, 4], [1, 2, 3, 4]],
        "masks": [[-100] + list(range(2, 21)), [-100, 2, 3, 4], [-100, 2, 3, 4]],
        "scores": [1.0, 0.0, 1.0],
        "overrides": [{}, {"finish_reason": "length"}, {"finish_reason": "stop"}],
    }
    kept = group_to_samples(group, max_len=8)
    assert [s.truncated for s in kept] == [True, True, False]
    assert kept[0].num_label_tokens == 8  # cut, still trained
    masked = group_to_samples(group, max_len=8, mask_truncated=True)
    assert [s.num_label_tokens for s in masked] == [0, 0, 3]
    # The advantages still come from the whole group, as TRL computes them before masking.
    assert masked[2].advantages == kept[2].advantages


def test_mask_truncated_in_the_loss(tiny_model_dir, tmp_path):
    from tests.example_trainer.test_trainer_fixes import _long_and_short_group

    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        save_path=str(tmp_path),
        device="cpu",
        optimizer="adamw",
        batch_size=4,
        pad_to_multiple=8,
        seq_len=16,
        mask_truncated=True,
        progress=False,
    )
    m = GRPOTrainer(cfg).train_on_batch([_long_and_short_group()])
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    # Only the short sequence (A = −a, 8 tokens) is trained: loss = −(−a·8) / 8.
    assert m["train/num_tokens"] == 8
    assert m["train/loss"] == pytest.approx(a, rel=1e-5)


def test_mini_batches_split_the_batch_and_count_each_part():
    samples = list(range(7))
    assert split_mini_batches(samples, 3) == [[0, 1], [2, 3], [4, 5, 6]]
    groups = [
        {"tokens": [[1, 2, 3, 4]] * 2, "masks": [[-100, 2, 3, 4]] * 2, "scores": [1.0, 0.0]},
        {"tokens": [[1, 2, 3]] * 2, "masks": [[-100, 2, 3]] * 2, "scores": [1.0, 0.0]},
    ]
    prepared = prepare_batch(groups, 1, micro_size=1, mini_batches=2)
    assert [(m.label_tokens, m.num_sequences, m.n_micro) for m in prepared.minis] == [
        (6, 2, 2),
        (4, 2, 2),
    ]


def _trainer(model_dir, path, **kw):
    settings = dict(
        model_name=str(model_dir),
        save_path=str(path),
        device="cpu",
        optimizer="adamw",
        lr=1e-2,
        batch_size=4,
        pad_to_multiple=8,
        progress=False,
    )
    return GRPOTrainer(TrainingConfig(**{**settings, **kw}))


def test_ppo_epochs_and_mini_batches_take_that_many_optimizer_steps(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4)
    for epochs, minis in ((1, 1), (2, 1), (1, 2), (2, 2)):
        trainer = _trainer(
            tiny_model_dir, tmp_path / f"{epochs}{minis}", ppo_epochs=epochs, mini_batches=minis
        )
        m = trainer.train_on_batch(batch)
        steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
        assert steps == {float(epochs * minis)}
        assert trainer.scheduler.last_epoch == 1  # the schedule follows batches
        if epochs * minis == 1:
            assert m["grpo/mean_ratio"] == pytest.approx(1.0)
        else:
            # Later updates see a policy that has moved from the pre-update log-probs:
            # the ratio against them is no longer 1 everywhere.
            assert m["grpo/mean_ratio"] != pytest.approx(1.0, abs=1e-6)
        assert m["train/num_tokens"] == pytest.approx(prepare_batch(batch, 1, 4).label_tokens)


def test_a_second_epoch_clips_against_the_policy_before_the_batch(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    # Two epochs with lr high enough to move every ratio past 1 ± ε in the direction of its
    # advantage: the second epoch's clipped fraction is positive, which a ratio against
    # the current policy (always 1) could never give.
    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4)
    trainer = _trainer(tiny_model_dir, tmp_path, ppo_epochs=2, lr=0.05, clip_eps=0.01)
    m = trainer.train_on_batch(batch)
    assert m["grpo/clipped_fraction"] > 0


def test_loss_option_flags_reach_the_config():
    c = config_from_args(
        [
            "--model-name", "m",
            "--loss-type", "dr_grpo",
            "--scale-rewards", "none",
            "--clip-eps-high", "0.28",
            "--clip-ratio-c", "3",
            "--ppo-epochs", "2",
            "--mini-batches", "4",
            "--mask-truncated",
            "--entropy-coef", "0.01",
            "--log-entropy", "false",
            "--disable-dropout",
        ]
    )  # fmt: skip
    assert (c.loss_type, c.scale_rewards, c.clip_eps_high, c.clip_ratio_c) == (
        "dr_grpo",
        "none",
        0.28,
        3.0,
    )
    assert (c.ppo_epochs, c.mini_batches, c.mask_truncated) == (2, 4, True)
    assert (c.entropy_coef, c.log_entropy, c.disable_dropout) == (0.01, False, True)
    d = config_from_args(["--model-name", "m"])
    assert (d.loss_type, d.scale_rewards, d.clip_eps_high, d.clip_ratio_c) == (
        "token-mean",
        "group",
        None,
        None,
    )
    assert (d.ppo_epochs, d.mini_batches, d.mask_truncated, d.entropy_coef) == (1, 1, False, 0.0)


def test_logged_entropy_in_chunks_equals_the_whole_computation(monkeypatch):
    import example_trainer.training as training

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    temps = torch.tensor([1.0, 0.5, 2.0])
    whole = token_entropy(logits.requires_grad_(True), temps).detach()
    monkeypatch.setattr(training, "ENTROPY_CHUNK", 4)  # 15 positions: chunks of 4, last of 3
    with torch.no_grad():
        chunked = token_entropy(logits, temps)
    assert torch.allclose(chunked, whole, atol=1e-6)
