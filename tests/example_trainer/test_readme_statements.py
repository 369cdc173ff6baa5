"""Statements of docs/async-rl.md and example_trainer/README.md about the trainer, each checked
against a hand computation or a run: what an absurd (−9999) sampler log-prob gets under each
``--off-policy-correction``/``--tis-mode``, what one of ``--training-steps`` is, the KL
reference's dtype and memory under ``--precision``, the clamps of every KL estimator,
GSPO's cap and asymmetric clip, and the loss table's defaults."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from example_trainer import api, trainers
from example_trainer.cli import config_from_args
from example_trainer.kl import kl_penalty
from example_trainer.loss_config import LossConfig
from example_trainer.off_policy import CorrectionConfig
from example_trainer.trainers import GRPOTrainer
from example_trainer.training import grpo_loss, token_logprobs
from example_trainer.weight_sync import WeightSync
from tests.example_trainer.conftest import cpu_config, make_batch


def _two_way(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-way logits whose label-0 probability at each position is ``probs[t]``."""
    q = torch.tensor(probs)
    logits = torch.stack([q.log(), (1 - q).log()], dim=-1).unsqueeze(0)
    return logits.requires_grad_(True), torch.zeros(1, len(probs), dtype=torch.long)


def _loss_grad(logits, labels, weights) -> torch.Tensor:
    """The logits' gradient of ``−Σ_t w_t·logp_t / T``: the loss whose token ``t`` gets
    ``w_t·∇logp`` (docs/async-rl.md's way of stating each mode's gradient)."""
    x = logits.detach().clone().requires_grad_(True)
    (-(torch.tensor([weights]) * token_logprobs(x, labels)).sum() / labels.numel()).backward()
    return x.grad


# --- example_trainer/README.md, "One absurd sampler log-prob" --------------------------------
# "the log-ratio is clamped at ±20 in every mode ... Under `none` and `icepop` such a token then
# gets no gradient; under `tis` a token with `A < 0` gets the truncated `C·A·∇logp` (bounded,
# not zero; with `A > 0` it is in the clip zone: 0), and under `--tis-mode truncate` every such
# token gets `C·A·∇logp`."

C = 2.5
ABSURD_CASES = [
    # (mode, tis_mode, advantage, the docs' gradient weight of the −9999 token)
    ("none", "clip-zone-zero", -1.5, 0.0),
    ("none", "clip-zone-zero", 1.5, 0.0),
    ("icepop", "clip-zone-zero", -1.5, 0.0),
    ("icepop", "clip-zone-zero", 1.5, 0.0),
    ("tis", "clip-zone-zero", -1.5, C * -1.5),
    ("tis", "clip-zone-zero", 1.5, 0.0),
    ("tis", "truncate", -1.5, C * -1.5),
    ("tis", "truncate", 1.5, C * 1.5),
]


@pytest.mark.parametrize("mode, tis_mode, adv, weight", ABSURD_CASES)
def test_an_absurd_sampler_logprob_gets_the_gradient_readme_states(mode, tis_mode, adv, weight):
    # Token 0: the sampler agrees with the trainer (r = 1, plain A·∇logp in every mode);
    # token 1: the sampler wrote −9999 for a token the trainer gives 0.3.
    logits, labels = _two_way([0.5, 0.3])
    inference = torch.tensor([[math.log(0.5), -9999.0]])
    config = LossConfig(off_policy=CorrectionConfig(mode, clip=C, tis_mode=tis_mode))
    out = grpo_loss(
        logits, labels, torch.tensor([adv]), inference_logprobs=inference, config=config
    )
    assert torch.isfinite(out.loss)
    out.loss.backward()
    torch.testing.assert_close(logits.grad, _loss_grad(logits, labels, [adv, weight]))
    # The ratio to the sampler is e^20 (the clamp), not inf; `off_policy/clip_fraction` is
    # docs/async-rl.md's "share truncated or dropped": that token, one of two.
    m = out.metrics
    sampler_ratio = m["off_policy/mean_ratio"] if mode != "none" else m["grpo/mean_ratio"]
    assert float(sampler_ratio) == pytest.approx((1.0 + math.exp(20.0)) / 2, rel=1e-5)
    if mode != "none":
        assert float(m["off_policy/clip_fraction"]) == pytest.approx(0.5)


