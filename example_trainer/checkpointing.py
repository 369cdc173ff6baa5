"""Resumable checkpoints: ``save_path/step_N`` and ``save_path/final_model``.

A checkpoint directory holds the model (``save_pretrained``; only the adapter for
LoRA runs), the tokenizer, and ``trainer_state.pt`` with the optimizer and
scheduler state, the step and the RNG state. It is written to a temporary
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
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    """What ``--resume`` restores besides the weights."""

    step: int
    optimizer: dict
    scheduler: dict | None
    rng: Any | None = None


def save_model_dir(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save weights and tokenizer to ``out_dir`` atomically (tmp dir + rename)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def save_checkpoint(
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    step: int,
    save_path: str | Path,
    name: str | None = None,
) -> Path:
    """Write a resumable checkpoint ``save_path/step_{step}`` (or ``name``) and return its path."""
    out = Path(save_path) / (name or f"step_{step}")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": torch.get_rng_state(),
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


def load_trainer_state(checkpoint_dir: str | Path) -> TrainerState:
    """Read ``trainer_state.pt`` of a checkpoint."""
    data = torch.load(Path(checkpoint_dir) / STATE_FILE, map_location="cpu", weights_only=False)
    return TrainerState(
        step=int(data["step"]),
        optimizer=data["optimizer"],
        scheduler=data.get("scheduler"),
        rng=data.get("rng"),
    )
