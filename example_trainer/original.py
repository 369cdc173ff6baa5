"""The original example trainer's functions, with its arguments, on top of this trainer.

Scripts written against the original import these from the modules they lived in
(``example_trainer.training.compute_grpo_loss``, ``example_trainer.data.get_data``,
``example_trainer.trainers.train_lora`` ...); those modules re-export them from here. Each
one is a thin layer over the trainer's own pieces: batches are split and padded by
:mod:`example_trainer.data`, the loss is :func:`example_trainer.training.grpo_loss`, the
optimizer :func:`example_trainer.model.build_optimizer`, whole runs
:func:`example_trainer.trainers.train`.

Example (the original's manual loop)::

    model, tokenizer = load_model_and_tokenizer(config)
    optimizer = create_optimizer(model, config)
    batches, _ = get_data(config.batch_size, config.seq_len, config.atropos_url)
    for tokens, labels, advantages, temperatures, logprobs in batches:
        metrics = run_training_step(model, optimizer, tokens, labels, advantages,
                                    temperatures, config, step, logprobs)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Tuple

import torch

logger = logging.getLogger(__name__)

DEFAULT_ATROPOS_URL = "http://localhost:8000"

Batches = Tuple[
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor],
    List[torch.Tensor] | None,
]


# ----------------------------------------------------------------------------- data


def pad_batches(
    data: Any,
    batch_size: int,
    extract_inference_logprobs: bool = True,
    max_len: int | None = None,
) -> Batches:
    """The original's ``pad_data_to_good_offset``: ``data`` (the ``/batch`` answer, or its
    list of groups) as micro-batches of at most ``batch_size`` sequences:
    ``(tokens, labels, advantages, temperatures, inference_logprobs)`` lists of tensors
    (the last None unless ``extract_inference_logprobs`` and some sequence has them).

    Labels are the next tokens (-100 where no loss is taken), advantages per token,
    temperatures one per sequence; a token without a sampler log-prob holds 1.0.
    """
    from .data import collate, group_to_samples

    groups = data.get("batch") if isinstance(data, Mapping) else data
    samples = []
    for group in groups or []:
        samples.extend(group_to_samples(group, max_len=max_len))
    tokens, labels, advantages, temperatures, logprobs = [], [], [], [], []
    any_logprobs = False
    for i in range(0, len(samples), batch_size):
        mb = collate(samples[i : i + batch_size], max_len=max_len)
        tokens.append(mb.input_ids)
        labels.append(mb.labels)
        advantages.append(mb.advantages)
        temperatures.append(mb.temperatures)
        if mb.inference_logprobs is not None:
            any_logprobs = True
            logprobs.append(mb.inference_logprobs)
        else:
            logprobs.append(torch.ones_like(mb.labels, dtype=torch.float32))
    return (
        tokens,
        labels,
        advantages,
        temperatures,
        logprobs if extract_inference_logprobs and any_logprobs else None,
    )


def get_data(
    batch_size: int,
    seq_len: int,
    atropos_url: str = DEFAULT_ATROPOS_URL,
    extract_inference_logprobs: bool = True,
) -> Tuple[List[Batches], None]:
    """Wait for the next batch from the API and return it padded (``[batches]``, None),
    sequences cut to ``seq_len``."""
    from .api import get_batch

    while True:
        batch = get_batch(atropos_url)
        if batch:
            break
        time.sleep(1.0)
    return [pad_batches(batch, batch_size, extract_inference_logprobs, max_len=seq_len)], None


# ----------------------------------------------------------------------------- loss and steps


def model_grpo_loss(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    temperatures: torch.Tensor,
    gradient_accumulation_steps: int,
    inference_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The original's ``compute_grpo_loss``: forward ``tokens`` through ``model`` and return
    ``(loss / gradient_accumulation_steps, metrics)`` of :func:`~example_trainer.training.grpo_loss`."""
    from .training import grpo_loss

    device = next(model.parameters()).device
    logits = model(input_ids=tokens.to(device)).logits
    temps = temperatures.reshape(-1).to(device) if temperatures is not None else None
    out = grpo_loss(
        logits,
        labels.to(device),
        advantages.to(device),
        temps,
        inference_logprobs.to(device) if inference_logprobs is not None else None,
        clip_eps=clip_eps,
    )
    loss = out.loss / max(int(gradient_accumulation_steps), 1)
    metrics = {k: float(v.detach().float().mean()) for k, v in out.metrics.items()}
    return loss, metrics


