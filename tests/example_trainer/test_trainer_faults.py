"""Faults of the trainer found by comparing it with TRL and verl: metrics under several
optimizer steps per batch compare with the sampler, the learning rate is logged for the
step it applied to, --resume takes a changed --lr, the loss takes its arguments by name,
masks are checked against the tokens, and the KL reference follows --precision."""

from __future__ import annotations

import logging

import pytest
import torch

from example_trainer.checkpointing import save_checkpoint
from example_trainer.trainers import GRPOTrainer, prepare_batch
from example_trainer.training import compute_grpo_loss, grpo_loss, token_logprobs
from tests.example_trainer.conftest import cpu_config, make_batch

# --- metrics against the sampler under --ppo-epochs / --mini-batches ------------------------


def test_sampler_metrics_ignore_the_trainers_old_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 9, generator=g)
    labels = torch.randint(0, 9, (2, 4), generator=g)
    logp = token_logprobs(logits, labels)
    sampler = logp - 0.5
    present = torch.tensor([[True] * 4, [False] * 4])  # the second sequence has none
    old = logp - 0.2
    out = grpo_loss(
        logits,
        labels,
        torch.ones(2, 4),
        inference_logprobs=sampler,
        inference_mask=present,
        old_logprobs=old,
    )
    m = out.metrics
    assert float(m["grpo/has_inference_logprobs"]) == pytest.approx(0.5)
    assert float(m["alignment/diff_mean"]) == pytest.approx(0.5)  # logp − sampler, first row only
    # the ratio still uses the old policy on the row without sampler log-probs
    expected_ratio = (torch.exp(torch.tensor(0.5)) * 4 + torch.exp(torch.tensor(0.2)) * 4) / 8
    assert float(m["grpo/mean_ratio"]) == pytest.approx(float(expected_ratio), rel=1e-6)


@pytest.mark.parametrize("ppo_epochs, mini_batches", [(2, 1), (1, 2)])
def test_several_updates_per_batch_report_the_sampler_share_and_alignment(
    tiny_model_dir, tiny_tokenizer, tmp_path, ppo_epochs, mini_batches
):
    no_lp = make_batch(tiny_tokenizer, n_groups=2, group_size=4, seed=7)
    mixed = make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=3, with_logprobs=True)
    mixed += make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=4)
    # lr so small the policy does not move: every update sees the same log-probs
    once = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path / "a", lr=1e-12)).train_on_batch(mixed)
    cfg = cpu_config(
        tiny_model_dir, tmp_path / "b", lr=1e-12, ppo_epochs=ppo_epochs, mini_batches=mini_batches
    )
    trainer = GRPOTrainer(cfg)
    m = trainer.train_on_batch(no_lp)
    assert m["grpo/has_inference_logprobs"] == 0.0
    assert "alignment/diff_mean" not in m and "off_policy/mismatch_kl" not in m
    m = trainer.train_on_batch(mixed)
    assert m["grpo/has_inference_logprobs"] == pytest.approx(once["grpo/has_inference_logprobs"])
    for key in ("alignment/diff_mean", "alignment/diff_abs_mean", "logprobs/inference_mean"):
        assert m[key] == pytest.approx(once[key], rel=1e-4), key


def test_mismatch_kl_is_against_the_sampler_under_several_epochs(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    batch = make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=3, with_logprobs=True)
    batch += make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=4)
    # one micro-batch holding both groups: only the first group's tokens have a sampler
    common = dict(lr=1e-12, off_policy_correction="tis", batch_size=8)
    once = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path / "a", **common)).train_on_batch(batch)
    twice = GRPOTrainer(
        cpu_config(tiny_model_dir, tmp_path / "b", ppo_epochs=2, **common)
    ).train_on_batch(batch)
    assert once["off_policy/mismatch_kl"] > 0.1
    assert twice["off_policy/mismatch_kl"] == pytest.approx(
        once["off_policy/mismatch_kl"], rel=1e-4
    )


# --- the learning rate of the step ----------------------------------------------------------


def test_train_lr_is_the_rate_the_step_applied(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, warmup_steps=4, lr=1e-3))
    used = []
    apply = trainer.update.apply

    def recording_apply(finite: bool) -> None:
        used.append(trainer.optimizer.param_groups[0]["lr"])
        apply(finite)

    trainer.update.apply = recording_apply
    logged = [
        trainer.train_on_batch(make_batch(tiny_tokenizer, seed=s))["train/lr"] for s in (1, 2)
    ]
    assert used == pytest.approx([2.5e-4, 5e-4])  # warmup factor (s + 1) / 4
    assert logged == pytest.approx(used)