def test_no_correction_pushes_a_negative_advantage_with_the_whole_ratio():
    # docs/async-rl.md, `--off-policy-correction none`: "a token with `A < 0` and a huge `r` pushes
    # with `r·A`"; `tis` bounds the same token by `C·|A|`.
    logits, labels = _two_way([0.5])
    inference = torch.tensor([[math.log(0.01)]])  # r = 50
    adv = torch.tensor([-2.0])
    for config, weight in (
        (LossConfig(), 50.0 * -2.0),
        (LossConfig(off_policy=CorrectionConfig("tis", clip=C)), C * -2.0),
    ):
        x = logits.detach().clone().requires_grad_(True)
        grpo_loss(x, labels, adv, inference_logprobs=inference, config=config).loss.backward()
        torch.testing.assert_close(x.grad, _loss_grad(logits, labels, [weight]), rtol=1e-4, atol=0)


def test_tis_truncate_weights_every_token_by_the_capped_ratio_to_the_sampler():
    # example_trainer/README.md, `--tis-mode truncate`: "every token's loss is multiplied by the
    # constant `w = min(exp(old − b), C)` and PPO's clip is taken against the trainer's own `old`
    # log-probs ..., so a clip-zone token gets `min(r, C)·A·∇logp`"; docs/async-rl.md's `tis`: that
    # token gets 0 under the default mode. Ratios to the sampler 1.5, 4 and 0.5, A = +1.
    logits, labels = _two_way([0.6, 0.8, 0.2])
    inference = torch.log(torch.tensor([[0.4, 0.2, 0.4]]))
    adv = torch.tensor([1.0])
    grads = {}
    for tis_mode in ("truncate", "clip-zone-zero"):
        x = logits.detach().clone().requires_grad_(True)
        cfg = LossConfig(off_policy=CorrectionConfig("tis", clip=C, tis_mode=tis_mode))
        grpo_loss(x, labels, adv, inference_logprobs=inference, config=cfg).loss.backward()
        grads[tis_mode] = x.grad
    torch.testing.assert_close(grads["truncate"], _loss_grad(logits, labels, [1.5, C, 0.5]))
    # clip-zone-zero: 1.5 and 4 are past 1 + ε with A > 0 (0); 0.5 is active (0.5·A).
    torch.testing.assert_close(grads["clip-zone-zero"], _loss_grad(logits, labels, [0, 0, 0.5]))


# --- example_trainer/README.md and CONFIG.md: what one of --training-steps is ----------------
# "`--training-steps` counts API batches: each is `--ppo-epochs × --mini-batches` optimizer steps
# (one by default) and one learning-rate scheduler step; `train/lr` is the rate that batch's
# updates used." CONFIG.md: "Number of API batches to train on; each takes --ppo-epochs x
# --mini-batches optimizer steps".