def run_training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    token_batches: List[torch.Tensor],
    label_batches: List[torch.Tensor],
    advantage_batches: List[torch.Tensor],
    temperature_batches: List[torch.Tensor],
    config: Any,
    step_idx: int,
    inference_logprob_batches: List[torch.Tensor] | None = None,
) -> dict:
    """One optimizer step over the micro-batches (losses scaled by the config's
    ``gradient_accumulation_steps``, gradients clipped to norm 1). Returns ``loss``,
    ``grad_norm``, ``step`` and the mean of each loss metric."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    sums: Dict[str, float] = {}
    accumulation = int(getattr(config, "gradient_accumulation_steps", 1) or 1)
    for i, tokens in enumerate(token_batches):
        logprobs = inference_logprob_batches[i] if inference_logprob_batches else None
        loss, metrics = model_grpo_loss(
            model,
            tokens,
            label_batches[i],
            advantage_batches[i],
            temperature_batches[i],
            accumulation,
            logprobs,
            float(getattr(config, "clip_eps", 0.2)),
        )
        loss.backward()
        total += float(loss.detach())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], 1.0
    )
    optimizer.step()
    n = max(len(token_batches), 1)
    return {
        "loss": total,
        "grad_norm": float(grad_norm),
        "step": step_idx,
        **{key: value / n for key, value in sums.items()},
    }


def setup_wandb(config: Any) -> bool:
    """Start a W&B run for ``config`` when ``use_wandb``; whether one was started."""
    if not getattr(config, "use_wandb", False):
        return False
    import wandb

    wandb.init(
        project=getattr(config, "wandb_project", None),
        group=getattr(config, "wandb_group", None),
        config=config.model_dump() if hasattr(config, "model_dump") else dict(vars(config)),
    )
    return True


def log_metrics(
    metrics: dict,
    step: int,
    use_wandb: bool,
    extra_metrics: dict | None = None,
    benchmark: bool = False,
) -> None:
    """Log one step's metrics (and ``extra_metrics``): a line to the log, and to W&B when
    ``use_wandb``; with ``benchmark`` the step time is included when present."""
    merged = {**metrics, **(extra_metrics or {})}
    shown = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in merged.items()
        if benchmark or "time" not in k
    )
    logger.info("step %d: %s", step, shown)
    if use_wandb:
        import wandb

        wandb.log({f"train/{k}": v for k, v in merged.items()}, step=step)


def finalize_training(
    use_wandb: bool,
    training_start_time: float | None = None,
    mode: str = "unknown",
    total_steps: int = 0,
    benchmark_stats: dict | None = None,
    benchmark: bool = False,
) -> None:
    """Log the run's summary (mode, steps, wall time, benchmark numbers) and close W&B."""
    elapsed = time.time() - training_start_time if training_start_time else None
    summary: Dict[str, Any] = {"mode": mode, "total_steps": total_steps}
    if elapsed is not None:
        summary["total_time_s"] = round(elapsed, 2)
        if total_steps:
            summary["time_per_step_s"] = round(elapsed / total_steps, 3)
    if benchmark and benchmark_stats:
        summary.update(benchmark_stats)
    logger.info("training finished: %s", summary)
    if use_wandb:
        import wandb

        if wandb.run is not None:
            wandb.run.summary.update(summary)
        wandb.finish()


# ----------------------------------------------------------------------------- model, optimizer