def test_resume_with_a_new_lr_applies_it_and_says_so(
    tiny_model_dir, tiny_tokenizer, tmp_path, caplog
):
    cfg = cpu_config(tiny_model_dir, tmp_path, warmup_steps=4, lr=1e-3)
    t1 = GRPOTrainer(cfg)
    t1.train_on_batch(make_batch(tiny_tokenizer, seed=1))
    t1.step = 1
    save_checkpoint(t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, 1, tmp_path)
    caplog.set_level(logging.WARNING, logger="example_trainer.trainers")
    t2 = GRPOTrainer(cfg.model_copy(update={"resume": True, "lr": 4e-3}))
    lines = [r.getMessage() for r in caplog.records if "--lr" in r.getMessage()]
    assert len(lines) == 1 and "0.004" in lines[0] and "0.001" in lines[0], lines
    # step 2 of the warmup at the new peak: 4e-3 · 2/4
    assert [g["lr"] for g in t2.optimizer.param_groups] == pytest.approx(
        [2e-3] * len(t2.optimizer.param_groups)
    )
    assert t2.train_on_batch(make_batch(tiny_tokenizer, seed=2))["train/lr"] == pytest.approx(2e-3)
    caplog.clear()
    GRPOTrainer(cfg.model_copy(update={"resume": True}))  # same --lr: nothing said
    assert not [r for r in caplog.records if "--lr" in r.getMessage()]


# --- the loss by keyword --------------------------------------------------------------------


def test_compute_grpo_loss_takes_temperatures_by_keyword():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g)
    labels = torch.randint(0, 7, (2, 3), generator=g)
    adv = torch.tensor([1.0, -1.0])
    temps = torch.tensor([0.7, 1.3])
    by_name = compute_grpo_loss(logits, labels, adv, temperatures=temps)
    positional = grpo_loss(logits, labels, adv, temps)
    untempered = grpo_loss(logits, labels, adv)
    logp = float(positional.metrics["train/logp"])
    assert float(by_name.metrics["train/logp"]) == logp
    assert float(untempered.metrics["train/logp"]) != logp
    named = compute_grpo_loss(logits, labels=labels, advantages=adv, temperatures=temps)
    assert float(named.metrics["train/logp"]) == logp


# --- masks against tokens -------------------------------------------------------------------


def test_a_mask_that_is_not_its_token_rejects_the_group_naming_env_and_position(
    tiny_tokenizer, caplog
):
    good, bad = make_batch(tiny_tokenizer, n_groups=2, group_size=2, seed=9)
    bad["env_id"] = 3
    position = len(bad["masks"][1]) - 2
    bad["masks"][1][position] = bad["tokens"][1][position] + 1
    caplog.set_level(logging.ERROR)
    prepared = prepare_batch([good, bad], 1, 4)
    assert prepared.summary["train/rejected_groups"] == 1.0
    assert len(prepared.shares[0]) == 2
    text = caplog.text
    assert "env_id 3" in text and f"masks[1][{position}]" in text


# --- the reference model's precision --------------------------------------------------------


@pytest.mark.parametrize(
    "precision, dtype, expected",
    [("fp32", "float32", torch.float32), ("bf16-mixed", "bfloat16", torch.bfloat16)],
)
def test_the_kl_reference_is_kept_in_the_compute_dtype(
    tiny_model_dir, tiny_tokenizer, tmp_path, precision, dtype, expected
):
    trainer = GRPOTrainer(
        cpu_config(tiny_model_dir, tmp_path, kl_coef=0.1, precision=precision, dtype=dtype)
    )
    assert {p.dtype for p in trainer.ref_model.parameters()} == {expected}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    m = trainer.train_on_batch(make_batch(tiny_tokenizer, seed=2))
    assert m["train/kl"] == pytest.approx(0.0, abs=1e-3)  # the same policy, in its dtype


def test_sampler_statistics_do_not_depend_on_micro_batches_without_sampler_logprobs(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    # group 1 has sampler log-probs, group 2 none: at micro-batch 4 they are apart, at 8 together
    batch = make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=3, with_logprobs=True)
    batch += make_batch(tiny_tokenizer, n_groups=1, group_size=4, seed=4)
    runs = [
        GRPOTrainer(
            cpu_config(tiny_model_dir, tmp_path / str(micro), batch_size=micro, lr=1e-12,
                    off_policy_correction="tis")
        ).train_on_batch(batch)
        for micro in (8, 4)
    ]  # fmt: skip
    for key in ("alignment/diff_mean", "logprobs/inference_mean", "off_policy/mismatch_kl"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-5), key
