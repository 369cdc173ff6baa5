"""The loss split into ``example_trainer/loss.py`` changed no result: ``grpo_loss`` against the
frozen pre-split function on random batches under every option (loss, logits' gradient,
metric keys in order and values, bit for bit), and ``compute_loss`` from log-probs alone."""

from __future__ import annotations

import ast
import math

import pytest
import torch

from example_trainer.conventions import IGNORE_INDEX
from example_trainer.loss import compute_loss
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import CorrectionConfig
from example_trainer.training import grpo_loss, token_entropy, token_logprobs
from tests.conftest import ROOT
from tests.example_trainer._grpo_loss_before_split import grpo_loss as grpo_loss_before

B, T, V, K = 3, 9, 11, 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors this small are ~15x slower on two threads of a busy machine than on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CONFIGS = {
    "default": LossConfig(),
    "clip-higher": LossConfig(clip_eps=0.1, clip_eps_high=0.28),
    "dual-clip": LossConfig(clip_ratio_c=1.5),
    "kl-k3": LossConfig(kl_coef=0.1),
    "kl-k1": LossConfig(kl_coef=0.1, kl_estimator="k1"),
    "kl-k2-in-reward": LossConfig(kl_coef=0.1, kl_estimator="k2", kl_in_reward=True),
    "gspo": LossConfig(importance_sampling_level="sequence"),
    "gspo-tis-truncate": LossConfig(
        importance_sampling_level="sequence",
        off_policy=CorrectionConfig("tis", clip=2.0, tis_mode="truncate"),
    ),
    "tis": LossConfig(off_policy=CorrectionConfig("tis", clip=1.5)),
    "tis-truncate": LossConfig(off_policy=CorrectionConfig("tis", tis_mode="truncate")),
    "icepop": LossConfig(off_policy=CorrectionConfig("icepop", clip=1.8, clip_low=0.6)),
    "grpo-agg": LossConfig(loss_type="grpo"),
    "dr_grpo": LossConfig(loss_type="dr_grpo"),
    "seq-sum": LossConfig(loss_type="seq-mean-token-sum"),
    "entropy-bonus": LossConfig(entropy_coef=0.01),
    "entropy-logged": LossConfig(log_entropy=True),
    "distill": LossConfig(distill_coef=0.5, distill_temperature=1.5),
    "distill-only": LossConfig(distill_coef=1.0, distill_only=True),
    "everything": LossConfig(
        clip_eps_high=0.3,
        clip_ratio_c=2.0,
        kl_coef=0.05,
        off_policy=CorrectionConfig("tis"),
        loss_type="grpo",
        entropy_coef=-0.02,
        distill_coef=0.3,
    ),
}


