"""Fixtures for trainer tests: tiny batches shaped like the API's."""

from __future__ import annotations

import random
from typing import Any, Dict, List

import pytest


def make_batch(
    tokenizer: Any,
    n_groups: int = 2,
    group_size: int = 4,
    seed: int = 0,
    with_logprobs: bool = False,
) -> List[Dict[str, Any]]:
    """A /batch-shaped list of groups of chat-formatted arithmetic answers."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n_groups):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{a}+{b}="}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        tokens, masks, scores, lps = [], [], [], []
        for _ in range(group_size):
            guess = rng.randint(0, 18)
            completion = tokenizer(f"{guess}<|im_end|>", add_special_tokens=False).input_ids
            tokens.append(list(prompt) + completion)
            masks.append([-100] * len(prompt) + completion)
            scores.append(1.0 if guess == a + b else 0.0)
            lps.append([1.0] * len(prompt) + [-rng.uniform(0.1, 3.0) for _ in completion])
        if len(set(scores)) == 1:
            scores[0] = 1.0 - scores[0]
        group = {"tokens": tokens, "masks": masks, "scores": scores}
        if with_logprobs:
            group["inference_logprobs"] = lps
        groups.append(group)
    return groups


def cpu_config(model_dir, save_path, **overrides):
    """A small CPU ``TrainingConfig`` for the tiny model; ``overrides`` replace any field."""
    from example_trainer.config import TrainingConfig

    base = dict(
        model_name=str(model_dir),
        save_path=str(save_path),
        device="cpu",
        optimizer="adamw",
        lr=1e-3,
        batch_size=4,
        gradient_accumulation_steps=2,
        pad_to_multiple=8,
        progress=False,
    )
    base.update(overrides)
    return TrainingConfig(**base)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
