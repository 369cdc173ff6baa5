"""The GRPO training loop: fetch a batch, hand each rank its share, update, save, sync.

One readable loop shared by every weight-bridge mode; the mode only decides which
:class:`~example_trainer.weight_sync.WeightSync` pushes the weights. The optimizer steps
over a batch are :class:`~example_trainer.policy_update.PolicyUpdate`'s; where metrics go,
:mod:`example_trainer.metrics`.

Throughput (a GPU waits for nothing it does not need): the next API batch is fetched and
turned into per-sequence samples on a background thread while the current step finishes
on the device (it is requested only once the current step's optimizer update has been
issued, because fetching acknowledges the previous batch to the API); the update pads
micro-batches on the host while the device runs the previous one and reads its
statistics back once per step.

Multi-process runs (``torchrun``) follow :mod:`example_trainer.distributed`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence

import torch

from . import api
from .batching import EmptyBatchError, PreparedBatch, prepare_batch
from .checkpointing import find_latest_checkpoint, load_trainer_state, save_checkpoint
from .config import TrainingConfig
from .data import Sample
from .distributed import (
    full_model_state_dict,
    full_optimizer_state_dict,
    init_distributed,
    load_optimizer_state_dict,
    shard_model,
)
from .launch import supervision
from .loss_config import LossConfig
from .metrics import MetricsWriter, Progress
from .model import build_optimizer, build_scheduler, load_model, param_groups, setup_model
from .off_policy import staleness_metrics
from .policy_update import PolicyUpdate
from .precision import LOST_UPDATE_WARNING, fp32_lm_head, policy_for
from .weight_sync import WeightSync, make_weight_sync

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """One training run (one rank): sets up the model, reference, optimizer and schedule
    (or restores them), fetches batches and hands each rank its share, has
    :class:`~example_trainer.policy_update.PolicyUpdate` take the optimizer steps, and saves
    checkpoints and syncs the weights to inference."""

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
        self.vocab_size = embedding_rows(self.model)
        """Ids the model can look up (None: unknown): a group with a larger one is dropped."""
        self.skipped_batches = 0
        """Batches acknowledged without a step: nothing in them could be trained on."""
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
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.update = PolicyUpdate(
            config,
            self.ctx,
            self.model,
            self.ref_model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.policy,
            self.loss_config,
            self.pad_id,
        )
        if resume_dir is not None:
            self._restore(resume_dir)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps refused for a non-finite gradient (kept in checkpoints)."""
        return self.update.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.update.skipped_steps = value

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

    def _host_metrics(
        self, raw: Dict[str, float], prepared: PreparedBatch, t0: float
    ) -> Dict[str, float]:
        """The step's statistics (read back by :meth:`PolicyUpdate.run`) plus timing and memory."""
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
            vocab_size=self.vocab_size,
            overlong=(
                (cfg.seq_len, cfg.overlong_penalty_len, cfg.overlong_penalty_factor)
                if cfg.overlong_penalty_len > 0
                else None
            ),
        )

    def _train_prepared(self, prepared: PreparedBatch | None) -> Dict[str, float]:
        t0 = time.perf_counter()
        share, meta = self._distribute(prepared)
        metrics = self._host_metrics(self.update.run(share, meta, self.step), meta, t0)
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
        """The next batch, prepared. A batch with nothing to train on (every group refused,
        see :func:`prepare_batch`) is logged, counted (``train/skipped_batches``) and
        acknowledged by asking for the next one: served again after a restart, it would
        otherwise stop the run for good."""
        cfg = self.config
        t = time.perf_counter()
        client = api.batch_client(cfg.atropos_url)
        groups = seqs = 0
        while True:
            batch = api.wait_for_batch(
                cfg.atropos_url,
                cfg.batch_poll_interval,
                cfg.batch_wait_timeout,
                should_stop=lambda: supervision.stopping() or (stop is not None and stop.is_set()),
            )
            try:
                prepared = self.prepare(batch)
                break
            except EmptyBatchError as exc:
                self.skipped_batches += 1
                groups += exc.rejected_groups
                seqs += exc.rejected_sequences
                logger.error(
                    "batch %s skipped, not trained on (acknowledged with the next request): %s",
                    client.last_batch_id,
                    exc,
                )
        prepared.fetch_time = time.perf_counter() - t
        summary = prepared.summary
        summary["train/rejected_groups"] = summary.get("train/rejected_groups", 0.0) + groups
        summary["train/rejected_sequences"] = summary.get("train/rejected_sequences", 0.0) + seqs
        summary["train/skipped_batches"] = float(self.skipped_batches)
        # Read here, in the one thread that fetches: the client's id moves on with prefetching.
        prepared.batch_id = client.last_batch_id
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
            api.register_trainer(cfg, starting_step=self.step, vocab_size=self.vocab_size)
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
                if self._stop_requested():
                    logger.info("%s exists: ending at step %d", cfg.stop_file, self.step)
                    break
                t0 = time.perf_counter()
                # Every rank takes part in on_main's collective; only rank 0 has a future.
                prepared = ctx.on_main(functools.partial(_result, pending), "fetching a batch")
                share, meta = self._distribute(prepared)
                device_metrics = self.update.run(share, meta, self.step)
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

    def _stop_requested(self) -> bool:
        """Whether ``stop_file`` exists (rank 0 looks; every rank gets the same answer)."""
        if not self.config.stop_file:
            return False
        seen = self.ctx.is_main and os.path.exists(self.config.stop_file)
        return bool(self.ctx.broadcast(seen))

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


def embedding_rows(model: torch.nn.Module) -> int | None:
    """How many token ids ``model`` can take: the smaller of its input embedding's rows and
    its output layer's width (None when it exposes neither)."""
    sizes = []
    for getter, attr in (
        ("get_input_embeddings", "num_embeddings"),
        ("get_output_embeddings", "out_features"),
    ):
        try:
            layer = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        size = getattr(layer, attr, None)
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    return min(sizes) if sizes else None


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