def test_training_steps_counts_api_batches_against_a_real_run_api(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Three API batches of 4 sequences (2 groups of 2) wait in the queue; two are trained on.
    groups = make_batch(tiny_tokenizer, n_groups=6, group_size=2, seed=11)
    real_register = api.register_trainer

    def register_then_queue(config, starting_step=0, **fields):
        answer = real_register(config, starting_step, **fields)  # registration resets the queue
        for g in groups:
            r = httpx.post(f"{url}/scored_data", json=g, timeout=10)
            assert r.status_code == 200, r.text
        return answer

    monkeypatch.setattr(api, "register_trainer", register_then_queue)
    # No inference server in this test: the base class's sync pushes nothing.
    monkeypatch.setattr(trainers, "make_weight_sync", lambda c, m, t: WeightSync(c, m, t))
    cfg = cpu_config(
        tiny_model_dir, tmp_path, atropos_url=url, training_steps=2, ppo_epochs=2, batch_size=2,
        mini_batches=2, batch_poll_interval=0.05, warmup_steps=4,
    )  # fmt: skip
    with running_process(
        run_api_cmd(port, "--log-level", "warning"), health_url=f"{url}/health", timeout=60
    ):
        trainer = GRPOTrainer(cfg)
        optimizer_steps = []
        apply = trainer.update.apply

        def counting_apply(finite: bool) -> None:
            optimizer_steps.append(trainer.optimizer.param_groups[0]["lr"])
            apply(finite)

        trainer.update.apply = counting_apply
        final = trainer.train()
        # The third batch is still queued: the trainer trained on exactly two.
        left = httpx.get(f"{url}/batch", timeout=10).json()["batch"]
    assert final is not None and trainer.step == 2
    assert left is not None and len(left) == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # 2 batches × 2 epochs × 2 mini-batches optimizer steps; one scheduler step per batch, so
    # the four updates of a batch share its warmup rate (s + 1)/4 · lr.
    assert optimizer_steps == pytest.approx([2.5e-4] * 4 + [5e-4] * 4)
    assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {8.0}
    assert trainer.scheduler.last_epoch == 2
    assert [r["train/lr"] for r in rows] == pytest.approx([2.5e-4, 5e-4])


# --- example_trainer/README.md, "The KL reference's memory" ------------------------------------
# "a frozen copy of the policy, held in the compute dtype of `--precision` (no gradient, no
# optimizer state): 2 bytes per parameter under `bf16-mixed`, `fp16-mixed` and `bf16-pure`, 4
# under `fp32`". (fp16-mixed needs CUDA; the CPU checks the other three.)


@pytest.mark.parametrize(
    "precision, dtype, param_bytes",
    [("fp32", "float32", 4), ("bf16-mixed", "bfloat16", 2), ("bf16-pure", "bfloat16", 2)],
)
def test_the_kl_reference_takes_the_bytes_per_parameter_readme_states(
    tiny_model_dir, tmp_path, precision, dtype, param_bytes
):
    trainer = GRPOTrainer(
        cpu_config(tiny_model_dir, tmp_path, kl_coef=0.1, precision=precision, dtype=dtype)
    )
    ref = list(trainer.ref_model.parameters())
    n = sum(p.numel() for p in ref)
    assert n == sum(p.numel() for p in trainer.model.parameters())  # a copy of the policy
    assert sum(p.numel() * p.element_size() for p in ref) == param_bytes * n
    assert not any(p.requires_grad or p.grad is not None for p in ref)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in ref}


# --- example_trainer/README.md, `--kl-estimator` -------------------------------------------------
# "`x = clamp(ref_logp − logp, −20, 20)`; k1 `−x`, k2 `x²/2`, k3 `e^x − x − 1` clamped to
# `[−10, 10]` ...; a clamped token gets no KL gradient"


@pytest.mark.parametrize(
    "estimator, far, near",
    [
        ("k1", [-20.0, 20.0], [-0.5, 0.5]),
        ("k2", [200.0, 200.0], [0.125, 0.125]),
        # k3 at x = ±20 is e^20 − 21 and e^−20 + 19, both past its own clamp at 10
        ("k3", [10.0, 10.0], [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5]),
    ],
)
def test_every_kl_estimator_clamps_the_log_ratio_at_20(estimator, far, near):
    # x = ref − logp: 25, −25 (past the clamp), 0.5, −0.5.
    logp = torch.tensor([-30.0, -5.0, -2.0, -1.0], requires_grad=True)
    ref = torch.tensor([-5.0, -30.0, -1.5, -1.5])
    kl = kl_penalty(logp, ref, estimator)
    assert kl.tolist()[:2] == pytest.approx(far)
    assert kl.tolist()[2:] == pytest.approx(near, rel=1e-6)
    kl.sum().backward()
    assert logp.grad[:2].tolist() == [0.0, 0.0]  # clamped: no KL gradient
    assert all(g != 0 for g in logp.grad[2:].tolist())


# --- example_trainer/README.md, `--importance-sampling-level sequence` -------------------------
# "one ratio per sequence, `s_i = exp(mean_t (logp − b))` (value capped at `e^10`), clipped to
# `[1 − ε_low, 1 + ε_high]`, each token's gradient `s_i·∇logp_t`"


