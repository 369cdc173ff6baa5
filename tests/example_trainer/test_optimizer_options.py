"""Optimizer options of atropos-grpo: parameter groups without weight decay on biases,
norms and embeddings, betas/eps, learning-rate schedules, dropout, and the state a
checkpoint keeps besides the weights."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.checkpointing import load_trainer_state, save_checkpoint
from example_trainer.cli import config_from_args
from example_trainer.config import TrainingConfig
from example_trainer.model import (
    build_optimizer,
    build_scheduler,
    disable_dropout,
    lr_factor,
    param_groups,
)
from example_trainer.trainers import GRPOTrainer
from tests.example_trainer.conftest import make_batch


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.proj = torch.nn.Linear(3, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight  # tied, as many LMs
        self.drop = torch.nn.Dropout(0.1)


def _cfg(**kw) -> TrainingConfig:
    return TrainingConfig(model_name="m", device="cpu", optimizer="adamw", lr=0.1, **kw)


def _step(model, cfg, grad=1.0):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(param_groups(model, cfg), cfg)
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    opt.step()
    return before, dict(model.named_parameters()), opt


def test_biases_norms_and_embeddings_are_not_decayed_by_default():
    torch.manual_seed(0)
    model = _Tiny()
    cfg = _cfg(weight_decay=0.5)
    before, after, opt = _step(model, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    step = 0.1 * 1.0 / (1.0 + 1e-8)  # AdamW's first step: lr · ĝ / (√v̂ + eps)
    # Decayed: p ← p·(1 − lr·wd) − step.
    assert torch.allclose(after["proj.weight"], before["proj.weight"] * (1 - 0.1 * 0.5) - step)
    for name in ("proj.bias", "norm.weight", "norm.bias", "embed.weight"):
        assert torch.allclose(after[name], before[name] - step), name
    # The tied head is the embedding: one parameter, in one group.
    assert sum(len(g["params"]) for g in opt.param_groups) == 5


def test_decay_norms_and_embeddings_decays_every_parameter():
    torch.manual_seed(0)
    model = _Tiny()
    before, after, opt = _step(model, _cfg(weight_decay=0.5, decay_norms_and_embeddings=True))
    assert len(opt.param_groups) == 1
    for name in ("proj.bias", "norm.weight", "embed.weight"):
        assert torch.allclose(after[name], before[name] * 0.95 - 0.1 / (1 + 1e-8)), name


def test_weight_decay_default_is_the_optimizers_own():
    assert _cfg().resolved_weight_decay == 0.01
    assert TrainingConfig(model_name="m", optimizer="adafactor").resolved_weight_decay == 0.0
    model = _Tiny()
    opt = build_optimizer(param_groups(model, _cfg()), _cfg())
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_betas_and_eps_are_passed_to_adamw():
    torch.manual_seed(0)
    model = _Tiny()
    cfg = _cfg(adam_beta1=0.5, adam_beta2=0.9, adam_eps=1e-8, weight_decay=0.0)
    before, after, opt = _step(model, cfg, grad=1e-8)
    assert opt.param_groups[0]["betas"] == (0.5, 0.9) and opt.param_groups[0]["eps"] == 1e-8
    # A gradient equal to eps moves a weight by lr · g / (|g| + eps) = lr / 2.
    assert torch.allclose(after["proj.weight"], before["proj.weight"] - 0.05, atol=1e-7)


@pytest.mark.parametrize(
    "kind, step, expected",
    [
        ("constant", 0, 0.5),  # warm-up (step + 1) / 2
        ("constant", 1, 1.0),
        ("constant", 9, 1.0),
        ("linear", 2, 1.0),  # p = (step − 2) / (10 − 2)
        ("linear", 6, 0.5),
        ("linear", 10, 0.0),
        ("cosine", 6, 0.5),  # (1 + cos(π/2)) / 2
        ("cosine", 4, (1 + math.cos(math.pi / 4)) / 2),
        ("cosine", 10, 0.0),
    ],
)
def test_learning_rate_schedules(kind, step, expected):
    assert lr_factor(step, 2, kind, 10) == pytest.approx(expected)


def test_min_lr_ratio_is_the_floor_of_the_decay():
    assert lr_factor(10, 0, "linear", 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(5, 0, "linear", 10, 0.1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(5, 0, "cosine", 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)


def test_the_scheduler_follows_the_factor():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = build_scheduler(opt, 2, "cosine", 10)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([lr_factor(s, 2, "cosine", 10) for s in range(10)])


def test_disable_dropout_zeroes_every_dropout():
    model = _Tiny()
    model.attention_dropout = 0.1  # as HF attention modules keep it
    assert disable_dropout(model) == 2
    assert model.drop.p == 0.0 and model.attention_dropout == 0.0


def test_optimizer_flags_reach_the_config():
    c = config_from_args(
        [
            "--model-name", "m",
            "--weight-decay", "0.1",
            "--decay-norms-and-embeddings",
            "--adam-beta1", "0.8",
            "--adam-beta2", "0.95",
            "--adam-eps", "1e-6",
            "--lr-scheduler", "cosine",
            "--min-lr-ratio", "0.1",
            "--max-consecutive-skipped-steps", "3",
        ]
    )  # fmt: skip
    assert (c.weight_decay, c.decay_norms_and_embeddings, c.adam_beta1, c.adam_beta2) == (
        0.1,
        True,
        0.8,
        0.95,
    )
    assert (c.adam_eps, c.lr_scheduler, c.min_lr_ratio, c.max_consecutive_skipped_steps) == (
        1e-6,
        "cosine",
        0.1,
        3,
    )
    with pytest.raises(SystemExit):
        config_from_args(["--model-name", "m", "--lr-scheduler", "step"])


def test_trainer_uses_the_groups_and_the_schedule(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = GRPOTrainer(
        TrainingConfig(
            model_name=str(tiny_model_dir),
            save_path=str(tmp_path),
            device="cpu",
            optimizer="adamw",
            lr=1e-3,
            batch_size=8,
            pad_to_multiple=8,
            training_steps=4,
            lr_scheduler="linear",
            progress=False,
        )
    )
    decayed, exempt = trainer.optimizer.param_groups
    assert decayed["weight_decay"] == 0.01 and exempt["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"])
    embed = trainer.model.get_input_embeddings().weight
    assert any(p is embed for p in exempt["params"])
    m = trainer.train_on_batch(make_batch(tiny_tokenizer))
    assert m["train/lr"] == pytest.approx(1e-3)  # the rate the first of four steps applied
    m = trainer.train_on_batch(make_batch(tiny_tokenizer))
    assert m["train/lr"] == pytest.approx(1e-3 * 0.75)  # the second step's, linearly decayed


def test_checkpoint_keeps_the_skipped_steps_and_resumes_them(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        save_path=str(tmp_path),
        device="cpu",
        optimizer="adamw",
        batch_size=8,
        pad_to_multiple=8,
        progress=False,
    )
    t1 = GRPOTrainer(cfg)
    t1.train_on_batch(make_batch(tiny_tokenizer))
    t1.skipped_steps = 2
    t1.step = 1
    save_checkpoint(
        t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, 1, tmp_path, extra=t1._extra_state()
    )
    assert load_trainer_state(tmp_path / "step_1").extra["skipped_steps"] == 2
    t2 = GRPOTrainer(cfg.model_copy(update={"resume": True}))
    assert t2.skipped_steps == 2
    assert [len(g["params"]) for g in t2.optimizer.param_groups] == [
        len(g["params"]) for g in t1.optimizer.param_groups
    ]


def test_resumed_run_takes_weight_decay_and_betas_from_its_own_flags(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    from example_trainer.distributed import full_optimizer_state_dict

    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        save_path=str(tmp_path),
        device="cpu",
        optimizer="adamw",
        batch_size=8,
        pad_to_multiple=8,
        progress=False,
        decay_norms_and_embeddings=True,  # one group, every parameter decayed
    )
    t1 = GRPOTrainer(cfg)
    t1.train_on_batch(make_batch(tiny_tokenizer))
    state = full_optimizer_state_dict(t1.model, t1.optimizer, t1.ctx)
    save_checkpoint(
        t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, 1, tmp_path, optimizer_state=state
    )
    t2 = GRPOTrainer(
        cfg.model_copy(
            update={"resume": True, "decay_norms_and_embeddings": False, "adam_beta2": 0.95}
        )
    )
    assert [g["weight_decay"] for g in t2.optimizer.param_groups] == [0.01, 0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in t2.optimizer.param_groups)
    assert len(t2.optimizer.state) == len(t1.optimizer.state)  # the moments came back
