"""The trainer's failure modes fixed by issue 23: one bad sample must not turn the weights
into NaN, greedy groups must score, the KL anchor must survive --resume, a sequence's
ratio must not depend on its micro-batch neighbours, and cut sequences count only what
is trained."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from example_trainer.checkpointing import save_checkpoint
from example_trainer.data import (
    IGNORE_INDEX,
    GroupError,
    group_to_samples,
    pad_data_to_good_offset,
    sequence_temperature,
)
from example_trainer.model import load_model
from example_trainer.policy_update import TrainingDivergedError
from example_trainer.trainers import GRPOTrainer, prepare_batch
from example_trainer.training import compute_grpo_loss, token_logprobs
from tests.example_trainer.conftest import cpu_config, make_batch


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --- 1. one absurd sampler log-prob --------------------------------------------------------


def test_an_absurd_sampler_logprob_gives_a_finite_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (1, 4), generator=g)
    inference = token_logprobs(logits, labels).detach()
    inference[0, 2] = -9999.0  # what vLLM writes for some tokens
    out = compute_grpo_loss(logits, labels, -torch.ones(1, 4), inference_logprobs=inference)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logits.grad).all()
    # The clamped log-ratio (±20) leaves that token a large but finite ratio and no gradient.
    assert torch.all(logits.grad[0, 2] == 0)
    assert logits.grad[0, [0, 1, 3]].abs().sum() > 0


class _PoisonLogits:
    """A forward hook that makes the policy's logits NaN while ``on`` (an overflow in the
    forward pass, the usual source of a non-finite gradient)."""

    def __init__(self, model) -> None:
        self.on = False
        model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if self.on:
            output.logits = output.logits * math.nan
        return output


def _nan_step(trainer, poison, tokenizer, seed=0):
    poison.on = True
    try:
        return trainer.train_on_batch(make_batch(tokenizer, seed=seed, with_logprobs=True))
    finally:
        poison.on = False


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path))
    poison = _PoisonLogits(trainer.model)
    before = _weights(trainer.model)
    m = _nan_step(trainer, poison, tiny_tokenizer)
    assert math.isnan(m["train/grad_norm"])
    assert m["train/skipped_steps"] == 1.0
    after = _weights(trainer.model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.isfinite(p).all() for p in after)
    assert not trainer.optimizer.state  # AdamW never saw the NaN gradient
    # A good batch afterwards trains normally and the count stays.
    m = trainer.train_on_batch(make_batch(tiny_tokenizer, seed=1, with_logprobs=True))
    assert math.isfinite(m["train/grad_norm"]) and m["train/skipped_steps"] == 1.0
    assert any(
        not torch.equal(a, b) for a, b in zip(after, trainer.model.parameters(), strict=True)
    )


def test_the_run_stops_after_n_skipped_steps_in_a_row(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, max_consecutive_skipped_steps=2))
    poison = _PoisonLogits(trainer.model)
    _nan_step(trainer, poison, tiny_tokenizer)
    trainer.train_on_batch(make_batch(tiny_tokenizer, seed=1))  # resets the run of skips
    _nan_step(trainer, poison, tiny_tokenizer)
    with pytest.raises(TrainingDivergedError, match="2 optimizer steps in a row"):
        _nan_step(trainer, poison, tiny_tokenizer)
    assert trainer.skipped_steps == 3


# --- 2. temperature 0 --------------------------------------------------------------------


def test_greedy_temperature_is_scored_at_one():
    assert sequence_temperature(0, None, {"temperature": 0.0}, None) == 1.0
    assert sequence_temperature(0, [{"temperature": 0}], None, None) == 1.0
    assert sequence_temperature(0, None, {"temperature": 0.7}, None) == 0.7


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, "hot"])
def test_negative_or_non_finite_temperature_is_rejected_naming_the_field(bad):
    group = {
        "tokens": [[1, 2, 3]],
        "masks": [[-100, 2, 3]],
        "scores": [1.0],
        "generation_params": {"temperature": bad},
    }
    with pytest.raises(GroupError, match="generation_params: temperature"):
        group_to_samples(group)


def test_a_batch_with_a_rejected_group_trains_on_the_rest_and_counts_it(caplog):
    good = {
        "tokens": [[1, 2, 3], [1, 2, 4]],
        "masks": [[-100, 2, 3], [-100, 2, 4]],
        "scores": [1, 0],
    }
    bad = {**good, "overrides": [{"temperature": -1.0}, {}], "env_id": 3}
    prepared = prepare_batch([good, bad], 1, 4)
    assert len(prepared.shares[0]) == 2
    assert prepared.summary["train/rejected_groups"] == 1.0
    assert "group 1 of the batch (env_id 3) skipped: overrides[0]: temperature" in caplog.text


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("scores", [math.nan, 0.0], "scores\\[0\\] is nan"),
        ("advantages", [[0.0, 1.0, 1.0], [0.0, math.inf, 1.0]], "advantages\\[1\\]"),
    ],
)
def test_non_finite_scores_or_advantages_reject_the_group(field, value, message):
    group = {"tokens": [[1, 2, 3]] * 2, "masks": [[-100, 2, 3]] * 2, "scores": [1.0, 0.0]}
    group[field] = value
    with pytest.raises(GroupError, match=message):
        group_to_samples(group)


def test_a_greedy_group_trains_to_finite_weights(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path))
    batch = make_batch(tiny_tokenizer, with_logprobs=True)
    batch[0]["generation_params"] = {"temperature": 0.0}
    m = trainer.train_on_batch(batch)
    assert math.isfinite(m["train/loss"]) and math.isfinite(m["train/grad_norm"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# --- 3. the KL reference after --resume ---------------------------------------------------


def test_kl_reference_after_resume_is_the_starting_policy(tiny_model_dir, tiny_tokenizer, tmp_path):
    cfg = cpu_config(tiny_model_dir, tmp_path, kl_coef=0.1, lr=1e-2)
    t1 = GRPOTrainer(cfg)
    t1.train_on_batch(make_batch(tiny_tokenizer, with_logprobs=True))
    t1.step = 1
    save_checkpoint(t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, 1, tmp_path)
    t2 = GRPOTrainer(cfg.model_copy(update={"resume": True}))
    initial = load_model(str(tiny_model_dir), cfg).state_dict()
    trained = t1.model.state_dict()
    ref = t2.ref_model.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    for name, value in ref.items():
        assert torch.equal(value, initial[name]), name
    assert not any(p.requires_grad for p in t2.ref_model.parameters())


# --- 4. sampler log-probs per sequence ----------------------------------------------------


def _mixed_batch(tokenizer):
    """Two groups: the first carries inference_logprobs, the second does not."""
    with_lp = make_batch(tokenizer, n_groups=1, group_size=4, seed=3, with_logprobs=True)
    without = make_batch(tokenizer, n_groups=1, group_size=4, seed=4)
    return with_lp + without


def test_the_gradient_does_not_depend_on_micro_batch_composition(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    runs = []
    for micro in (4, 8, 3):
        trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path / str(micro), batch_size=micro))
        runs.append(trainer.train_on_batch(_mixed_batch(tiny_tokenizer)))
    norms = [m["train/grad_norm"] for m in runs]
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert norms[2] == pytest.approx(norms[0], rel=1e-4)
    assert runs[1]["train/loss"] == pytest.approx(runs[0]["train/loss"], rel=1e-4, abs=1e-7)
    for m in runs:  # the share of label tokens with a sampler log-prob, wherever they landed
        assert m["grpo/has_inference_logprobs"] == pytest.approx(
            runs[0]["grpo/has_inference_logprobs"]
        )
        assert 0.3 < m["grpo/has_inference_logprobs"] < 0.7


def test_collate_marks_which_tokens_have_sampler_logprobs():
    a = {"tokens": [[1, 2, 3, 4]], "masks": [[-100, 2, 3, 4]], "scores": [1.0]}
    b = {**a, "inference_logprobs": [[1.0, -0.1, -0.2, -0.3]]}
    short = {**a, "inference_logprobs": [[1.0, -0.1]]}
    marker = {**a, "inference_logprobs": [[1.0, -0.1, 1.0, -0.3]]}
    mb = pad_data_to_good_offset([b, a, short, marker], 4, pad_to_multiple=1)[0]
    assert mb.inference_mask.tolist() == [
        [True, True, True],
        [False, False, False],
        [True, False, False],
        [True, False, True],
    ]
    assert mb.inference_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    # Tokens without a sampler log-prob hold the 1.0 marker, never a fake log-prob.
    assert mb.inference_logprobs[2].tolist() == pytest.approx([-0.1, 1.0, 1.0])
    assert pad_data_to_good_offset([a], 2)[0].inference_mask is None
    assert [group_to_samples(g)[0].short_logprobs for g in (b, a, short, marker)] == [
        False,
        False,
        True,
        False,
    ]


def test_a_short_inference_logprobs_row_trains_its_tail_at_ratio_one():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3, 5, generator=g, requires_grad=True)
    labels = torch.tensor([[1, 2, 3]])
    own = token_logprobs(logits, labels).detach()
    short = {"tokens": [[0, 1, 2, 3]], "masks": [[-100, 1, 2, 3]], "scores": [1.0]}
    short["inference_logprobs"] = [[1.0, float(own[0, 0])]]
    mb = pad_data_to_good_offset([short], 1, pad_to_multiple=1)[0]
    out = compute_grpo_loss(
        logits,
        labels,
        torch.ones(1, 3),
        inference_logprobs=mb.inference_logprobs,
        inference_mask=mb.inference_mask,
    )
    # Every token at ratio 1 (the first matches the sampler, the rest have none): loss −1.
    # Padding the row with 1.0 gave ratios exp(logp − 1) < 0.37 and a loss near −0.8.
    assert out.metrics["grpo/mean_ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert out.loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert out.metrics["grpo/has_inference_logprobs"].item() == pytest.approx(1 / 3)


# --- 5. truncation ----------------------------------------------------------------------


def _long_and_short_group():
    long_tokens = list(range(5, 35))  # 30 tokens: 29 labels, cut to 16 inputs
    short_tokens = list(range(5, 15))  # 10 tokens: 9 labels
    return {
        "tokens": [long_tokens, short_tokens],
        "masks": [[IGNORE_INDEX] * 2 + long_tokens[2:], [IGNORE_INDEX] * 2 + short_tokens[2:]],
        "scores": [1.0, 0.0],
    }


def test_cut_sequences_count_only_the_tokens_trained():
    prepared = prepare_batch([_long_and_short_group()], 1, 4, seq_len=16)
    long, short = prepared.shares[0]
    assert len(long.input_ids) == 16 and long.cut and long.truncated and not short.cut
    assert prepared.label_tokens == 15 + 8
    assert prepared.summary["train/cut_sequences"] == 1.0
    assert prepared.summary["train/truncated_sequences"] == 1.0


def test_the_loss_divisor_is_the_tokens_present_after_the_cut(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, seq_len=16))
    m = trainer.train_on_batch([_long_and_short_group()])
    a = 0.5 / (np.sqrt(0.5) + 1e-4)  # advantages ±a
    # Ratio 1 (no sampler log-probs): loss = -(15·a − 8·a) / (15 + 8).
    assert m["train/num_tokens"] == 23
    assert m["train/loss"] == pytest.approx(-(15 * a - 8 * a) / 23, rel=1e-5)
    assert m["train/cut_sequences"] == 1.0
