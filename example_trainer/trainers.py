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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence

import torch

from . import api
from .checkpointing import find_latest_checkpoint, load_trainer_state, save_checkpoint
from .config import TrainingConfig
from .data import IGNORE_INDEX, MicroBatch, Sample, collate, group_to_samples, summarize_batch
from .distributed import (
    full_model_state_dict,
    full_optimizer_state_dict,
    init_distributed,
    load_optimizer_state_dict,
    shard_model,
    split_groups,
)
from .model import build_optimizer, build_scheduler, setup_model
from .off_policy import CorrectionConfig, policy_version_summary, staleness_metrics
from .precision import LOST_UPDATE_WARNING, policy_for
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
)
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


@dataclass
class PreparedBatch:
    """An API batch turned into per-rank samples, with the counts every rank needs."""

    shares: List[List[Sample]]
    label_tokens: int
    input_tokens: int
    n_micro: int
    summary: Dict[str, float] = field(default_factory=dict)
    fetch_time: float = 0.0
    batch_id: str | None = None


def prepare_batch(
    batch: Sequence[Dict[str, Any]], world_size: int, micro_size: int
) -> PreparedBatch:
    """Shift a batch into samples and split it across ranks (whole groups per rank)."""
    shares: List[List[Sample]] = []
    for idx in split_groups(batch, world_size):
        shares.append([s for i in idx for s in group_to_samples(batch[i])])
    all_samples = [s for share in shares for s in share]
    if not all_samples:
        raise ValueError("batch has no trainable sequences")
    return PreparedBatch(
        shares=shares,
        label_tokens=sum(sum(1 for x in s.labels if x != IGNORE_INDEX) for s in all_samples),
        input_tokens=sum(len(s.input_ids) for s in all_samples),
        n_micro=max(-(-len(share) // micro_size) for share in shares),
        summary={
            **{f"train/{k}": v for k, v in summarize_batch(batch).items()},
            **policy_version_summary(batch),
        },
    )


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
        self.ref_model = self._make_reference() if config.kl_coef > 0 else None
        if self.ctx.enabled:
            shard_model(self.model, config.device, self.ctx.world_size)
            if self.ref_model is not None:
                shard_model(self.ref_model, config.device, self.ctx.world_size)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, config)
        self.scheduler = build_scheduler(self.optimizer, config.warmup_steps)
        self.scaler = self.policy.make_scaler()
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
        if state.scheduler is not None:
            self.scheduler.load_state_dict(state.scheduler)
        if state.rng is not None:
            torch.set_rng_state(state.rng)
        self.step = state.step
        self.trained_batch_id = state.last_batch_id
        logger.info("resumed from %s at step %d", resume_dir, self.step)

    def seed_batch_client(self) -> None:
        """Tell the API client which batch the restored weights last trained on, so a batch
        the API serves again after a crash is acknowledged and skipped, not trained twice."""
        if self.trained_batch_id is not None:
            api.batch_client(self.config.atropos_url).last_batch_id = self.trained_batch_id

    def _make_reference(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model)
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
        self, item: tuple[MicroBatch, bool] | None, label_tokens: int
    ) -> Dict[str, torch.Tensor] | None:
        dev = self.config.device
        if item is None:
            ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=dev)
            logits = self._forward_logits(self.model, ids, torch.ones_like(ids))
            if self.ref_model is not None:
                with torch.no_grad():
                    self._forward_logits(self.ref_model, ids, torch.ones_like(ids))
            self._backward(logits.sum() * 0.0)
            return None
        mb, unit_temperature = item
        input_ids = self._to_device(mb.input_ids)
        attention_mask = self._to_device(mb.attention_mask)
        labels = self._to_device(mb.labels)
        temps = None if unit_temperature else self._to_device(mb.temperatures)
        ref_lp = self._to_device(mb.ref_logprobs)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_lp = token_logprobs(
                    self._forward_logits(self.ref_model, input_ids, attention_mask), labels, temps
                )
        logits = self._forward_logits(self.model, input_ids, attention_mask)
        out = compute_grpo_loss(
            logits,
            labels,
            self._to_device(mb.advantages),
            temps,
            self._to_device(mb.inference_logprobs),
            clip_eps=self.config.clip_eps,
            ref_logprobs=ref_lp,
            kl_coef=self.config.kl_coef,
            normalizer=label_tokens,
            off_policy=CorrectionConfig(
                self.config.off_policy_correction,
                self.config.off_policy_clip,
                self.config.off_policy_clip_low,
            ),
        )
        # FSDP averages gradients over the ranks; the loss is already normalised by the
        # whole batch's tokens, so scale it back up to get the one-process gradient.
        self._backward(out.loss * self.ctx.world_size)
        out.metrics["train/loss"] = out.loss.detach()
        return out.metrics

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _optimizer_step(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        return grad_norm

    def step_on(self, share: List[Sample], prepared: PreparedBatch) -> Dict[str, torch.Tensor]:
        """Forward/backward over this rank's share and one optimizer step.

        Returns the step's statistics as device tensors, already combined over the
        ranks; nothing has been read back to the host.
        """
        dev = self.config.device
        acc = torch.zeros(len(_MEAN_KEYS) + len(_SUM_KEYS) + len(_MEAN_KEYS), device=dev)
        peak = torch.zeros(len(_MAX_KEYS), device=dev)
        n_mean = len(_MEAN_KEYS)
        total = max(prepared.label_tokens, 1)
        for mb in self._micro_batches(share, prepared.n_micro):
            metrics = self._micro_step(mb, total)
            if metrics is None:
                continue
            n_labels = metrics["train/num_tokens"]
            weight = n_labels / total
            for j, key in enumerate(_MEAN_KEYS):
                if key in metrics:
                    acc[j] += metrics[key] * weight
                    acc[n_mean + len(_SUM_KEYS) + j] += 1.0
            for j, key in enumerate(_SUM_KEYS):
                acc[n_mean + j] += metrics[key]
            if "alignment/diff_max" in metrics:
                peak[0] = torch.maximum(peak[0], metrics["alignment/diff_max"])
        peak[1] = self._optimizer_step().to(dev)
        self.ctx.all_reduce(acc)
        self.ctx.all_reduce(peak, op="max")
        out: Dict[str, torch.Tensor] = {}
        for j, key in enumerate(_MEAN_KEYS):
            out[key] = acc[j]
            out["present/" + key] = acc[n_mean + len(_SUM_KEYS) + j]
        for j, key in enumerate(_SUM_KEYS):
            out[key] = acc[n_mean + j]
        out["alignment/diff_max"] = peak[0]
        out["train/grad_norm"] = peak[1]
        return out

    def _host_metrics(
        self, device_metrics: Dict[str, torch.Tensor], prepared: PreparedBatch, t0: float
    ) -> Dict[str, float]:
        """Read every statistic back at once (the step's one host sync)."""
        keys = list(device_metrics)
        values = torch.stack([device_metrics[k].float() for k in keys]).tolist()
        raw = dict(zip(keys, values, strict=True))
        agg: Dict[str, float] = {}
        for key in _MEAN_KEYS:
            if raw["present/" + key] > 0:
                agg[key] = raw[key]
        for key in _SUM_KEYS:
            agg[key] = raw[key]
        if raw.get("present/alignment/diff_mean", 0) > 0:
            agg["alignment/diff_max"] = raw["alignment/diff_max"]
        step_time = time.perf_counter() - t0
        agg.update(
            {
                "train/grad_norm": raw["train/grad_norm"],
                "train/lr": self.scheduler.get_last_lr()[0],
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
        prepared = (
            prepare_batch(batch, self.ctx.world_size, self.config.batch_size)
            if self.ctx.is_main
            else None
        )
        return self._train_prepared(prepared)

    def _train_prepared(self, prepared: PreparedBatch | None) -> Dict[str, float]:
        t0 = time.perf_counter()
        share, meta = self._distribute(prepared)
        return self._host_metrics(self.step_on(share, meta), meta, t0)

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
    def _fetch(self) -> PreparedBatch:
        cfg = self.config
        t = time.perf_counter()
        batch = api.wait_for_batch(cfg.atropos_url, cfg.batch_poll_interval, cfg.batch_wait_timeout)
        prepared = prepare_batch(batch, self.ctx.world_size, cfg.batch_size)
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
            ),
            "saving a checkpoint",
        )

    def train(self) -> Path | None:
        """Register with the API, train ``training_steps`` steps, save ``final_model``.

        Returns the final model directory (None on ranks other than 0).
        """
        cfg, ctx = self.config, self.ctx
        sync: WeightSync | None = None
        writer: MetricsWriter | None = None
        progress: Progress | None = None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch")

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
            pending = pool.submit(self._fetch) if ctx.is_main else None
            while self.step < cfg.training_steps:
                t0 = time.perf_counter()
                # Every rank takes part in on_main's collective; only rank 0 has a future.
                prepared = ctx.on_main(functools.partial(_result, pending), "fetching a batch")
                share, meta = self._distribute(prepared)
                device_metrics = self.step_on(share, meta)
                self.step += 1
                self.trained_batch_id = meta.batch_id
                if ctx.is_main and self.step < cfg.training_steps:
                    pending = pool.submit(self._fetch)  # overlaps the device finishing this step
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
            pool.shutdown(wait=False, cancel_futures=True)
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