def test_gspo_clips_each_sequence_asymmetrically_and_caps_its_ratio():
    probs = [[0.5, 0.4], [0.5, 0.4], [0.5, 0.4], [0.5, 0.4]]
    # mean log-ratios per sequence: log 1.25, log 0.85, log 1.35, 12 (capped at 10)
    shifts = [math.log(1.25), math.log(0.85), math.log(1.35), 12.0]
    q = torch.tensor(probs)
    logits = torch.stack([q.log(), (1 - q).log()], dim=-1).requires_grad_(True)
    labels = torch.zeros(4, 2, dtype=torch.long)
    lp = q.log()
    # per-token gaps differ (±0.1) but average to the sequence's shift
    inference = lp - torch.tensor(shifts).unsqueeze(-1) + torch.tensor([[0.1, -0.1]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    cfg = LossConfig(clip_eps=0.1, clip_eps_high=0.3, importance_sampling_level="sequence")
    out = grpo_loss(logits, labels, adv, inference_logprobs=inference, config=cfg)
    # values: 1.25 active; 0.85 < 0.9 with A < 0: clipped at 0.9; 1.35 > 1.3: clipped at 1.3;
    # e^10 with A < 0: min(e^10·A, 1.3·A) = −e^10 (the cap, not e^12)
    surrogate = [1.25, -0.9, 1.3, -math.exp(10.0)]
    assert out.loss.item() == pytest.approx(-sum(2 * s for s in surrogate) / 8, rel=1e-5)
    out.loss.backward()
    # gradient s_i·A_i·∇logp_t on the active sequence; 0 where clipped or past the cap
    weights = torch.tensor([[1.25] * 2, [0.0] * 2, [0.0] * 2, [0.0] * 2])
    x = logits.detach().clone().requires_grad_(True)
    (-(weights * token_logprobs(x, labels)).sum() / 8).backward()
    torch.testing.assert_close(logits.grad, x.grad)


# --- example_trainer/README.md: the loss table's defaults ---------------------------------------


def test_the_loss_tables_defaults_are_the_configs():
    c = config_from_args(["--model-name", "m"])
    table = {
        "loss_type": "token-mean",
        "scale_rewards": "group",
        "clip_eps": 0.2,
        "clip_eps_high": None,  # "= --clip-eps"
        "clip_ratio_c": None,  # "off"
        "ppo_epochs": 1,
        "mini_batches": 1,
        "mask_truncated": False,
        "entropy_coef": 0.0,
        "log_entropy": True,
        "kl_coef": 0.0,
        "kl_estimator": "k3",
        "kl_in_reward": False,
        "importance_sampling_level": "token",
        "off_policy_correction": "none",
        "off_policy_clip": 2.0,
        "off_policy_clip_low": 0.5,
        "tis_mode": "clip-zone-zero",
        "fp32_lm_head": False,
        "overlong_penalty_len": 0,
        "overlong_penalty_factor": 1.0,
        "distill_enabled": False,
        "distill_coef": 1.0,
        "distill_temperature": 1.0,
        "distill_only": False,
        "disable_dropout": False,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "lr_scheduler": "constant",
        "min_lr_ratio": 0.0,
        "max_consecutive_skipped_steps": 5,
    }
    assert {k: getattr(c, k) for k in table} == table


# --- example_trainer/README.md, "Env-supplied `ref_logprobs`" -----------------------------------
# "the frozen reference model scores the rest (and is not run for a micro-batch whose every
# token has one, in single-process runs)"


def test_the_reference_model_is_not_run_where_the_env_sent_every_ref_logprob(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, kl_coef=0.1))
    calls = []
    trainer.ref_model.register_forward_hook(lambda *a: calls.append(1))
    batch = make_batch(tiny_tokenizer, n_groups=2, group_size=4, seed=5)
    trainer.train_on_batch(batch)
    assert len(calls) == 2  # two micro-batches of 4, no env values: the model scores both
    for group in batch:
        group["ref_logprobs"] = [[-30.0] * len(t) for t in group["tokens"]]
    calls.clear()
    m = trainer.train_on_batch(batch)
    assert calls == []
    assert m["train/kl"] == pytest.approx(10.0)  # the env's values: x < −20, k3 clamped at 10


# --- example_trainer/README.md, `--max-consecutive-skipped-steps` -------------------------------
# "a step whose gradient is not finite is skipped (weights and optimizer state kept,
# `train/skipped_steps` counts them); `n` in a row stop the run (exit 1) with a message; 0 = never
# stop"


def test_zero_consecutive_skipped_steps_never_stops_the_run(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, max_consecutive_skipped_steps=0))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.model.register_forward_hook(
        lambda m, a, out: setattr(out, "logits", out.logits * math.nan)
    )
    for k in (1, 2):
        m = trainer.train_on_batch(make_batch(tiny_tokenizer, seed=k))
        assert m["train/skipped_steps"] == k
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
