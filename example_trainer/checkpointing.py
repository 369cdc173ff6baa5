"""Resumable checkpoints: ``save_path/step_N`` and ``save_path/final_model``.

A checkpoint directory holds the model (``save_pretrained``; only the adapter for
LoRA runs), the tokenizer, ``optimizer.pt`` (optimizer state keyed by parameter
name, so a checkpoint written by N processes resumes on M) and ``trainer_state.pt``
with the scheduler state, the step, the CPU RNG state, ``extra`` (the CUDA RNG states,
the fp16 grad scaler's state, the count of skipped steps) and the ``batch_id`` of the last
batch trained on (a resumed trainer skips that batch if the rollout API serves it
again, see ``atroposlib/api/README.md`` "Delivery"). It is written to a temporary
directory and renamed into place, so a crash never leaves a half-written
``step_N`` that ``--resume`` would pick up.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """What ``--resume`` restores besides the weights."""

    step: int
    optimizer: dict | None
    scheduler: dict | None
    rng: Any | None = None
    last_batch_id: str | None = None
    extra: dict | None = None


def _save_pretrained(model: Any, out: Path, state_dict: dict | None) -> None:
    if state_dict is None:
        model.save_pretrained(out, safe_serialization=True)
    else:  # weights gathered from the shards of a multi-process run
        model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)


def save_model_dir(
    model: Any, tokenizer: Any, out_dir: str | Path, state_dict: dict | None = None
) -> Path:
    """Save weights and tokenizer to ``out_dir`` atomically (tmp dir + rename).

    ``state_dict`` replaces the model's own tensors (the full weights of a sharded model).
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _save_pretrained(model, tmp, state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def save_checkpoint(
    model: Any,
    tokenizer: Any,
    save_path: Any,
    step: Any = None,
    is_final: Any = False,
    safe_mode: Any = True,
    name: str | None = None,
    model_state: dict | None = None,
    optimizer_state: dict | None = None,
    world_size: int = 1,
    last_batch_id: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a resumable checkpoint ``save_path/step_{step}`` (or ``name``) and return its path.

    ``model_state``/``optimizer_state`` are the full (gathered) state dicts of a
    sharded run; by default the model's and optimizer's own are saved. ``extra`` is
    any further state to restore (the CUDA RNG, the fp16 grad scaler, counters).

    Called as ``save_checkpoint(model, tokenizer, optimizer, scheduler, step, save_path,
    ...)``. The original's form, ``save_checkpoint(model, tokenizer, save_path, step,
    is_final=False, safe_mode=True)`` (a path third), saves the model and tokenizer only
    and returns the directory as a string
    (:func:`save_model_checkpoint`).
    """
    if isinstance(save_path, (str, os.PathLike)):
        return save_model_checkpoint(model, tokenizer, save_path, step, is_final, safe_mode)
    optimizer, scheduler, step, save_path = save_path, step, is_final, safe_mode
    out = Path(save_path) / (name or f"step_{step}")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    _save_pretrained(model, tmp, model_state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(
        optimizer_state if optimizer_state is not None else optimizer.state_dict(),
        tmp / OPTIMIZER_FILE,
    )
    torch.save(
        {
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": torch.get_rng_state(),
            "world_size": world_size,
            "last_batch_id": last_batch_id,
            "extra": extra,
        },
        tmp / STATE_FILE,
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    logger.info("saved checkpoint %s", out)
    return out


def find_latest_checkpoint(save_path: str | Path) -> Path | None:
    """The complete ``step_N`` directory with the largest N, or ``None``."""
    root = Path(save_path)
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).exists():
            n = int(m.group(1))
            if best is None or n > best[0]:
                best = (n, child)
    return best[1] if best else None


def load_trainer_state(checkpoint_dir: str | Path, with_optimizer: bool = True) -> TrainerState:
    """Read ``trainer_state.pt`` (and ``optimizer.pt``) of a checkpoint.

    ``with_optimizer=False`` skips the optimizer file (ranks other than 0 receive
    it by broadcast). A ``trainer_state.pt`` that holds the optimizer state itself is read
    too.
    """
    root = Path(checkpoint_dir)
    data = torch.load(root / STATE_FILE, map_location="cpu", weights_only=False)
    optimizer = data.get("optimizer")
    if with_optimizer and optimizer is None and (root / OPTIMIZER_FILE).exists():
        optimizer = torch.load(root / OPTIMIZER_FILE, map_location="cpu", weights_only=False)
    return TrainerState(
        step=int(data["step"]),
        optimizer=optimizer,
        scheduler=data.get("scheduler"),
        rng=data.get("rng"),
        last_batch_id=data.get("last_batch_id"),
        extra=data.get("extra"),
    )


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
