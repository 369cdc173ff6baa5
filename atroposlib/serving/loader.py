"""Load a causal LM and its tokenizer, and check that a new checkpoint fits the old one."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from atroposlib.serving.errors import InvalidRequest

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """Map ``auto|cpu|cuda`` to a torch device (auto → cuda when available)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map a dtype name to torch; auto is float32 on CPU, bfloat16 (or fp16) on CUDA."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """Load ``AutoModelForCausalLM`` from ``path`` onto ``device`` in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_tokenizer(path: str) -> Any:
    """Load the tokenizer of ``path`` (a pad token is set to eos when missing)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_compatible(path: str, current: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Load a checkpoint for a weight update; it must match ``current``'s architecture.

    Raises :class:`InvalidRequest` (param ``path``) when the directory is missing,
    unreadable, or its parameters differ in names or shapes.
    """
    if not os.path.isdir(path):
        raise InvalidRequest(f"checkpoint directory {path!r} does not exist", param="path")
    try:
        model = load_model(path, device, dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InvalidRequest(f"cannot load checkpoint {path!r}: {exc}", param="path") from exc
    if model.config.model_type != current.config.model_type:
        raise InvalidRequest(
            f"checkpoint {path!r} is a {model.config.model_type} model; the "
            f"server runs {current.config.model_type}",
            param="path",
        )
    old = {k: tuple(v.shape) for k, v in current.state_dict().items()}
    new = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if old != new:
        diff = sorted(set(old.items()) ^ set(new.items()))[:3]
        raise InvalidRequest(
            f"checkpoint {path!r} has a different architecture (first differences: {diff})",
            param="path",
        )
    return model
