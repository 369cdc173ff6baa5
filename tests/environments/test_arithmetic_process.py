"""The arithmetic environment in ``process`` and ``evaluate`` mode against a real
``atropos-serve-model`` (tiny offline model): well-formed groups, metrics written."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from transformers import AutoTokenizer

from atroposlib.envs.cli import build_env, parse_cli
from environments.arithmetic_server import ArithmeticEnv, score_completion
from tests.environments.env_helpers import check_groups, process_argv


@pytest.mark.smoke
def test_arithmetic_process_writes_groups_with_logprobs_and_binary_scores(serve_model, tmp_path):
    out = tmp_path / "arithmetic.jsonl"
    env = build_env(
        ArithmeticEnv,
        parse_cli(ArithmeticEnv, process_argv(serve_model, out, group_size=4, steps=3)),
    )
    asyncio.run(env.process_manager())
    groups = check_groups(out, 4, 3, 0.0, 1.0)
    tok = AutoTokenizer.from_pretrained(serve_model["model"])
    for group in groups:
        for messages, tokens, masks, score in zip(
            group["messages"], group["tokens"], group["masks"], group["scores"], strict=True
        ):
            # The conversation as text, not the chat template rendered from the tokens.
            assert [m["role"] for m in messages] == ["user", "assistant"], messages
            assert all("<|im_start|>" not in m["content"] for m in messages), messages
            match = re.fullmatch(r"(\d+)\+(\d+)=", messages[0]["content"])
            assert match, messages
            a, b = int(match[1]), int(match[2])
            assert score == score_completion(messages[1]["content"], a, b)
            completion = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
            decoded = tok.decode(completion, skip_special_tokens=False)
            assert decoded.startswith(messages[1]["content"])
            assert score == score_completion(decoded, a, b)


def test_arithmetic_evaluate_writes_accuracy(serve_model, tmp_path):
    argv = process_argv(serve_model, tmp_path / "unused.jsonl")
    argv[0] = "evaluate"
    argv += ["--env.data_dir_to_save_evals", str(tmp_path / "evals"), "--env.max_operand", "3"]
    env = build_env(ArithmeticEnv, parse_cli(ArithmeticEnv, argv))
    asyncio.run(env.run_evaluate())
    metrics = json.loads((tmp_path / "evals" / "metrics.json").read_text())["results"]["all"]
    accuracy = [v for k, v in metrics.items() if k.startswith("eval/")]
    assert accuracy and all(0.0 <= v <= 1.0 for v in accuracy)
