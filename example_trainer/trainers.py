"""The GRPO training loop: fetch a batch, take an optimizer step, sync weights.

One readable loop shared by every weight-bridge mode; the mode only decides which
:class:`~example_trainer.weight_sync.WeightSync` pushes the weights.

Throughput (a GPU waits for nothing it does not need):

- the next API batch is fetched and turned into per-sequence samples on a
  background thread while the current step finishes on the device (it is requested
  only once the current step's optimizer update has been issued, because fetching
  acknowledges the previous batch to the API);
- micro-batches are padded on the host while the device runs the previous one;
- every statistic stays a device tensor until the end of the step, where all of them
  are read back in one transfer: one host sync per optimizer step.

Multi-process runs (``torchrun``) follow :mod:`example_trainer.distributed`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import json
import logging
import math
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Sequence

import torch

from . import api, supervision
from .batching import (  # noqa: F401  (split_mini_batches: re-exported)
    MiniBatchInfo,
    PreparedBatch,
    prepare_batch,
    split_mini_batches,
)
from .checkpointing import find_latest_checkpoint, load_trainer_state, save_checkpoint
from .config import TrainingConfig
from .data import IGNORE_INDEX, MicroBatch, Sample, collate
from .distributed import (
    full_model_state_dict,
    full_optimizer_state_dict,
    init_distributed,
    load_optimizer_state_dict,
    shard_model,
)
from .kl import kl_penalty
from .loss_config import LossConfig
from .model import build_optimizer, build_scheduler, load_model, param_groups, setup_model
from .off_policy import staleness_metrics
from .precision import LOST_UPDATE_WARNING, fp32_lm_head, policy_for
from .reward_shaping import apply_kl_in_reward
from .training import compute_grpo_loss, token_logprobs
from .weight_sync import WeightSync, make_weight_sync

logger = logging.getLogger(__name__)

# Statistics averaged over the step's label tokens (weighted by each micro-batch's share).
_MEAN_KEYS = (
    "grpo/mean_ratio",
    "grpo/clipped_fraction",
    "train/logp",
    "train/pos_logp",
    "train/neg_logp",
    "logprobs/training_mean",
    "logprobs/training_std",
    "grpo/has_inference_logprobs",
    "logprobs/inference_mean",
    "logprobs/inference_std",
    "alignment/diff_mean",
    "alignment/diff_abs_mean",
    "train/kl",
    "off_policy/mean_ratio",
    "off_policy/clip_fraction",
    "off_policy/mismatch_kl",
    "train/entropy",
    "grpo/dual_clipped_fraction",
    "distill/kl",
)
_SAMPLER_KEYS = frozenset(
    {
        "logprobs/inference_mean",
        "logprobs/inference_std",
        "alignment/diff_mean",
        "alignment/diff_abs_mean",
        "off_policy/mean_ratio",
        "off_policy/clip_fraction",
        "off_policy/mismatch_kl",
    }
)
"""Statistics over the tokens with a sampler log-prob: weighted by those tokens' count, so a
micro-batch without sampler log-probs does not dilute them."""
_DISTILL_KEYS = frozenset({"distill/kl"})
"""Means over the tokens with a teacher row (weighted by ``distill/tokens``)."""
_COUNTED_KEYS = _SAMPLER_KEYS | _DISTILL_KEYS
_SUM_KEYS = ("train/num_tokens", "train/loss")
_MAX_KEYS = ("alignment/diff_max", "train/grad_norm")


class MetricsWriter:
    """Append one JSON line per step to ``metrics.jsonl`` and, optionally, to W&B."""

    def __init__(self, config: TrainingConfig) -> None:
        self.path = Path(config.metrics_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.wandb = None
        if config.use_wandb:
            import wandb

            wandb.init(
                project=config.wandb_project, group=config.wandb_group, config=config.model_dump()
            )
            self.wandb = wandb

    def log(self, metrics: Dict[str, float], step: int) -> None:
        """Record ``metrics`` for ``step``."""
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def summary(self, values: Dict[str, float]) -> None:
        """Final summary values (``benchmark/*``)."""
        if self.wandb is not None:
            self.wandb.run.summary.update(values)

    def close(self) -> None:
        """Finish the W&B run."""
        if self.wandb is not None:
            self.wandb.finish()


class Progress:
    """A rich progress bar showing step, loss, mean score and tokens/s (or nothing)."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
            )
            self._task = self._progress.add_task(
                "train", total=total, completed=completed, info="waiting for data"
            )
            self._progress.start()

    def update(self, step: int, info: str) -> None:
        """Move the bar to ``step`` with a status line."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        else:
            logger.info("step %d %s", step, info)

    def close(self) -> None:
        """Stop rendering."""
        if self._progress is not None:
            self._progress.stop()


class TrainingDivergedError(RuntimeError):
    """Too many optimizer steps in a row had a gradient that is not finite."""


class GRPOTrainer:
    """Owns model, optimizer, API client and weight sync for one training run (one rank)."""

    def __init__(self, config: TrainingConfig) -> None:
        self.ctx, device = init_distributed(config)
        if device != config.device:
            config = config.model_copy(update={"device": device})
        self.config = config
        self.policy = policy_for(config)
        if self.policy.name == "bf16-pure":
            logger.warning(LOST_UPDATE_WARNING)
        logger.info("precision %s (weights %s)", self.policy.name, self.policy.param_dtype)
        torch.manual_seed(config.seed)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.step = 0
        self.trained_batch_id: str | None = None  # batch_id of the last batch trained on
        resume_dir = self.ctx.broadcast(
            find_latest_checkpoint(config.save_path) if config.resume and self.ctx.is_main else None
        )
        # Several processes: load on the host and let sharding move one shard per rank to
        # the device, so a model larger than one GPU never has to fit on one.
        load_config = config.model_copy(update={"device": "cpu"}) if self.ctx.enabled else config
        self.model, self.tokenizer = setup_model(
            load_config, str(resume_dir) if resume_dir else None
        )
        self.loss_config = LossConfig.from_training(config)
        if config.fp32_lm_head:
            fp32_lm_head(self.model)
        self.ref_model = (
            self._make_reference(load_config, resumed=resume_dir is not None)
            if self.loss_config.needs_reference
            else None
        )
        if self.ctx.enabled:
            shard_model(self.model, config.device, self.ctx.world_size)
            if self.ref_model is not None:
                shard_model(self.ref_model, config.device, self.ctx.world_size)
        self.optimizer = build_optimizer(param_groups(self.model, config), config)
        self.scheduler = build_scheduler(
            self.optimizer,
            config.warmup_steps,
            config.lr_scheduler,
            config.training_steps,
            config.min_lr_ratio,
        )
        self.scaler = self.policy.make_scaler()
        self.skipped_steps = 0  # optimizer steps refused for a non-finite gradient
        self._skipped_in_row = 0
        if resume_dir is not None:
            self._restore(resume_dir)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._pin = self.policy.device_type == "cuda"

    def _restore(self, resume_dir: Path) -> None:
        state = load_trainer_state(resume_dir, with_optimizer=self.ctx.is_main)
        opt_state = state.optimizer
        if opt_state is not None and not self.ctx.enabled and _keyed_by_position(opt_state):
            self.optimizer.load_state_dict(opt_state)  # checkpoint of an earlier version
        else:
            load_optimizer_state_dict(self.model, self.optimizer, opt_state, self.ctx)
        self._apply_optimizer_settings()
        if state.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
            self._apply_lr(state.step)
        if state.rng is not None:
            torch.set_rng_state(state.rng)
        extra = state.extra or {}
        cuda_rng = extra.get("cuda_rng")
        if cuda_rng and torch.cuda.is_available():
            for index, rng in enumerate(cuda_rng[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(rng, index)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self.step = state.step
        self.trained_batch_id = state.last_batch_id
        logger.info("resumed from %s at step %d", resume_dir, self.step)

    def _apply_optimizer_settings(self) -> None:
        """Set each parameter group's weight decay, betas and eps from this run's config.

        Loading an optimizer state also loads the hyperparameters it was saved with; the
        flags given to the resumed run win (and a checkpoint from before norms and
        embeddings were exempt from weight decay stops decaying them).
        """
        cfg = self.config
        decay_of = {
            id(p): g["weight_decay"] for g in param_groups(self.model, cfg) for p in g["params"]
        }
        for group in self.optimizer.param_groups:
            decays = {decay_of.get(id(p)) for p in group["params"]}
            if len(decays) == 1 and None not in decays:
                group["weight_decay"] = decays.pop()
            if "betas" in group:  # the AdamW family (Adafactor's eps is a pair of its own)
                group["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
                group["eps"] = cfg.adam_eps

    def _apply_lr(self, step: int) -> None:
        """After loading a checkpoint, the schedule continues with this run's ``--lr`` as
        its peak rate (the checkpoint's is replaced, and a change is logged in one line)."""
        new = self.config.lr
        saved = self.scheduler.base_lrs[0] if self.scheduler.base_lrs else new
        if not math.isclose(saved, new, rel_tol=1e-12):
            logger.warning(
                "--lr %g differs from the checkpoint's %g: the schedule continues from step %d "
                "with peak rate %g",
                new,
                saved,
                step,
                new,
            )
        self.scheduler.base_lrs = [new for _ in self.optimizer.param_groups]
        last = self.scheduler.last_epoch
        for group, factor in zip(
            self.optimizer.param_groups, self.scheduler.lr_lambdas, strict=True
        ):
            group["initial_lr"] = new
            group["lr"] = new * factor(last)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def seed_batch_client(self) -> None:
        """Tell the API client which batch the restored weights last trained on, so a batch
        the API serves again after a crash is acknowledged and skipped, not trained twice."""
        if self.trained_batch_id is not None:
            api.batch_client(self.config.atropos_url).last_batch_id = self.trained_batch_id

    def _make_reference(self, load_config: TrainingConfig, resumed: bool) -> torch.nn.Module:
        """A frozen copy of the policy the run started from (the KL anchor), its weights
        in the compute dtype of ``--precision``.

        After ``--resume`` the loaded model holds the checkpoint's trained weights (or
        adapter), so the reference is loaded again from ``model_name`` instead.
        """
        if resumed:
            ref = load_model(load_config.model_name, load_config)
        else:
            ref = copy.deepcopy(self.model)
        # No gradient and no optimizer: the weights only need the precision the forward
        # computes in (bf16 under bf16-mixed, half the fp32 master copy's memory).
        dtype = self.policy.compute_dtype or self.policy.param_dtype
        ref.to(dtype)
        if self.config.fp32_lm_head:
            fp32_lm_head(ref)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # --- one optimizer step ------------------------------------------------------------
    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if self._pin:
            return t.pin_memory().to(self.config.device, non_blocking=True)
        return t.to(self.config.device)

    def _micro_batches(
        self, share: List[Sample], n_micro: int
    ) -> Iterator[tuple[MicroBatch, bool] | None]:
        """Padded micro-batches of this rank's share (with "all temperatures are 1"),
        then ``None`` up to ``n_micro``.

        Padding happens here, lazily, so the host pads micro-batch i+1 while the device
        still runs micro-batch i. A ``None`` is an empty micro-batch: the rank still runs
        a forward/backward so that the sharded model's collectives stay in step with
        the other ranks.
        """
        cfg = self.config
        for i in range(n_micro):
            chunk = share[i * cfg.batch_size : (i + 1) * cfg.batch_size]
            if not chunk:
                yield None
                continue
            mb = collate(chunk, self.pad_id, cfg.pad_to_multiple, cfg.seq_len)
            yield mb, all(s.temperature == 1.0 for s in chunk)

    def _forward_logits(self, model: torch.nn.Module, input_ids, attention_mask) -> torch.Tensor:
        with self.policy.autocast():
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _micro_step(
        self,
        item: tuple[MicroBatch, bool] | None,
        info: MiniBatchInfo,
        old_logprobs: torch.Tensor | None = None,
    ) -> Dict[str, torch.Tensor] | None:
        """Forward/backward of one micro-batch of an optimizer step described by ``info``.

        ``old_logprobs`` (when a batch is trained on in several optimizer steps) are the
        policy's log-probs before the batch's first step: the ratio's reference for the
        tokens without a sampler log-prob.
        """
        cfg = self.config
        if item is None:
            logits = self._padding_forwards(grad=True)
            self._backward(logits.sum() * 0.0)
            return None
        mb, unit_temperature = item
        input_ids = self._to_device(mb.input_ids)
        attention_mask = self._to_device(mb.attention_mask)
        labels = self._to_device(mb.labels)
        temps = None if unit_temperature else self._to_device(mb.temperatures)
        ref_lp = None
        if self.ref_model is not None:  # before the policy, as in _padding_forwards
            ref_lp = self._reference_logprobs(mb, input_ids, attention_mask, labels, temps)
        logits = self._forward_logits(self.model, input_ids, attention_mask)
        out = compute_grpo_loss(
            logits,
            labels,
            self._to_device(mb.advantages),
            temps,
            self._to_device(mb.inference_logprobs),
            inference_mask=self._to_device(mb.inference_mask),
            old_logprobs=old_logprobs,
            ref_logprobs=ref_lp,
            normalizer=max(info.label_tokens, 1),
            num_sequences=max(info.num_sequences, 1),
            max_tokens=cfg.seq_len,
            distill_token_ids=self._to_device(mb.distill_token_ids),
            distill_logprobs=self._to_device(mb.distill_logprobs),
            distill_mask=self._to_device(mb.distill_mask),
            **self.loss_config.loss_kwargs(),
        )
        # FSDP averages gradients over the ranks; the loss is already normalised by the
        # whole batch's tokens, so scale it back up to get the one-process gradient.
        self._backward(out.loss * self.ctx.world_size)
        out.metrics["train/loss"] = out.loss.detach()
        return out.metrics

    def _padding_forwards(self, grad: bool) -> torch.Tensor:
        """An empty micro-batch: the same forwards as a real one (reference, then policy),
        so that the sharded models' collectives stay in step with the other ranks.
        Returns the policy's logits."""
        ids, attention = self._padding_ids()
        if self.ref_model is not None:
            with torch.no_grad():
                self._forward_logits(self.ref_model, ids, attention)
        with torch.set_grad_enabled(grad):
            return self._forward_logits(self.model, ids, attention)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _reference_logprobs(
        self,
        mb: MicroBatch,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        temps: torch.Tensor | None,
    ) -> torch.Tensor:
        """The reference's log-probs: the environment's ``ref_logprobs`` where it sent
        them, the frozen reference model's elsewhere."""
        env_ref = self._to_device(mb.ref_logprobs)
        if (
            env_ref is not None
            and not self.ctx.enabled  # every rank must run the same forwards
            and bool(mb.ref_mask[mb.labels != IGNORE_INDEX].all())
        ):
            return env_ref
        with torch.no_grad():
            ref_lp = token_logprobs(
                self._forward_logits(self.ref_model, input_ids, attention_mask), labels, temps
            )
        if env_ref is None:
            return ref_lp
        return torch.where(self._to_device(mb.ref_mask), env_ref, ref_lp)

    def _clip_gradients(self) -> torch.Tensor:
        """Unscale (fp16), clip to ``max_grad_norm`` and return the global gradient norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        return grad_norm.to(self.config.device)

    def _apply_update(self, finite: bool) -> None:
        """Take the optimizer step, or refuse it when the gradient is not finite.

        A refused step keeps the weights and the optimizer state (AdamW would otherwise
        spread one NaN into every weight), is logged and counted; after
        ``max_consecutive_skipped_steps`` refusals in a row the run stops. Under fp16 the
        grad scaler skips such steps itself (and lowers its scale): that is its normal
        calibration, not counted here.
        """
        cfg = self.config
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif finite:
            self.optimizer.step()
            self._skipped_in_row = 0
        else:
            self.skipped_steps += 1
            self._skipped_in_row += 1
            logger.warning(
                "step %d: the gradient norm is not finite; optimizer step skipped, weights kept "
                "(%d in a row, %d in all)",
                self.step + 1,
                self._skipped_in_row,
                self.skipped_steps,
            )
        self.optimizer.zero_grad(set_to_none=True)
        limit = cfg.max_consecutive_skipped_steps
        if limit and self._skipped_in_row >= limit:
            raise TrainingDivergedError(
                f"{self._skipped_in_row} optimizer steps in a row had a non-finite gradient "
                f"(--max-consecutive-skipped-steps {limit}); stopping. Look for NaN/inf in the "
                "batch (scores, advantages, inference_logprobs) or lower --lr."
            )

    def _pre_pass(
        self, minis: List[tuple[int, List[Sample]]], prepared: PreparedBatch, want_old: bool
    ) -> Dict[tuple[int, int], torch.Tensor]:
        """Before the batch's first update: the policy's log-probs of every micro-batch
        (keyed by (mini-batch, micro-batch), when ``want_old``) and, with
        ``--kl-in-reward``, each sequence's summed KL to the reference, which
        :func:`~example_trainer.reward_shaping.apply_kl_in_reward` takes from its score."""
        old: Dict[tuple[int, int], torch.Tensor] = {}
        kl_in_reward = self.loss_config.kl_in_reward and self.ref_model is not None
        # On the training device: NCCL reduces only device tensors.
        kl_sums = torch.zeros(len(prepared.scores), dtype=torch.float64, device=self.config.device)
        with torch.no_grad():
            for k, part in minis:
                for j, item in enumerate(self._micro_batches(part, prepared.minis[k].n_micro)):
                    if item is None:
                        if kl_in_reward:
                            self._padding_forwards(grad=False)
                        else:  # only the policy runs for a real micro-batch either
                            self._forward_logits(self.model, *self._padding_ids())
                        continue
                    mb, unit_temperature = item
                    labels = self._to_device(mb.labels)
                    ids = self._to_device(mb.input_ids)
                    attention = self._to_device(mb.attention_mask)
                    temps = None if unit_temperature else self._to_device(mb.temperatures)
                    ref_lp = None
                    if kl_in_reward:
                        ref_lp = self._reference_logprobs(mb, ids, attention, labels, temps)
                    logp = token_logprobs(
                        self._forward_logits(self.model, ids, attention), labels, temps
                    )
                    if want_old:
                        old[(k, j)] = logp
                    if ref_lp is not None:
                        kl = kl_penalty(logp, ref_lp, self.loss_config.kl_estimator)
                        kl = (kl * (labels != IGNORE_INDEX)).sum(-1).double()
                        start = j * self.config.batch_size
                        for row, sample in enumerate(part[start : start + len(kl)]):
                            kl_sums[sample.index] = kl[row]
        if kl_in_reward:
            self.ctx.all_reduce(kl_sums)
            apply_kl_in_reward(
                [s for _, part in minis for s in part],
                prepared,
                kl_sums.tolist(),
                self.loss_config.kl_coef,
                self.config.scale_rewards,
            )
        return old

    def _padding_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.config.device)
        return ids, torch.ones_like(ids)

    def step_on(self, share: List[Sample], prepared: PreparedBatch) -> Dict[str, float]:
        """Forward/backward over this rank's share and its optimizer steps (one by default;
        ``ppo_epochs`` × ``mini_batches``).

        Statistics stay device tensors, combined over the ranks, and are read back to the
        host once, together with the gradient norm that decides whether the last update
        may be applied (a non-finite gradient is refused, see :meth:`_apply_update`).
        """
        cfg = self.config
        dev = cfg.device
        n_mean, n_sum = len(_MEAN_KEYS), len(_SUM_KEYS)
        acc = torch.zeros(n_mean + n_sum + n_mean, device=dev)
        peak = torch.zeros(len(_MAX_KEYS), device=dev)
        parts = prepared.rank_minis(share, self.ctx.rank)
        minis = [
            (k, part)
            for k, part in enumerate(parts)
            if not prepared.minis or prepared.minis[k].num_sequences > 0
        ]
        schedule = [(k, part) for _ in range(cfg.ppo_epochs) for k, part in minis]
        # Reused samples need the pre-update policy as the ratio's reference: after the
        # first update the current policy no longer is.
        want_old = len(schedule) > 1
        old = {}
        if want_old or (self.loss_config.kl_in_reward and self.ref_model is not None):
            old = self._pre_pass(minis, prepared, want_old)
        total = max(prepared.label_tokens, 1) * cfg.ppo_epochs
        raw: Dict[str, float] = {}
        for u, (k, part) in enumerate(schedule):
            info = (
                prepared.minis[k]
                if prepared.minis
                else MiniBatchInfo(prepared.label_tokens, len(share), prepared.n_micro)
            )
            for j, item in enumerate(self._micro_batches(part, info.n_micro)):
                metrics = self._micro_step(item, info, old.get((k, j)))
                if metrics is None:
                    continue
                weight = metrics["train/num_tokens"] / total
                sampled = metrics["grpo/sampler_tokens"]
                for m, key in enumerate(_MEAN_KEYS):
                    if key not in metrics:
                        continue
                    if key in _COUNTED_KEYS:  # a mean over the tokens that have the value
                        count = metrics["distill/tokens"] if key in _DISTILL_KEYS else sampled
                        acc[m] += metrics[key] * count
                        acc[n_mean + n_sum + m] += count
                    else:
                        acc[m] += metrics[key] * weight
                        acc[n_mean + n_sum + m] += 1.0
                acc[n_mean] += metrics["train/num_tokens"] / cfg.ppo_epochs
                acc[n_mean + 1] += metrics["train/loss"] / len(schedule)
                if "alignment/diff_max" in metrics:
                    peak[0] = torch.maximum(peak[0], metrics["alignment/diff_max"])
            grad_norm = self._clip_gradients()
            peak[1] = torch.maximum(peak[1], grad_norm)
            if u == len(schedule) - 1:
                self.ctx.all_reduce(acc)
                self.ctx.all_reduce(peak, op="max")
                raw = _read_back(acc, peak, grad_norm)
                finite = math.isfinite(raw.pop("_last_grad_norm"))
            else:
                finite = math.isfinite(float(grad_norm))
            self._apply_update(finite)
        lr = float(self.scheduler.get_last_lr()[0])
        with warnings.catch_warnings():
            # After a refused first step torch warns that the optimizer has not stepped yet;
            # the schedule follows the trainer's steps on purpose.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        raw["train/lr"] = lr  # the rate this batch's updates used, not the next one
        raw["train/skipped_steps"] = float(self.skipped_steps)
        return raw

    def _host_metrics(
        self, raw: Dict[str, float], prepared: PreparedBatch, t0: float
    ) -> Dict[str, float]:
        """The step's statistics (read back by :meth:`step_on`) plus timing and memory."""
        agg = dict(raw)
        step_time = time.perf_counter() - t0
        agg.update(
            {
                "train/step_time": step_time,
                "train/tokens_per_second": prepared.input_tokens / max(step_time, 1e-9),
                "train/input_tokens": float(prepared.input_tokens),
            }
        )
        if self.policy.device_type == "cuda":
            agg["train/gpu_memory_gb"] = torch.cuda.memory_allocated() / 1e9
            agg["train/gpu_memory_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        if self.scaler is not None:
            agg["train/grad_scale"] = float(self.scaler.get_scale())
        return agg

    def train_on_batch(self, batch: List[Dict[str, Any]] | None) -> Dict[str, float]:
        """Train on one API batch (given on rank 0; other ranks pass None) and return its metrics."""
        prepared = self.prepare(batch) if self.ctx.is_main else None
        return self._train_prepared(prepared)

    def prepare(self, batch: Sequence[Dict[str, Any]]) -> PreparedBatch:
        """:func:`prepare_batch` with this run's settings (length, reward scaling, masking)."""
        cfg = self.config
        return prepare_batch(
            batch,
            self.ctx.world_size,
            cfg.batch_size,
            seq_len=cfg.seq_len,
            scale_rewards=cfg.scale_rewards,
            mask_truncated=cfg.mask_truncated,
            mini_batches=cfg.mini_batches,
            overlong=(
                (cfg.seq_len, cfg.overlong_penalty_len, cfg.overlong_penalty_factor)
                if cfg.overlong_penalty_len > 0
                else None
            ),
        )

    def _train_prepared(self, prepared: PreparedBatch | None) -> Dict[str, float]:
        t0 = time.perf_counter()
        share, meta = self._distribute(prepared)
        metrics = self._host_metrics(self.step_on(share, meta), meta, t0)
        metrics.update(meta.summary)
        return metrics

    def _distribute(self, prepared: PreparedBatch | None) -> tuple[List[Sample], PreparedBatch]:
        """Rank 0 hands every rank its share; the shared counts travel with it."""
        if not self.ctx.enabled:
            assert prepared is not None
            return prepared.shares[0], prepared
        per_rank = None
        if prepared is not None:
            shares, prepared.shares = prepared.shares, []
            per_rank = [(share, prepared) for share in shares]
        return self.ctx.scatter(per_rank)

    # --- the loop ----------------------------------------------------------------------
    def _fetch(self, stop: threading.Event | None = None) -> PreparedBatch:
        cfg = self.config
        t = time.perf_counter()
        batch = api.wait_for_batch(
            cfg.atropos_url,
            cfg.batch_poll_interval,
            cfg.batch_wait_timeout,
            should_stop=lambda: supervision.stopping() or (stop is not None and stop.is_set()),
        )
        prepared = self.prepare(batch)
        prepared.fetch_time = time.perf_counter() - t
        # Read here, in the one thread that fetches: the client's id moves on with prefetching.
        prepared.batch_id = api.batch_client(cfg.atropos_url).last_batch_id
        return prepared

    def _save(self, name: str | None = None) -> Path | None:
        cfg = self.config
        model_state = full_model_state_dict(self.model, self.ctx)
        optimizer_state = full_optimizer_state_dict(self.model, self.optimizer, self.ctx)
        return self.ctx.on_main(
            lambda: save_checkpoint(
                self.model,
                self.tokenizer,
                self.optimizer,
                self.scheduler,
                self.step,
                cfg.save_path,
                name=name,
                model_state=model_state,
                optimizer_state=optimizer_state,
                world_size=self.ctx.world_size,
                last_batch_id=self.trained_batch_id,
                extra=self._extra_state(),
            ),
            "saving a checkpoint",
        )

    def _extra_state(self) -> Dict[str, Any]:
        """What a checkpoint keeps besides weights, optimizer, scheduler and CPU RNG."""
        return {
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": self.skipped_steps,
        }

    def train(self) -> Path | None:
        """Register with the API, train ``training_steps`` steps, save ``final_model``.

        Returns the final model directory (None on ranks other than 0).
        """
        cfg, ctx = self.config, self.ctx
        sync: WeightSync | None = None
        writer: MetricsWriter | None = None
        progress: Progress | None = None
        # Ends the prefetch thread's batch wait when training ends for any reason.
        stop_fetch = threading.Event()
        fetch = functools.partial(self._fetch, stop_fetch)

        def setup() -> None:
            nonlocal sync, writer, progress
            Path(cfg.save_path).mkdir(parents=True, exist_ok=True)
            api.check_atropos_api(cfg.atropos_url)
            api.register_trainer(cfg, starting_step=self.step)
            self.seed_batch_client()
            sync = make_weight_sync(cfg, self.model, self.tokenizer)
            writer = MetricsWriter(cfg)
            progress = Progress(cfg.progress, cfg.training_steps, self.step)
            sync.start()

        totals = {"tokens": 0.0, "time": 0.0}
        try:
            ctx.on_main(setup, "starting (API registration, inference server)")
            pending = _in_background(fetch) if ctx.is_main else None
            while self.step < cfg.training_steps:
                t0 = time.perf_counter()
                # Every rank takes part in on_main's collective; only rank 0 has a future.
                prepared = ctx.on_main(functools.partial(_result, pending), "fetching a batch")
                share, meta = self._distribute(prepared)
                device_metrics = self.step_on(share, meta)
                self.step += 1
                self.trained_batch_id = meta.batch_id
                if ctx.is_main and self.step < cfg.training_steps:
                    pending = _in_background(fetch)  # overlaps the device finishing this step
                metrics = self._host_metrics(device_metrics, meta, t0)
                metrics.update(meta.summary)
                metrics.update(staleness_metrics(meta.summary, self.step - 1))
                metrics["train/data_fetch_time"] = meta.fetch_time
                totals["tokens"] += metrics["train/input_tokens"]
                totals["time"] += metrics["train/step_time"]
                if (
                    cfg.checkpoint_interval > 0
                    and self.step % cfg.checkpoint_interval == 0
                    and self.step < cfg.training_steps
                ):
                    self._save()
                metrics["train/sync_time"] = self._sync_weights(sync)
                if ctx.is_main:
                    assert writer is not None and progress is not None
                    if getattr(sync, "last_version", None) is not None:
                        metrics["train/weights_version"] = float(sync.last_version)
                    if metrics["train/sync_time"] and hasattr(sync, "failed"):
                        # Inference servers the sync did not reach (a fleet goes on without them).
                        metrics["train/sync_failed_servers"] = float(len(sync.failed))
                    writer.log(metrics, self.step)
                    progress.update(
                        self.step,
                        (
                            f"loss {metrics['train/loss']:+.4f}  score {metrics['train/mean_score']:.3f}  "
                            f"{metrics['train/tokens_per_second']:.0f} tok/s"
                        ),
                    )
            final = self._save(name="final_adapter" if cfg.uses_lora else "final_model")
            if cfg.benchmark and writer is not None:
                writer.summary(
                    {
                        "benchmark/tokens_per_second": totals["tokens"] / max(totals["time"], 1e-9),
                        "benchmark/total_step_time": totals["time"],
                    }
                )
            return final
        finally:
            stop_fetch.set()
            if progress is not None:
                progress.close()
            if sync is not None:
                sync.close()
            if writer is not None:
                writer.close()

    def _sync_weights(self, sync: WeightSync | None) -> float:
        """Push the weights to inference when due (rank 0 drives; all ranks gather)."""
        due = self.ctx.broadcast(sync.should_sync(self.step) if sync is not None else False)
        if not due:
            return 0.0
        state = full_model_state_dict(self.model, self.ctx)
        took = self.ctx.on_main(lambda: sync.sync(self.step, state_dict=state), "weight sync")
        return float(took or 0.0)

    def close(self) -> None:
        """Leave the process group (multi-process runs)."""
        self.ctx.close()


def _in_background(fn: Any) -> concurrent.futures.Future:
    """Run ``fn`` on a daemon thread; its result or exception lands in the returned future.

    Not a ThreadPoolExecutor: the interpreter joins executor threads at exit, so a
    worker waiting for a batch would keep a stopped trainer alive.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the thread that reads the future
            future.set_exception(exc)

    threading.Thread(target=run, name="batch-prefetch", daemon=True).start()
    return future


def _read_back(acc: torch.Tensor, peak: torch.Tensor, grad_norm: torch.Tensor) -> Dict[str, float]:
    """Every statistic of a step in one device→host transfer (the step's one host sync)."""
    values = torch.cat([acc, peak, grad_norm.reshape(1).to(acc)]).tolist()
    n_mean, n_sum = len(_MEAN_KEYS), len(_SUM_KEYS)
    out: Dict[str, float] = {}
    for m, key in enumerate(_MEAN_KEYS):
        count = values[n_mean + n_sum + m]
        if count > 0:
            out[key] = values[m] / count if key in _COUNTED_KEYS else values[m]
    for m, key in enumerate(_SUM_KEYS):
        out[key] = values[n_mean + m]
    if "alignment/diff_mean" in out:
        out["alignment/diff_max"] = values[len(acc)]
    out["train/grad_norm"] = values[len(acc) + 1]
    out["_last_grad_norm"] = values[-1]
    return out


def _result(future: concurrent.futures.Future | None) -> Any:
    assert future is not None
    return future.result()


def _keyed_by_position(optimizer_state: Dict[str, Any]) -> bool:
    return any(isinstance(k, int) for k in optimizer_state.get("state", {}))


def train(config: TrainingConfig) -> Path | None:
    """Run a whole training job; returns the final model directory (rank 0)."""
    trainer = GRPOTrainer(config)
    try:
        return trainer.train()
    finally:
        trainer.close()


# --- the original's entry points -------------------------------------------------------------


def create_optimizer(model: torch.nn.Module, config: Any) -> torch.optim.Optimizer:
    """The config's optimizer over the model's trainable parameters (weight decay groups
    as the trainer uses them)."""
    return build_optimizer(param_groups(model, config), config)


def create_optimizer_for_params(
    params: Iterable[torch.nn.Parameter], config: Any
) -> torch.optim.Optimizer:
    """The config's optimizer over ``params``."""
    return build_optimizer([p for p in params if p.requires_grad], config)


def _train_in_mode(config: TrainingConfig, mode: str) -> Path | None:
    if config.weight_bridge_mode != mode:
        # Validated again: a mode this trainer refuses fails here, naming the ones it has.
        config = type(config).model_validate({**config.model_dump(), "weight_bridge_mode": mode})
    return train(config)


def train_legacy(config: TrainingConfig) -> Path | None:
    """A whole run that checkpoints and restarts the inference server (mode ``none``)."""
    return _train_in_mode(config, "none")


def train_shared_vllm(config: TrainingConfig) -> Path | None:
    """A whole run in mode ``shared_vllm``; this trainer refuses it (ValueError naming the
    modes that work), as its config does."""
    return _train_in_mode(config, "shared_vllm")


def train_lora(config: TrainingConfig) -> Path | None:
    """A whole LoRA run that hot-loads each adapter into the server (mode ``lora_only``)."""
    return _train_in_mode(config, "lora_only")


def train_lora_restart(config: TrainingConfig) -> Path | None:
    """A whole LoRA run that merges the adapter and restarts the server (``lora_restart``)."""
    return _train_in_mode(config, "lora_restart")
