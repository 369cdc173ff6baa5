"""Model, tokenizer and optimizer construction for the trainer."""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any, Dict, Iterable, List, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import TrainingConfig
from .precision import policy_for

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


def resolve_dtype(config: TrainingConfig) -> torch.dtype:
    """The dtype the weights (and so the optimizer state) are kept in.

    float32 under every policy but ``bf16-pure``: mixed precision computes in
    bf16/fp16 under autocast while the master weights stay float32 (docs/design.md, "Precision policy").
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


def param_groups(model: torch.nn.Module, config: TrainingConfig) -> List[Dict[str, Any]]:
    """The trainable parameters in two optimizer groups: decayed and not decayed.

    Biases, norm weights (every parameter with fewer than two dimensions) and embedding
    tables (``nn.Embedding`` weights, and an ``lm_head`` tied to them) get no weight decay
    unless ``decay_norms_and_embeddings``: decaying a norm's gain towards 0 or every row of
    an embedding on each step only pulls the model away from its pretrained scale.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay: List[torch.nn.Parameter] = []
    no_decay: List[torch.nn.Parameter] = []
    for p in model.parameters():  # de-duplicates tied weights
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or id(p) in embeddings
        (no_decay if exempt and not config.decay_norms_and_embeddings else decay).append(p)
    groups = [{"params": decay, "weight_decay": config.resolved_weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(
    params: List[torch.nn.Parameter] | List[Dict[str, Any]], config: TrainingConfig
) -> torch.optim.Optimizer:
    """AdamW, 8-bit AdamW (bitsandbytes, GPU only; falls back to AdamW) or Adafactor.

    ``params`` is a list of parameters (all decayed by ``weight_decay``) or of groups
    (:func:`param_groups`); betas, eps and weight decay come from ``config``.
    """
    sharded = config.effective_world_size > 1
    adam = {
        "lr": config.lr,
        "betas": (config.adam_beta1, config.adam_beta2),
        "eps": config.adam_eps,
        "weight_decay": config.resolved_weight_decay,
    }
    if config.optimizer == "adamw_8bit":
        if sharded:
            logger.info("adamw_8bit does not take sharded (FSDP) parameters; using torch AdamW")
        elif config.device.startswith("cuda"):
            try:
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(params, **adam)
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
            weight_decay=config.resolved_weight_decay,
        )
    fused = config.device.startswith("cuda") and not sharded
    return (
        torch.optim.AdamW(params, fused=fused, **adam)
        if fused
        else torch.optim.AdamW(params, **adam)
    )


def lr_factor(
    step: int,
    warmup_steps: int,
    kind: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak learning rate for the ``step``-th optimizer step (0-based).

    Warm-up: ``(step + 1) / warmup_steps`` for ``step < warmup_steps``. Then, with
    ``p = (step − warmup_steps) / (total_steps − warmup_steps)``: ``constant`` 1,
    ``linear`` ``1 − (1 − m)·p``, ``cosine`` ``m + (1 − m)·(1 + cos πp)/2``, where
    ``m = min_lr_ratio`` (``p`` is capped at 1).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant" or not total_steps:
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * p
    if kind == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr scheduler {kind!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    kind: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ``warmup_steps``, then :func:`lr_factor`'s ``kind`` (constant by default)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        functools.partial(
            lr_factor,
            warmup_steps=warmup_steps,
            kind=kind,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        ),
    )


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` to 0 (modules and attention); returns
    how many were changed. The sampler runs without dropout, so a policy that drops
    units scores different log-probs than the ones it is compared with."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p != 0:
            module.p = 0.0
            changed += 1
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float) and getattr(module, attr) != 0:
                setattr(module, attr, 0.0)
                changed += 1
    return changed


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
    if config.disable_dropout:
        disable_dropout(model)
    model.train()
    return model, tokenizer


def load_model_and_tokenizer(
    config: TrainingConfig, single_copy: bool = False
) -> Tuple[torch.nn.Module, Any]:
    """The original's loader: :func:`setup_model` of ``config``.

    ``single_copy`` (train on vLLM's own weights) needs the original's vLLM bridge, which
    this trainer does not have: ImportError naming vLLM.
    """
    if single_copy:
        raise ImportError(
            "single_copy trains on vLLM's weights through the original's vLLM bridge; this "
            "trainer does not provide it (weight_bridge_mode http_reload or lora_only work "
            "without it)"
        )
    return setup_model(config)
