"""Model, tokenizer and optimizer construction for the trainer."""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable, List, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import TrainingConfig
from .precision import policy_for

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def resolve_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype the weights (and so the optimizer state) are kept in.

    float32 under every policy but ``bf16-pure``: mixed precision computes in
    bf16/fp16 under autocast while the master weights stay float32 (D20).
    """
    return policy_for(config).param_dtype


def load_tokenizer(name_or_path: str) -> Any:
    """Load a tokenizer and make sure it has a pad token."""
    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str, config: TrainingConfig) -> torch.nn.Module:
    """Load the causal LM on ``config.device`` with the weights in :func:`resolve_dtype`."""
    if config.debug_loading:
        logger.info("loading %s on %s", name_or_path, config.device)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=resolve_dtype(config))
    model.to(config.device)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def layer_index(param_name: str) -> int | None:
    """The transformer layer a parameter belongs to (``...layers.3.mlp...`` → 3)."""
    m = _LAYER_RE.search(param_name)
    return int(m.group(1)) if m else None


def freeze_except_layers(model: torch.nn.Module, layers: Iterable[int]) -> int:
    """Train only the given layers; returns the number of trainable parameters."""
    keep = set(layers)
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad = layer_index(name) in keep
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError(f"--train-layer-indices {sorted(keep)} selects no parameters")
    return n


def apply_lora(model: torch.nn.Module, config: TrainingConfig) -> torch.nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters as configured."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is in the trainer extra
        raise RuntimeError("LoRA modes need `peft` (pip install 'atroposlib[trainer]')") from exc
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=list(config.lora_target_modules),
        layers_to_transform=list(config.lora_layer_indices) if config.lora_layer_indices else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def build_optimizer(
    params: List[torch.nn.Parameter], config: TrainingConfig
) -> torch.optim.Optimizer:
    """AdamW, 8-bit AdamW (bitsandbytes, GPU only; falls back to AdamW) or Adafactor."""
    sharded = config.effective_world_size > 1
    if config.optimizer == "adamw_8bit":
        if sharded:
            logger.info("adamw_8bit does not take sharded (FSDP) parameters; using torch AdamW")
        elif config.device.startswith("cuda"):
            try:
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(params, lr=config.lr)
            except ImportError:
                logger.warning("bitsandbytes not installed; using torch AdamW")
        else:
            logger.info("adamw_8bit needs CUDA; using torch AdamW on %s", config.device)
    if config.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            params,
            lr=config.lr,
            scale_parameter=config.adafactor_scale_parameter,
            relative_step=config.adafactor_relative_step,
            warmup_init=False,
        )
    fused = config.device.startswith("cuda") and not sharded
    return (
        torch.optim.AdamW(params, lr=config.lr, fused=fused)
        if fused
        else torch.optim.AdamW(params, lr=config.lr)
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps`` then constant."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def setup_model(
    config: TrainingConfig, load_from: str | None = None
) -> Tuple[torch.nn.Module, Any]:
    """Model (with LoRA or layer freezing applied) and tokenizer.

    ``load_from`` is a checkpoint directory to resume from (full weights, or a
    LoRA adapter on top of ``config.model_name``).
    """
    tokenizer = load_tokenizer(load_from or config.model_name)
    if config.uses_lora:
        model = load_model(config.model_name, config)
        if load_from:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, load_from, is_trainable=True)
        else:
            model = apply_lora(model, config)
    else:
        model = load_model(load_from or config.model_name, config)
        if config.train_layer_indices:
            freeze_except_layers(model, config.train_layer_indices)
    model.train()
    return model, tokenizer
