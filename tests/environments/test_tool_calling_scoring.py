"""tool calling: call parsing and scoring; multi-turn calculator episodes."""

from __future__ import annotations

import json

import pytest

from environments.tool_calling_server import item_from_row, parse_tool_calls, score_tool_calls
from environments.tool_use_multiturn_server import (
    final_number,
    make_task,
    run_episode,
    run_tool,
    safe_eval,
    score_episode,
)

WEATHER = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]


def call(name, arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.mark.parametrize(
    "text, expected",
    [
        (call("get_weather", {"city": "Paris", "days": 3}), 1.0),  # right
        (
            "<think>weather?</think>" + call("get_weather", {"days": 3.0, "city": "Paris"}),
            1.0,
        ),  # key order, 3.0
        (
            '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}</tool_call>',
            1.0,
        ),
        (call("get_weather", {"city": "Rome", "days": 3}), -1.0),  # wrong argument
        (call("get_forecast", {"city": "Paris", "days": 3}), -1.0),  # wrong name
        (call("get_weather", {"city": "Paris", "days": 3}) * 2, -1.0),  # extra call
        ("<tool_call>{name: get_weather}</tool_call>", -1.0),  # malformed JSON
        (call("get_weather", {"city": "Paris", "days": 3}) + "<tool_call>{", -1.0),  # unclosed tag
        ("It is sunny in Paris.", -1.0),  # no call
        ("", -1.0),  # empty
    ],
)
def test_score_tool_calls(text, expected):
    assert score_tool_calls(text, WEATHER) == expected


def test_no_call_expected_rewards_a_plain_answer():
    assert score_tool_calls("Hello!", []) == 1.0
    assert score_tool_calls(call("x", {}), []) == -1.0
    assert score_tool_calls("", []) == -1.0


def test_parse_counts_malformed_blocks():
    calls, bad = parse_tool_calls(
        call("a", {"x": 1}) + '<tool_call>[1]</tool_call><tool_call>{"name": 3}</tool_call>'
    )
    assert calls == [{"name": "a", "arguments": {"x": 1}}] and bad == 2


def test_rows_of_both_schemas_and_bad_rows():
    item, _ = item_from_row(
        {"query": "q", "tools": [{"name": "f"}], "expected_calls": [{"name": "f", "arguments": {}}]}
    )
    assert "<tools>" in item["system"] and item["expected"] == [{"name": "f", "arguments": {}}]
    hermes = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "H"},
            {"from": "gpt", "value": call("g", {"a": 1})},
        ]
    }
    item, _ = item_from_row(hermes)
    assert (item["system"], item["query"], item["expected"]) == (
        "S",
        "H",
        [{"name": "g", "arguments": {"a": 1}}],
    )
    for row, reason in [
        ({"query": "q"}, "missing_tools"),
        ({"tools": [{}]}, "missing_query"),
        (
            {"query": "q", "tools": [{}], "expected_calls": [{"arguments": {}}]},
            "bad_expected_calls",
        ),
        ({"conversations": [{"from": "human", "value": "H"}]}, "missing_turns"),
        (
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "H"},
                    {"from": "gpt", "value": "no call"},
                ]
            },
            "unparsable_expected_calls",
        ),
    ]:
        assert item_from_row(row) == (None, reason)


@pytest.mark.parametrize(
    "expression, value", [("(12 + 30) * 2", 84), ("-3 ** 2", -9), ("7 / 2", 3.5)]
)
def test_safe_eval_computes_arithmetic(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression", ["__import__('os')", "a + 1", "2 ** 1000", "1 / 0", "[1, 2]", "1 +", "x" * 300]
)
def test_safe_eval_rejects_everything_else(expression):
    with pytest.raises(ValueError):
        safe_eval(expression)


def test_run_tool_reports_results_and_errors_as_json():
    assert json.loads(run_tool({"name": "calculator", "arguments": {"expression": "6*7"}})) == {
        "result": 42
    }
    assert "error" in json.loads(
        run_tool({"name": "calculator", "arguments": {"expression": "6*"}})
    )
    assert "error" in json.loads(run_tool({"name": "calculator", "arguments": {}}))
    assert "unknown tool" in run_tool({"name": "search", "arguments": {}})


@pytest.mark.parametrize(
    "text, answer, malformed, score",
    [
        ("\\boxed{84}", 84, 0, 1.0),
        ("<think>\\boxed{1}</think>\\boxed{1,084}", 1084, 0, 1.0),
        ("\\boxed{83}", 84, 0, -1.0),
        ("84", 84, 0, -1.0),
        ("", 84, 0, -1.0),
        (None, 84, 0, -1.0),
        ("\\boxed{84}", 84, 2, pytest.approx(0.6)),
        ("\\boxed{84}", 84, 50, -1.0),
    ],
)
def test_score_episode(text, answer, malformed, score):
    assert score_episode(text, answer, malformed, 0.2) == score


def test_final_number_reads_the_last_box():
    assert final_number("\\boxed{1} then \\boxed{-2.5}") == -2.5
    assert final_number("\\boxed{abc}") is None


async def test_episode_feeds_tool_results_back_until_a_final_answer():
    replies = iter([call("calculator", {"expression": "(12 + 30) * 2"}), "Done: \\boxed{84}"])
    prompts = []

    async def chat(messages, max_tokens):
        prompts.append(list(messages))
        return next(replies)

    episode = await run_episode(
        chat, "What is (12 + 30) * 2?", max_turns=4, max_tokens_per_turn=32, max_calls_per_turn=2
    )
    assert [m["role"] for m in episode["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert json.loads(episode["messages"][3]["content"]) == {"result": 84}
    assert prompts[1][-1]["role"] == "tool"  # the second turn saw the tool result
    assert episode["tool_calls"] == 1 and episode["final_text"] == "Done: \\boxed{84}"
    assert score_episode(episode["final_text"], 84, episode["malformed_calls"], 0.2) == 1.0


async def test_episode_that_never_answers_has_no_final_text():
    async def chat(messages, max_tokens):
        return call("calculator", {"expression": "1+1"})

    episode = await run_episode(chat, "q", max_turns=2, max_tokens_per_turn=8, max_calls_per_turn=1)
    assert episode["final_text"] is None and episode["tool_calls"] == 2


def test_generated_tasks_are_deterministic_and_correct():
    import random

    a, b = make_task(random.Random(3)), make_task(random.Random(3))
    assert a == b and safe_eval(a["question"][len("What is ") : -1]) == a["answer"]


async def test_multiturn_bad_rows_are_skipped_and_counted(tmp_path):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from environments.tool_use_multiturn_server import MultiTurnToolUseConfig, MultiTurnToolUseEnv
    from tests.environments.env_helpers import write_jsonl

    data = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"question": "What is 2+2?", "answer": 4},
            {"question": "x"},
            {"question": "y", "answer": "four"},
            "[1, 2]",
        ],
    )
    server = APIServerConfig(
        base_url="http://127.0.0.1:9/v1", model_name="m", server_type="vllm", health_check=False
    )
    env = MultiTurnToolUseEnv(
        MultiTurnToolUseConfig(data_path=str(data), tokenizer_name="unused"), server
    )
    await env.setup()
    assert env.rows == [{"question": "What is 2+2?", "answer": 4.0}]
    assert dict(env.skips.counts) == {
        "missing_answer": 1,
        "answer_not_a_number": 1,
        "not_an_object": 1,
    }
    assert await env.get_next_item() == await env.get_next_item()