def _batch(seed: int) -> dict:
    """Random logits and labels with masked prompt tokens, sampler log-probs near the
    trainer's with the 1.0 marker and one absurd −9999, references and a teacher top-k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, : 1 + seed % 3] = IGNORE_INDEX
    labels[-1, -2:] = IGNORE_INDEX
    logp = token_logprobs(logits, labels).detach()
    inference = logp + 0.3 * torch.randn(B, T, generator=g)
    inference = inference.clamp(max=0.0)
    inference[0, -1] = 1.0  # "not generated" marker
    inference[1, 4] = -9999.0
    ids = torch.randint(0, V, (B, T, K), generator=g)
    teacher = torch.log_softmax(torch.randn(B, T, K, generator=g), -1)
    teacher[2, 5:] = -math.inf  # rows without a teacher
    return {
        "logits": logits,
        "labels": labels,
        "advantages": torch.randn(B, T, generator=g),
        "seq_advantages": torch.randn(B, generator=g),
        "temperatures": 0.5 + torch.rand(B, generator=g),
        "inference_logprobs": inference,
        "ref_logprobs": logp + 0.2 * torch.randn(B, T, generator=g),
        "old_logprobs": logp + 0.1 * torch.randn(B, T, generator=g),
        "distill_token_ids": ids,
        "distill_logprobs": teacher,
        "distill_mask": torch.rand(B, T, generator=g) > 0.3,
        "inference_mask": torch.rand(B, T, generator=g) > 0.2,
    }


def _variants(batch: dict) -> dict:
    """Call forms: which optional inputs one call passes."""
    full = {
        "temperatures": batch["temperatures"],
        "inference_logprobs": batch["inference_logprobs"],
        "ref_logprobs": batch["ref_logprobs"],
        "distill_token_ids": batch["distill_token_ids"],
        "distill_logprobs": batch["distill_logprobs"],
        "distill_mask": batch["distill_mask"],
    }
    return {
        "bare": {},
        "sampler": {"inference_logprobs": batch["inference_logprobs"]},
        "full": full,
        "full-step": {**full, "normalizer": 17.0, "num_sequences": 5, "max_tokens": 12},
        "masks-and-old": {
            **full,
            "inference_mask": batch["inference_mask"],
            "old_logprobs": batch["old_logprobs"],
        },
    }


def _run(fn, batch: dict, advantages: torch.Tensor, config: LossConfig, kwargs: dict):
    logits = batch["logits"].clone().requires_grad_(True)
    kwargs = dict(kwargs)
    temps = kwargs.pop("temperatures", None)
    inference = kwargs.pop("inference_logprobs", None)
    out = fn(logits, batch["labels"], advantages, temps, inference, config, **kwargs)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_loss_gives_what_it_gave_before_the_split(name, seed):
    batch = _batch(seed)
    config = CONFIGS[name]
    for variant, kwargs in _variants(batch).items():
        for advantages in (batch["advantages"], batch["seq_advantages"]):
            old, old_grad = _run(grpo_loss_before, batch, advantages, config, kwargs)
            new, new_grad = _run(grpo_loss, batch, advantages, config, kwargs)
            where = f"{name}/{variant}/adv{advantages.dim()}d"
            assert torch.equal(new.loss, old.loss), where
            assert torch.equal(new_grad, old_grad), where
            assert list(new.metrics) == list(old.metrics), where
            for key, value in old.metrics.items():
                assert torch.equal(new.metrics[key], value), f"{where}: {key}"


def test_gspo_with_a_correction_other_than_truncate_is_refused_as_before():
    batch = _batch(0)
    config = LossConfig(importance_sampling_level="sequence", off_policy=CorrectionConfig("tis"))
    kwargs = {"inference_logprobs": batch["inference_logprobs"]}
    for fn in (grpo_loss_before, grpo_loss):
        with pytest.raises(ValueError, match="importance_sampling_level 'sequence'"):
            _run(fn, batch, batch["advantages"], config, kwargs)


def test_compute_loss_takes_log_probs_and_matches_the_logits_form():
    """The prime-rl-shaped call: per-token log-probs, sampler and reference log-probs,
    advantages, the loss mask and the config in; the loss and its metrics out."""
    batch = _batch(2)
    config = LossConfig(kl_coef=0.1, entropy_coef=0.01, off_policy=CorrectionConfig("icepop"))
    logits = batch["logits"].clone().requires_grad_(True)
    labels, temps = batch["labels"], batch["temperatures"]
    logp = token_logprobs(logits, labels, temps)
    out = compute_loss(
        logp,
        batch["inference_logprobs"],
        batch["advantages"],
        labels != IGNORE_INDEX,
        config,
        ref_logprobs=batch["ref_logprobs"],
        entropy=token_entropy(logits, temps),
    )
    out.loss.backward()
    ref, ref_grad = _run(
        grpo_loss,
        batch,
        batch["advantages"],
        config,
        {
            "temperatures": temps,
            "inference_logprobs": batch["inference_logprobs"],
            "ref_logprobs": batch["ref_logprobs"],
        },
    )
    assert torch.equal(out.loss, ref.loss)
    assert torch.equal(logits.grad, ref_grad)
    assert out.metrics.keys() == ref.metrics.keys()
    assert "off_policy/clip_fraction" in out.metrics and "train/entropy" in out.metrics


def test_compute_loss_asks_for_the_entropy_when_the_config_weighs_it():
    batch = _batch(0)
    logp = token_logprobs(batch["logits"], batch["labels"])
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropy"):
        compute_loss(
            logp,
            None,
            batch["advantages"],
            batch["labels"] != IGNORE_INDEX,
            LossConfig(entropy_coef=0.1),
        )


def test_no_function_of_the_loss_is_over_80_lines():
    for name in ("loss.py", "training.py"):
        tree = ast.parse((ROOT / "example_trainer" / name).read_text())
        long = [
            f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 80
        ]
        assert not long, f"example_trainer/{name}: {long}"