def load_model_and_tokenizer(config: Any, single_copy: bool = False) -> Tuple[torch.nn.Module, Any]:
    """Model (LoRA or layer freezing applied as the config says) and tokenizer.

    ``single_copy`` (train on vLLM's own weights) needs the original's vLLM bridge, which
    this trainer does not have: ImportError naming vLLM.
    """
    if single_copy:
        raise ImportError(
            "single_copy trains on vLLM's weights through the original's vLLM bridge; this "
            "trainer does not provide it (weight_bridge_mode http_reload or lora_only work "
            "without it)"
        )
    from .model import setup_model

    return setup_model(config)


def create_optimizer(model: torch.nn.Module, config: Any) -> torch.optim.Optimizer:
    """The config's optimizer over the model's trainable parameters (weight decay groups
    as the trainer uses them)."""
    from .model import build_optimizer, param_groups

    return build_optimizer(param_groups(model, config), config)


def create_optimizer_for_params(
    params: Iterable[torch.nn.Parameter], config: Any
) -> torch.optim.Optimizer:
    """The config's optimizer over ``params``."""
    from .model import build_optimizer

    return build_optimizer([p for p in params if p.requires_grad], config)


# ----------------------------------------------------------------------------- whole runs


def _train_in_mode(config: Any, mode: str) -> Any:
    from .trainers import train

    if config.weight_bridge_mode != mode:
        # Validated again: a mode this trainer refuses fails here, naming the ones it has.
        config = type(config).model_validate({**config.model_dump(), "weight_bridge_mode": mode})
    return train(config)


def train_legacy(config: Any) -> Any:
    """A whole run that checkpoints and restarts the inference server (mode ``none``)."""
    return _train_in_mode(config, "none")


def train_shared_vllm(config: Any) -> Any:
    """A whole run in mode ``shared_vllm``; this trainer refuses it (ValueError naming the
    modes that work), as its config does."""
    return _train_in_mode(config, "shared_vllm")


def train_lora(config: Any) -> Any:
    """A whole LoRA run that hot-loads each adapter into the server (mode ``lora_only``)."""
    return _train_in_mode(config, "lora_only")


def train_lora_restart(config: Any) -> Any:
    """A whole LoRA run that merges the adapter and restarts the server (``lora_restart``)."""
    return _train_in_mode(config, "lora_restart")


# ----------------------------------------------------------------------------- checkpoints


def save_model_checkpoint(
    model: torch.nn.Module,
    tokenizer: Any,
    save_path: str,
    step: int,
    is_final: bool = False,
    safe_mode: bool = True,
) -> str:
    """The original's ``save_checkpoint``: the model (and tokenizer) in
    ``save_path/step_{step}`` (``final_model`` when ``is_final``), safetensors when
    ``safe_mode``; returns the directory."""
    out = Path(save_path) / ("final_model" if is_final else f"step_{step}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=safe_mode)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return str(out)


def save_lora_checkpoint(
    model: torch.nn.Module, save_path: str, step: int, is_final: bool = False
) -> str:
    """The LoRA adapter alone in ``save_path/adapter_step_{step}`` (``final_adapter`` when
    ``is_final``); returns the directory."""
    out = Path(save_path) / ("final_adapter" if is_final else f"adapter_step_{step}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return str(out)


# ----------------------------------------------------------------------------- run.py waits


def wait_for_vllm(port: int, timeout: int = 300) -> bool:
    """Whether the inference server on ``port`` answers ``/health`` within ``timeout`` s."""
    from .vllm_manager import wait_for_vllm_ready

    return wait_for_vllm_ready(port, float(timeout))


def wait_for_bridge_config(config_path: str, timeout: int = 60) -> bool:
    """Whether the JSON file ``config_path`` (written by the inference side) exists and
    parses within ``timeout`` s."""
    import json

    deadline = time.monotonic() + timeout
    path = Path(config_path)
    while True:
        try:
            json.loads(path.read_text())
            return True
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
