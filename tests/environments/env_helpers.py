"""Helpers for the environment tests: process-mode flags, data files and output checks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Dict, List, Sequence


def process_argv(
    serve: Dict[str, str], out: Path, *extra: str, group_size: int = 2, steps: int = 2
) -> List[str]:
    """``process`` flags for a run against ``serve`` writing ``out`` (jsonl)."""
    return [
        "process",
        "--env.group_size",
        str(group_size),
        "--env.total_steps",
        str(steps),
        "--env.tokenizer_name",
        serve["model"],
        "--env.use_wandb",
        "false",
        "--env.data_path_to_save_groups",
        str(out),
        "--openai.base_url",
        serve["base_url"],
        "--openai.model_name",
        serve["model"],
        "--openai.server_type",
        "vllm",
        "--openai.timeout",
        "120",
        *extra,
    ]


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    """Write rows (dicts are JSON-encoded, strings written verbatim) one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def unmasked_runs(mask: List[int]) -> int:
    """How many contiguous trained spans a mask has."""
    return sum(1 for trained, _ in itertools.groupby(mask, key=lambda m: m != -100) if trained)


def check_groups(
    path: Path, group_size: int, n_groups: int, lo: float, hi: float
) -> List[Dict[str, Any]]:
    """Assert the structural invariants of a process-mode jsonl and its html; return the groups."""
    assert path.exists(), f"{path} was not written"
    groups = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(groups) == n_groups
    for group in groups:
        assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == group_size
        assert len(group["messages"]) == group_size
        assert len(group["inference_logprobs"]) == group_size
        for tokens, masks, logprobs in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], strict=True
        ):
            assert len(tokens) == len(masks) == len(logprobs)
            assert all(m == -100 or m == t for t, m in zip(tokens, masks, strict=True))
            assert any(m != -100 for m in masks), "nothing to train on"
            assert masks[0] == -100, "the prompt must be masked"
            assert all(lp == 1.0 for lp, m in zip(logprobs, masks, strict=True) if m == -100)
            assert all(lp <= 0.0 for lp, m in zip(logprobs, masks, strict=True) if m != -100)
        assert all(lo <= s <= hi for s in group["scores"]), group["scores"]
    html = path.with_suffix(".html")
    assert html.exists() and html.read_text().count("<details") >= n_groups
    return groups
