"""A short supervised warm-up on a task's answer format, cached on disk.

RL from a random-init model never sees a reward. The CPU demo therefore first
fine-tunes the tiny model for a few steps on (prompt, answer) pairs, just enough
that it sometimes succeeds, then hands that checkpoint to GRPO. The result is
cached under ``out_dir`` keyed by a hash of the inputs, so a second run starts
at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

logger = logging.getLogger(__name__)

Example = Tuple[List[Dict[str, str]], str]
MARKER = "warmup.json"


def encode_example(
    tokenizer: Any, messages: List[Dict[str, str]], answer: str
) -> Tuple[List[int], List[int]]:
    """Token ids and labels (−100 on the prompt) for one chat example ending in ``eos``."""
    prompt = list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    completion = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    return prompt + completion, [-100] * len(prompt) + completion


def _cache_key(
    model_dir: str, examples: Sequence[Example], steps: int, lr: float, batch_size: int, seed: int
) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([str(Path(model_dir).resolve()), steps, lr, batch_size, seed]).encode())
    h.update(json.dumps(examples, sort_keys=True).encode())
    cfg = Path(model_dir) / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    return h.hexdigest()[:16]


def sft_warmup(
    model_dir: str,
    examples: Sequence[Example],
    out_dir: str | Path,
    steps: int = 200,
    lr: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    score_fn: Callable[[Any, Any], float] | None = None,
    stop_at_score: float | None = None,
    check_every: int = 10,
    device: str = "cpu",
) -> str:
    """Fine-tune ``model_dir`` on ``examples`` for at most ``steps`` steps; return the output directory.

    With ``score_fn(model, tokenizer)`` and ``stop_at_score``, training stops as soon
    as the score reaches ``stop_at_score`` (checked every ``check_every`` steps), so
    RL starts from a policy that sometimes, but not usually, succeeds.
    Skips the work when ``out_dir`` already holds the result for the same inputs.
    Runs on ``device`` (the trainer's); on a GPU it computes under bf16 autocast
    (fp16 where bf16 is missing) with fp32 weights, like the trainer's default policy.
    """
    out = Path(out_dir)
    key = _cache_key(model_dir, examples, steps, lr, batch_size, seed) + (
        f"-stop{stop_at_score}-every{check_every}" if stop_at_score is not None else ""
    )
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("key") == key:
        logger.info("warm-up cached at %s", out)
        return str(out)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    on_cuda = torch.device(device).type == "cuda"
    half = torch.bfloat16 if on_cuda and torch.cuda.is_bf16_supported() else torch.float16
    autocast = (lambda: torch.autocast("cuda", dtype=half)) if on_cuda else contextlib.nullcontext
    scaler = torch.amp.GradScaler("cuda") if on_cuda and half == torch.float16 else None
    encoded = [encode_example(tokenizer, m, a) for m, a in examples]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id or 0
    loss_val = float("nan")
    score: float | None = None
    done = 0
    for step in range(steps):
        chunk = rng.sample(encoded, min(batch_size, len(encoded)))
        length = max(len(t) for t, _ in chunk)
        ids = torch.full((len(chunk), length), pad, dtype=torch.long)
        labels = torch.full((len(chunk), length), -100, dtype=torch.long)
        attn = torch.zeros((len(chunk), length), dtype=torch.long)
        for i, (t, lab) in enumerate(chunk):
            ids[i, : len(t)] = torch.tensor(t)
            labels[i, : len(lab)] = torch.tensor(lab)
            attn[i, : len(t)] = 1
        with autocast():
            loss = model(
                input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)
            ).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        loss_val = float(loss.detach())
        done = step + 1
        if done % max(1, steps // 5) == 0:  # a sign of life for the demo's first, uncached run
            logger.info("warm-up step %d / %d: loss %.3f", done, steps, loss_val)
        if score_fn is not None and stop_at_score is not None and done % check_every == 0:
            score = float(score_fn(model, tokenizer))
            logger.info("warm-up step %d: score %.3f", done, score)
            if score >= stop_at_score:
                break
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.to("cpu").save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(
        json.dumps({"key": key, "steps": done, "final_loss": loss_val, "score": score})
    )
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    logger.info("warm-up done: %d steps, final loss %.3f → %s", done, loss_val, out)
    return str(out)
