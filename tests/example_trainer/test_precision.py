"""Precision policy: mixed precision keeps fp32 master weights, so small updates are not lost.

The step tests run on the CPU, where bfloat16 autocast works: one AdamW step at the
original's default ``--lr 1e-5`` on the tiny model.
"""

from __future__ import annotations

import logging

import pytest
import torch

from example_trainer.cli import config_from_args
from example_trainer.config import TrainingConfig
from example_trainer.precision import PrecisionError, resolve_precision
from example_trainer.trainers import GRPOTrainer
from tests.example_trainer.conftest import make_batch


def _trainer(model_dir, tmp_path, **kw) -> GRPOTrainer:
    cfg = TrainingConfig(
        model_name=str(model_dir),
        save_path=str(tmp_path),
        device="cpu",
        optimizer="adamw",
        lr=1e-5,
        batch_size=8,
        gradient_accumulation_steps=1,
        pad_to_multiple=8,
        progress=False,
        seed=0,
        **kw,
    )
    return GRPOTrainer(cfg)


def _one_step(trainer: GRPOTrainer, batch) -> tuple[list, list, list]:
    """(weights before, gradients, weights after) of one optimizer step, all as fp32."""
    before = [p.detach().float().clone() for p in trainer.model.parameters()]
    grads: list = []

    def capture(optimizer, args, kwargs) -> None:
        grads.extend(
            p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(b)
            for p, b in zip(trainer.model.parameters(), before, strict=True)
        )

    handle = trainer.optimizer.register_step_pre_hook(capture)
    trainer.train_on_batch(batch)
    handle.remove()
    after = [p.detach().float().clone() for p in trainer.model.parameters()]
    return before, grads, after


def _changed_fraction(before, grads, after) -> float:
    touched = changed = 0
    for b, g, a in zip(before, grads, after, strict=True):
        mask = g != 0
        touched += int(mask.sum())
        changed += int(((a != b) & mask).sum())
    return changed / max(touched, 1)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    return make_batch(tiny_tokenizer, n_groups=2, group_size=4, seed=3, with_logprobs=True)


@pytest.fixture(scope="module")
def fp32_step(tiny_model_dir, tmp_path_factory, batch):
    trainer = _trainer(tiny_model_dir, tmp_path_factory.mktemp("fp32"), precision="fp32")
    return _one_step(trainer, batch)


def test_bf16_mixed_step_at_lr_1e5_updates_every_weight_like_fp32(
    tiny_model_dir, tmp_path, batch, fp32_step
):
    trainer = _trainer(tiny_model_dir, tmp_path, precision="bf16-mixed", dtype="bfloat16")
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
    before, grads, after = _one_step(trainer, batch)
    assert _changed_fraction(before, grads, after) >= 0.99
    # The update matches the fp32 reference: same direction, same size.
    d_mixed = torch.cat([(a - b).flatten() for b, a in zip(before, after, strict=True)])
    ref_before, _, ref_after = fp32_step
    d_ref = torch.cat([(a - b).flatten() for b, a in zip(ref_before, ref_after, strict=True)])
    cosine = torch.nn.functional.cosine_similarity(d_mixed, d_ref, dim=0)
    assert cosine >= 0.99, float(cosine)
    assert d_mixed.norm() == pytest.approx(float(d_ref.norm()), rel=0.02)


def test_bf16_pure_loses_most_small_updates_and_warns(tiny_model_dir, tmp_path, batch, caplog):
    """The failure mode the policy exists for (the measure above would catch it)."""
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(tiny_model_dir, tmp_path, precision="bf16-pure")
    assert "rounded away" in caplog.text
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert _changed_fraction(*_one_step(trainer, batch)) < 0.5


def test_dtype_bfloat16_on_cpu_computes_in_bf16_with_fp32_weights(tiny_model_dir, tmp_path, batch):
    trainer = _trainer(tiny_model_dir, tmp_path, dtype="bfloat16")
    seen: list = []
    layer = trainer.model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.train_on_batch(batch)
    handle.remove()
    assert trainer.policy.name == "bf16-mixed"
    assert seen and set(seen) == {torch.bfloat16}
    assert layer.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "precision, dtype, device, explicit, bf16, expected",
    [
        ("auto", "bfloat16", "cuda", False, True, "bf16-mixed"),
        ("auto", "bfloat16", "cuda:1", False, False, "fp16-mixed"),  # GPU without bf16
        ("auto", "float16", "cuda", True, True, "fp16-mixed"),
        ("auto", "float32", "cuda", True, True, "fp32"),
        ("auto", "bfloat16", "cpu", False, True, "fp32"),
        ("auto", "bf16", "cpu", True, True, "bf16-mixed"),
        ("bf16-pure", "bfloat16", "cuda", False, True, "bf16-pure"),
        ("fp32", "bfloat16", "cuda", False, True, "fp32"),
    ],
)
def test_precision_resolution(precision, dtype, device, explicit, bf16, expected):
    policy = resolve_precision(
        precision, dtype, device, dtype_explicit=explicit, bf16_supported=bf16
    )
    assert policy.name == expected
    assert policy.param_dtype == (torch.bfloat16 if expected == "bf16-pure" else torch.float32)
    assert policy.uses_scaler == (expected == "fp16-mixed")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--precision", "fp16-mixed", "--device", "cpu"], "needs a CUDA device"),
        (["--precision", "bf16-mixed", "--dtype", "float32"], "contradicts"),
        (["--dtype", "int8"], "--dtype"),
        (
            ["--precision", "bf16-mixed", "--world-size", "2", "--weight-bridge-mode", "lora_only"],
            "LoRA",
        ),
        (["--weight-bridge-mode", "shared_vllm"], "not implemented"),
        (["--single-copy"], "shared_vllm"),
    ],
)
def test_unsupported_combinations_exit_2_with_a_message(args, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--model-name", "m", *args])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_bf16_on_a_gpu_without_bf16_is_refused_when_asked_for():
    with pytest.raises(PrecisionError, match="no bfloat16 support"):
        resolve_precision("bf16-mixed", "bfloat16", "cuda", bf16_supported=False)
