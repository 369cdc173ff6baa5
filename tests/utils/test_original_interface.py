"""Utilities and type definitions under the original's names and signatures."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import BaseModel

from atroposlib import type_definitions as td
from atroposlib.envs.eval import build_eval_record
from atroposlib.utils.cli import adjust_model_defaults, extract_namespace, merge_dicts
from atroposlib.utils.force_diverse_samples import generate_with_diverse_first_tokens
from atroposlib.utils.message_history_utils import strip_thinking, truncate_thinking
from atroposlib.utils.tool_call_parser import extract_tool_call


def test_type_definitions_have_the_originals_fields():
    assert set(typing.get_type_hints(td.Observation)) == {"raw", "rendered"}
    assert {"agent_id", "observation", "action", "reward", "done", "info"} <= set(
        typing.get_type_hints(td.GameStep)
    )
    assert set(typing.get_type_hints(td.EvaluationMetrics)) == {"config_general", "results"}
    assert set(typing.get_type_hints(td.EvaluationResults)) == {"all"}
    assert {"gold_parsed", "model_parsed", "response_after_think"} <= set(
        typing.get_type_hints(td.EvaluationSample)
    )
    record = build_eval_record({"acc": 0.5}, "t", "m", 1.0, 2.0, {"n": 1})
    assert set(record) >= set(typing.get_type_hints(td.EvaluationMetrics))
    assert set(typing.get_type_hints(td.EvaluationConfigGeneral)) <= set(record["config_general"])
    assert record["results"]["all"] == {"acc": 0.5}


def test_cli_helpers_take_the_originals_arguments():
    assert merge_dicts() == {}
    assert merge_dicts({"a": {"b": 1}}, {"a": {"c": 2}}, {"d": 3}) == {
        "a": {"b": 1, "c": 2},
        "d": 3,
    }
    assert extract_namespace(model={"env.x": 1, "openai.y": 2}, prefix="env") == {"x": 1}

    class M(BaseModel):
        x: int = 1

    assert adjust_model_defaults(model_class=M, defaults={"x": 5})().x == 5


def test_thinking_helpers_take_response_text():
    assert strip_thinking(response_text="<think>a</think> b") == "b"

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return list(text)

        def decode(self, ids):
            return "".join(ids)

    assert truncate_thinking(
        response_text="<think>abcdef</think>x", tokenizer=Tok(), max_think_tokens=2
    ) == ("<think>...ef</think>x")


def test_extract_tool_call_returns_the_raw_block():
    text = 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert json.loads(extract_tool_call(text)) == {"name": "f", "arguments": {}}
    assert extract_tool_call("<fn>x</fn>", preferred_tags=["fn"]) == "x"
    assert extract_tool_call("no call") is None


class _Choice:
    def __init__(self, text, top=None):
        self.text = text
        self.logprobs = type("L", (), {"top_logprobs": [top]})() if top else None


class _Completion:
    def __init__(self, choices):
        self.choices = choices


class _Server:
    def __init__(self):
        self.prompts: list[str] = []

    async def completion(self, prompt, n=1, max_tokens=1, **kwargs):
        self.prompts.append(prompt)
        if max_tokens == 1:
            return _Completion([_Choice("A", {"A": -0.1, "B": -0.2, "C": -0.3})])
        return _Completion([_Choice(" rest")] * n)


class _Env:
    """What the original binds the helper to: an env with ``server`` and ``tokenizer``."""

    def __init__(self, tokenizer):
        self.server = _Server()
        self.tokenizer = tokenizer


async def test_diverse_first_tokens_as_an_env_method(chat_tokenizer):
    env = _Env(chat_tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    texts = await generate_with_diverse_first_tokens(env, messages, prefill="Sure:", n=3)
    assert sorted(t[0] for t in texts) == ["A", "B", "C"]
    rendered = chat_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert env.server.prompts[0] == rendered + "Sure:"
    with pytest.raises(ValueError, match="tokenizer"):
        await generate_with_diverse_first_tokens(_Server(), messages, n=2)


def test_qwen_fixed_tokenizer_class(tmp_path):
    from atroposlib.tiny_model import ensure_tiny_model
    from atroposlib.utils.tokenizers.qwen_fixed_tokenizer import (
        QwenFixedTokenizer,
        qwen_fixed_chat_template,
    )

    tok = QwenFixedTokenizer(str(ensure_tiny_model()))
    assert QwenFixedTokenizer._load_chat_template() == qwen_fixed_chat_template()
    chat = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>r</think>a"},
        {"role": "user", "content": "q2"},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<think>r</think>a" in text  # earlier reasoning kept
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert tok.decode(list(ids)) == text and tok.eos_token_id is not None
