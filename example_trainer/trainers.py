"""The GRPO training loop: fetch a batch, take an optimizer step, sync weights.

One readable loop shared by every weight-bridge mode; the mode only decides which
:class:`~example_trainer.weight_sync.WeightSync` pushes the weights.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Dict, List

import torch

from . import api
from .checkpointing import find_latest_checkpoint, load_trainer_state, save_checkpoint
from .config import TrainingConfig
from .data import MicroBatch, pad_data_to_good_offset, summarize_batch
from .model import build_optimizer, build_scheduler, setup_model
from .training import compute_grpo_loss, token_logprobs
from .weight_sync import WeightSync, make_weight_sync

logger = logging.getLogger(__name__)


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


class GRPOTrainer:
    """Owns model, optimizer, API client and weight sync for one training run."""

    def __init__(self, config: TrainingConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.step = 0
        resume_dir = find_latest_checkpoint(config.save_path) if config.resume else None
        self.model, self.tokenizer = setup_model(config, str(resume_dir) if resume_dir else None)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, config)
        self.scheduler = build_scheduler(self.optimizer, config.warmup_steps)
        if resume_dir is not None:
            state = load_trainer_state(resume_dir)
            self.optimizer.load_state_dict(state.optimizer)
            if state.scheduler is not None:
                self.scheduler.load_state_dict(state.scheduler)
            if state.rng is not None:
                torch.set_rng_state(state.rng)
            self.step = state.step
            logger.info("resumed from %s at step %d", resume_dir, self.step)
        self.ref_model = self._make_reference() if config.kl_coef > 0 else None
        self.pad_id = self.tokenizer.pad_token_id or 0

    def _make_reference(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    # --- one optimizer step ------------------------------------------------------------
    def _forward_logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        dev = self.config.device
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if dev.startswith("cuda")
            else nullcontext()
        )
        with autocast:
            return model(
                input_ids=mb.input_ids.to(dev),
                attention_mask=mb.attention_mask.to(dev),
                use_cache=False,
            ).logits

    def train_on_batch(self, batch: List[Dict[str, Any]]) -> Dict[str, float]:
        """Forward/backward over all micro-batches of ``batch`` and one optimizer step."""
        cfg, dev = self.config, self.config.device
        micro = pad_data_to_good_offset(
            batch, cfg.batch_size, self.pad_id, cfg.pad_to_multiple, cfg.seq_len
        )
        if not micro:
            raise ValueError("batch has no trainable sequences")
        total_tokens = max(sum(mb.num_label_tokens for mb in micro), 1)
        t0 = time.perf_counter()
        agg: Dict[str, float] = {}
        loss_total = 0.0
        n_input_tokens = 0
        for mb in micro:
            ref_lp = mb.ref_logprobs
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_lp = token_logprobs(
                        self._forward_logits(self.ref_model, mb),
                        mb.labels.to(dev),
                        mb.temperatures.to(dev),
                    )
            logits = self._forward_logits(self.model, mb)
            out = compute_grpo_loss(
                logits,
                mb.labels.to(dev),
                mb.advantages.to(dev),
                mb.temperatures.to(dev),
                mb.inference_logprobs.to(dev) if mb.inference_logprobs is not None else None,
                clip_eps=cfg.clip_eps,
                ref_logprobs=ref_lp.to(dev) if ref_lp is not None else None,
                kl_coef=cfg.kl_coef,
                normalizer=total_tokens,
            )
            out.loss.backward()
            loss_total += float(out.loss.detach())
            weight = mb.num_label_tokens / total_tokens
            for k, v in out.metrics.items():
                agg[k] = agg.get(k, 0.0) + (v if k == "train/num_tokens" else v * weight)
            n_input_tokens += int(mb.attention_mask.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], cfg.max_grad_norm
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0
        agg.update(
            {
                "train/loss": loss_total,
                "train/grad_norm": float(grad_norm),
                "train/lr": self.scheduler.get_last_lr()[0],
                "train/step_time": step_time,
                "train/tokens_per_second": n_input_tokens / max(step_time, 1e-9),
                "train/input_tokens": float(n_input_tokens),
            }
        )
        if dev.startswith("cuda"):
            agg["train/gpu_memory_gb"] = torch.cuda.memory_allocated() / 1e9
            agg["train/gpu_memory_reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        return agg

    # --- the loop ----------------------------------------------------------------------
    def train(self) -> Path:
        """Register with the API, train ``training_steps`` steps, save ``final_model``."""
        cfg = self.config
        Path(cfg.save_path).mkdir(parents=True, exist_ok=True)
        api.check_atropos_api(cfg.atropos_url)
        api.register_trainer(cfg, starting_step=self.step)
        sync: WeightSync = make_weight_sync(cfg, self.model, self.tokenizer)
        writer = MetricsWriter(cfg)
        progress = Progress(cfg.progress, cfg.training_steps, self.step)
        totals = {"tokens": 0.0, "time": 0.0}
        try:
            sync.start()
            while self.step < cfg.training_steps:
                t_fetch = time.perf_counter()
                batch = api.wait_for_batch(
                    cfg.atropos_url, cfg.batch_poll_interval, cfg.batch_wait_timeout
                )
                fetch_time = time.perf_counter() - t_fetch
                metrics = self.train_on_batch(batch)
                self.step += 1
                metrics.update({f"train/{k}": v for k, v in summarize_batch(batch).items()})
                metrics["train/data_fetch_time"] = fetch_time
                totals["tokens"] += metrics["train/input_tokens"]
                totals["time"] += metrics["train/step_time"]
                if (
                    cfg.checkpoint_interval > 0
                    and self.step % cfg.checkpoint_interval == 0
                    and self.step < cfg.training_steps
                ):
                    save_checkpoint(
                        self.model,
                        self.tokenizer,
                        self.optimizer,
                        self.scheduler,
                        self.step,
                        cfg.save_path,
                    )
                metrics["train/sync_time"] = (
                    sync.sync(self.step) if sync.should_sync(self.step) else 0.0
                )
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
            final = save_checkpoint(
                self.model,
                self.tokenizer,
                self.optimizer,
                self.scheduler,
                self.step,
                cfg.save_path,
                name="final_adapter" if cfg.uses_lora else "final_model",
            )
            if cfg.benchmark:
                writer.summary(
                    {
                        "benchmark/tokens_per_second": totals["tokens"] / max(totals["time"], 1e-9),
                        "benchmark/total_step_time": totals["time"],
                    }
                )
            return final
        finally:
            progress.close()
            sync.close()
            writer.close()


def train(config: TrainingConfig) -> Path:
    """Run a whole training job; returns the final model directory."""
    return GRPOTrainer(config).train()
