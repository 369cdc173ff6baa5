"""On-policy distillation in the trainer (--distill-enabled): the reverse KL to the teacher's
top-k against a hand computation, the teacher rows aligned with the next-token labels, a
batch mixing groups with and without teacher rows, --distill-only, and malformed rows
refused naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from example_trainer.cli import config_from_args
from example_trainer.data import IGNORE_INDEX, GroupError, collate, group_to_samples
from example_trainer.distill import distill_divergence
from example_trainer.loss_config import LossConfig
from example_trainer.training import grpo_loss

V = 7


def _reverse_kl_by_hand(logits_row, ids, lps, temperature):
    """KL(student ‖ teacher) over the distinct ids of the row, both renormalised at T."""
    seen, keep = set(), []
    for t, lp in zip(ids, lps, strict=True):
        if t not in seen and math.isfinite(lp):
            seen.add(t)
            keep.append((t, lp))
    s = [float(logits_row[t]) / temperature for t, _ in keep]
    q = [lp / temperature for _, lp in keep]
    zs = math.log(sum(math.exp(x) for x in s))
    zq = math.log(sum(math.exp(x) for x in q))
    return sum(math.exp(a - zs) * ((a - zs) - (b - zq)) for a, b in zip(s, q, strict=True))


def _distill_group(tokens, masks, k=3, score=1.0):
    """A group whose teacher row at position p is led by tokens[p] (the token it predicts)."""
    ids, lps = [], []
    for seq in tokens:
        ids.append([[t, (t + 1) % V, (t + 2) % V][:k] for t in seq])
        lps.append([[-0.2, -1.5, -2.5][:k] for _ in seq])
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [score] * len(tokens),
        "distill_token_ids": ids,
        "distill_logprobs": lps,
    }


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_divergence_matches_the_hand_computation(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, V, generator=g)
    ids = torch.tensor(
        [
            [[0, 1, 2], [3, 4, 4], [5, 6, 0]],  # a repeated id (a padded short row) counts once
            [[2, 2, 2], [1, 3, 5], [6, 0, 1]],  # one distinct id: nothing to match, 0
        ]
    )
    lps = torch.tensor(
        [
            [[-0.1, -2.0, -3.0], [-0.5, -1.0, -1.0], [-0.3, -1.2, -math.inf]],
            [[0.0, 0.0, 0.0], [-1.0, -1.1, -1.2], [-0.01, -5.0, -9.0]],
        ]
    )
    got = distill_divergence(logits, ids, lps, temperature)
    for b in range(2):
        for t in range(3):
            want = _reverse_kl_by_hand(
                logits[b, t], ids[b, t].tolist(), lps[b, t].tolist(), temperature
            )
            assert got[b, t].item() == pytest.approx(want, abs=1e-6)
    assert got[1, 0].item() == 0.0
    # The student equal to the teacher on the set: no divergence.
    same = torch.full((1, 1, V), -50.0)
    same[0, 0, :3] = torch.tensor([-0.1, -2.0, -3.0])
    zero = distill_divergence(
        same, torch.tensor([[[0, 1, 2]]]), torch.tensor([[[-0.1, -2.0, -3.0]]])
    )
    assert zero.abs().item() < 1e-6


def test_teacher_rows_are_aligned_with_the_next_token_labels():
    """Row p of the teacher is about token p; logits at position j predict token j + 1,
    so position j must carry row j + 1 (whose lead id is the label there)."""
    tokens = [[1, 2, 3, 4, 5], [6, 5, 4]]
    masks = [[IGNORE_INDEX, IGNORE_INDEX, 3, 4, 5], [IGNORE_INDEX, 5, 4]]
    samples = group_to_samples(_distill_group(tokens, masks))
    mb = collate(samples, pad_to_multiple=8)
    trained = mb.labels != IGNORE_INDEX
    assert torch.equal(mb.distill_mask, trained)
    assert torch.equal(mb.distill_token_ids[..., 0][trained], mb.labels[trained])
    # Each position's row is exactly the teacher's row for the next input token.
    for s, seq in enumerate(tokens):
        for j in range(len(seq) - 1):
            assert mb.distill_token_ids[s, j].tolist() == [
                seq[j + 1],
                (seq[j + 1] + 1) % V,
                (seq[j + 1] + 2) % V,
            ]
    # Padding positions carry no weight.
    assert torch.isinf(mb.distill_logprobs[0, 4:]).all()


def _mixed_batch():
    with_rows = _distill_group(
        [[1, 2, 3, 4], [1, 2, 5, 6]], [[-100, -100, 3, 4], [-100, -100, 5, 6]]
    )
    with_rows["scores"] = [1.0, 0.0]
    without = {
        "tokens": [[1, 3, 3, 2], [1, 4, 4, 4]],
        "masks": [[-100, 3, 3, 2], [-100, 4, 4, 4]],
        "scores": [0.0, 1.0],
    }
    return with_rows, without


def _loss(mb, logits, **options):
    return grpo_loss(
        logits,
        mb.labels,
        mb.advantages,
        config=LossConfig(**options),
        distill_token_ids=mb.distill_token_ids,
        distill_logprobs=mb.distill_logprobs,
        distill_mask=mb.distill_mask,
        normalizer=float((mb.labels != IGNORE_INDEX).sum()),
    )


def test_a_batch_mixing_groups_with_and_without_teacher_rows():
    with_rows, without = _mixed_batch()
    samples = group_to_samples(with_rows) + group_to_samples(without)
    mb = collate(samples, pad_to_multiple=4)
    assert mb.distill_mask[:2].any() and not mb.distill_mask[2:].any()
    logits = torch.randn(4, 4, V, generator=torch.Generator().manual_seed(2))
    n = float((mb.labels != IGNORE_INDEX).sum())
    plain = _loss(mb, logits).loss
    coef, temp = 0.5, 2.0
    mixed = _loss(mb, logits, distill_coef=coef, distill_temperature=temp)
    term = distill_divergence(logits, mb.distill_token_ids, mb.distill_logprobs, temp)
    want = plain + coef * (term * mb.distill_mask).sum() / n
    assert mixed.loss.item() == pytest.approx(want.item(), abs=1e-6)
    assert mixed.metrics["distill/tokens"].item() == 4
    # The groups without teacher rows train exactly as with distillation off.
    only_without = collate(group_to_samples(without), pad_to_multiple=4)
    off = _loss(only_without, logits[2:]).loss
    on = _loss(only_without, logits[2:], distill_coef=coef).loss
    assert on.item() == off.item()


def test_distill_only_gradient_is_the_distill_terms_gradient():
    with_rows, without = _mixed_batch()
    mb = collate(group_to_samples(with_rows) + group_to_samples(without), pad_to_multiple=4)
    base = torch.randn(4, 4, V, generator=torch.Generator().manual_seed(3))
    n = float((mb.labels != IGNORE_INDEX).sum())
    a = base.clone().requires_grad_(True)
    _loss(mb, a, distill_coef=0.7, distill_temperature=1.5, distill_only=True).loss.backward()
    b = base.clone().requires_grad_(True)
    term = distill_divergence(b, mb.distill_token_ids, mb.distill_logprobs, 1.5)
    (0.7 * (term * mb.distill_mask).sum() / n).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)
    assert a.grad[2:].abs().sum().item() == 0.0  # no teacher rows: no gradient at all
    assert a.grad[:2].abs().sum().item() > 0.0


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda g: g["distill_token_ids"][0].pop(), "distill_token_ids[0]"),
        (lambda g: g["distill_logprobs"][1].append([-1.0, -2.0, -3.0]), "distill_logprobs[1]"),
        (lambda g: g["distill_logprobs"][0][2].pop(), "distill_logprobs[0][2]"),
        (lambda g: g.pop("distill_logprobs"), "distill_logprobs is missing"),
        (lambda g: g["distill_token_ids"].pop(), "distill_token_ids has 1 sequences"),
        (lambda g: g["distill_logprobs"][0][1].__setitem__(0, 0.5), "distill_logprobs[0][1]"),
    ],
)
def test_malformed_teacher_rows_are_refused_naming_the_field(change, field):
    group = _distill_group([[1, 2, 3, 4], [1, 2, 5, 6]], [[-100, -100, 3, 4], [-100, -100, 5, 6]])
    change(group)
    with pytest.raises(GroupError, match=field.replace("[", r"\[").replace("]", r"\]")):
        group_to_samples(group)


def test_the_flags_reach_the_loss():
    cfg = config_from_args(
        [
            "--model-name",
            "m",
            "--distill-enabled",
            "true",
            "--distill-coef",
            "0.3",
            "--distill-temperature",
            "2.0",
        ]
    )
    loss_cfg = LossConfig.from_training(cfg)
    assert (loss_cfg.distill_coef, loss_cfg.distill_temperature) == (0.3, 2.0)
    assert LossConfig.from_training(config_from_args(["--model-name", "m"])).distill_coef == 0.0
    with pytest.raises(SystemExit):
        config_from_args(["--model-name", "m", "--distill-only", "true"])


def _trainer_batch():
    tokens = [[5, 6, 7, 8, 9, 10], [5, 6, 11, 12, 13, 14]]
    masks = [[-100, -100, 7, 8, 9, 10], [-100, -100, 11, 12, 13, 14]]
    taught = _distill_group(tokens, masks)
    taught["distill_logprobs"] = [[[-0.05, -3.0, -4.0] for _ in seq] for seq in tokens]
    plain = {"tokens": tokens, "masks": masks, "scores": [1.0, 1.0]}
    return [taught, plain]


def test_the_trainer_distils_a_real_model(tiny_model_dir, tmp_path):
    """The real trainer on the tiny model: --distill-only steps bring the policy's reverse
    KL to the teacher down; only the taught group's trained tokens count."""
    from example_trainer.config import TrainingConfig
    from example_trainer.trainers import GRPOTrainer

    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        save_path=str(tmp_path),
        device="cpu",
        optimizer="adamw",
        lr=2e-2,
        batch_size=4,
        pad_to_multiple=8,
        progress=False,
        distill_enabled=True,
        distill_only=True,
    )
    trainer = GRPOTrainer(cfg)
    batch = _trainer_batch()
    kls = [trainer.train_on_batch(batch)["distill/kl"] for _ in range(4)]
    assert kls[-1] < 0.5 * kls[0], kls
    # The mean is over the taught group's 8 trained tokens, not diluted by the plain group.
    taught = collate(group_to_samples(batch[0]), pad_to_multiple=8)
    with torch.no_grad():
        logits = trainer.model(input_ids=taught.input_ids).logits
    term = distill_divergence(logits, taught.distill_token_ids, taught.distill_logprobs)
    want = float((term * taught.distill_mask).sum() / taught.distill_mask.sum())
    assert trainer.train_on_batch(batch)["distill/kl"] == pytest.approx(want, rel=1e-3)
