"""The policy update of one batch: micro-steps, reference and old log-probs, clip and apply.

:class:`PolicyUpdate` takes this rank's share of a prepared batch and runs its optimizer
steps (one by default; ``ppo_epochs`` x ``mini_batches``): for each micro-batch a forward of
the reference model when a KL term needs it, a forward and backward of the policy through
:func:`~example_trainer.training.grpo_loss`; then the gradient is clipped and the update
applied (or refused when it is not finite). Before the first update of a batch trained on
in several steps, one pass takes the policy's own log-probs (the ratio's reference after
the first update) and, with ``--kl-in-reward``, the KL that shapes the scores.

The loop that fetches, distributes, saves and syncs is :class:`~example_trainer.trainers.GRPOTrainer`;
it builds the model, optimizer and scheduler this object updates.

Throughput: micro-batches are padded on the host while the device runs the previous one,
and every statistic stays a device tensor until the step's end (:mod:`.step_stats`).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Dict, Iterator, List

import torch

from .batching import MiniBatchInfo, PreparedBatch
from .data import IGNORE_INDEX, MicroBatch, Sample, collate
from .kl import kl_penalty
from .loss_config import LossConfig
from .reward_shaping import apply_kl_in_reward
from .step_stats import StepStats
from .training import grpo_loss, token_logprobs

logger = logging.getLogger(__name__)

MicroItem = tuple[MicroBatch, bool] | None
"""A padded micro-batch with "all its temperatures are 1", or None: an empty one."""


class TrainingDivergedError(RuntimeError):
    """Too many optimizer steps in a row had a gradient that is not finite."""


class PolicyUpdate:
    """The optimizer steps of one rank over its share of each batch.

    ``config`` is the run's :class:`~example_trainer.config.TrainingConfig`, ``ctx`` its
    :class:`~example_trainer.distributed.DistContext`, ``precision`` its
    :class:`~example_trainer.precision.PrecisionPolicy`; ``scaler`` the fp16 grad scaler
    (or None) and ``ref_model`` the frozen reference (or None).
    """

    def __init__(
        self,
        config: Any,
        ctx: Any,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        precision: Any,
        loss_config: LossConfig,
        pad_id: int,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.model = model
        self.ref_model = ref_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.precision = precision
        self.loss_config = loss_config
        self.pad_id = pad_id
        self.skipped_steps = 0  # optimizer steps refused for a non-finite gradient
        self.skipped_in_row = 0
        self.step = 0  # the trainer's step this batch becomes (for messages)
        self._pin = precision.device_type == "cuda"

    # --- one batch -----------------------------------------------------------------------
    def run(self, share: List[Sample], prepared: PreparedBatch, step: int = 0) -> Dict[str, float]:
        """Forward/backward over this rank's ``share`` of ``prepared`` and its optimizer
        steps; ``step`` is the number of batches trained before this one.

        Statistics stay device tensors, combined over the ranks, and are read back to the
        host once, together with the gradient norm that decides whether the last update
        may be applied (a non-finite gradient is refused, see :meth:`apply`).
        """
        cfg = self.config
        self.step = step
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
            old = self.pre_pass(minis, prepared, want_old)
        stats = StepStats(
            cfg.device,
            max(prepared.label_tokens, 1) * cfg.ppo_epochs,
            cfg.ppo_epochs,
            len(schedule),
        )
        raw: Dict[str, float] = {}
        for u, (k, part) in enumerate(schedule):
            info = (
                prepared.minis[k]
                if prepared.minis
                else MiniBatchInfo(prepared.label_tokens, len(share), prepared.n_micro)
            )
            for j, item in enumerate(self.micro_batches(part, info.n_micro)):
                metrics = self.micro_step(item, info, old.get((k, j)))
                if metrics is not None:
                    stats.add(metrics)
            grad_norm = self.clip_gradients()
            stats.add_grad_norm(grad_norm)
            if u == len(schedule) - 1:
                raw, last_norm = stats.read_back(self.ctx, grad_norm)
                finite = math.isfinite(last_norm)
            else:
                finite = math.isfinite(float(grad_norm))
            self.apply(finite)
        lr = float(self.scheduler.get_last_lr()[0])
        with warnings.catch_warnings():
            # After a refused first step torch warns that the optimizer has not stepped yet;
            # the schedule follows the trainer's steps on purpose.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        raw["train/lr"] = lr  # the rate this batch's updates used, not the next one
        raw["train/skipped_steps"] = float(self.skipped_steps)
        return raw

    def micro_batches(self, share: List[Sample], n_micro: int) -> Iterator[MicroItem]:
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

    # --- micro-steps ---------------------------------------------------------------------
    def micro_step(
        self,
        item: MicroItem,
        info: MiniBatchInfo,
        old_logprobs: torch.Tensor | None = None,
    ) -> Dict[str, torch.Tensor] | None:
        """Forward/backward of one micro-batch of an optimizer step described by ``info``.

        ``old_logprobs`` (when a batch is trained on in several optimizer steps) are the
        policy's log-probs before the batch's first step: the ratio's reference for the
        tokens without a sampler log-prob.
        """
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
            ref_lp = self.reference_logprobs(mb, input_ids, attention_mask, labels, temps)
        logits = self.forward_logits(self.model, input_ids, attention_mask)
        out = grpo_loss(
            logits,
            labels,
            self._to_device(mb.advantages),
            temps,
            self._to_device(mb.inference_logprobs),
            self.loss_config,
            inference_mask=self._to_device(mb.inference_mask),
            old_logprobs=old_logprobs,
            ref_logprobs=ref_lp,
            normalizer=max(info.label_tokens, 1),
            num_sequences=max(info.num_sequences, 1),
            max_tokens=self.config.seq_len,
            distill_token_ids=self._to_device(mb.distill_token_ids),
            distill_logprobs=self._to_device(mb.distill_logprobs),
            distill_mask=self._to_device(mb.distill_mask),
        )
        # FSDP averages gradients over the ranks; the loss is already normalised by the
        # whole batch's tokens, so scale it back up to get the one-process gradient.
        self._backward(out.loss * self.ctx.world_size)
        out.metrics["train/loss"] = out.loss.detach()
        return out.metrics

    def forward_logits(self, model: torch.nn.Module, input_ids, attention_mask) -> torch.Tensor:
        """``model``'s logits under the run's autocast."""
        with self.precision.autocast():
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def _padding_forwards(self, grad: bool) -> torch.Tensor:
        """An empty micro-batch: the same forwards as a real one (reference, then policy),
        so that the sharded models' collectives stay in step with the other ranks.
        Returns the policy's logits."""
        ids, attention = self._padding_ids()
        if self.ref_model is not None:
            with torch.no_grad():
                self.forward_logits(self.ref_model, ids, attention)
        with torch.set_grad_enabled(grad):
            return self.forward_logits(self.model, ids, attention)

    def _padding_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.config.device)
        return ids, torch.ones_like(ids)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _to_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if self._pin:
            return t.pin_memory().to(self.config.device, non_blocking=True)
        return t.to(self.config.device)

    # --- reference and old log-probs -----------------------------------------------------
    def reference_logprobs(
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
                self.forward_logits(self.ref_model, input_ids, attention_mask), labels, temps
            )
        if env_ref is None:
            return ref_lp
        return torch.where(self._to_device(mb.ref_mask), env_ref, ref_lp)

    def pre_pass(
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
                for j, item in enumerate(self.micro_batches(part, prepared.minis[k].n_micro)):
                    if item is None:
                        if kl_in_reward:
                            self._padding_forwards(grad=False)
                        else:  # only the policy runs for a real micro-batch either
                            self.forward_logits(self.model, *self._padding_ids())
                        continue
                    mb, unit_temperature = item
                    labels = self._to_device(mb.labels)
                    ids = self._to_device(mb.input_ids)
                    attention = self._to_device(mb.attention_mask)
                    temps = None if unit_temperature else self._to_device(mb.temperatures)
                    ref_lp = None
                    if kl_in_reward:
                        ref_lp = self.reference_logprobs(mb, ids, attention, labels, temps)
                    logp = token_logprobs(
                        self.forward_logits(self.model, ids, attention), labels, temps
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

    # --- clip and apply ------------------------------------------------------------------
    def clip_gradients(self) -> torch.Tensor:
        """Unscale (fp16), clip to ``max_grad_norm`` and return the global gradient norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        return grad_norm.to(self.config.device)

    def apply(self, finite: bool) -> None:
        """Take the optimizer step, or refuse it when the gradient is not finite.

        A refused step keeps the weights and the optimizer state (AdamW would otherwise
        spread one NaN into every weight), is logged and counted; after
        ``max_consecutive_skipped_steps`` refusals in a row the run stops. Under fp16 the
        grad scaler skips such steps itself (and lowers its scale): that is its normal
        calibration, not counted here.
        """
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif finite:
            self.optimizer.step()
            self.skipped_in_row = 0
        else:
            self.skipped_steps += 1
            self.skipped_in_row += 1
            logger.warning(
                "step %d: the gradient norm is not finite; optimizer step skipped, weights kept "
                "(%d in a row, %d in all)",
                self.step + 1,
                self.skipped_in_row,
                self.skipped_steps,
            )
        self.optimizer.zero_grad(set_to_none=True)
        limit = self.config.max_consecutive_skipped_steps
        if limit and self.skipped_in_row >= limit:
            raise TrainingDivergedError(
                f"{self.skipped_in_row} optimizer steps in a row had a non-finite gradient "
                f"(--max-consecutive-skipped-steps {limit}); stopping. Look for NaN/inf in the "
                "batch (scores, advantages, inference_logprobs) or lower --lr."
            )
