"""Ways the original's users build and patch the server layer keep working.

A manager built with ``ServerManager.__new__`` and only ``servers`` set, a ``ManagedServer``
without a tokenizer or over a server whose config is a bare object, the module attributes
that tests patch (``trl_vllm_server.aiohttp``/``AutoTokenizer``,
``tool_call_translator.VLLM_AVAILABLE``) and the reasoning helpers.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from atroposlib.envs.config import BaseEnvConfig
from atroposlib.envs.server_handling import tool_call_translator, trl_vllm_server
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ReasoningConfig
from atroposlib.envs.server_handling.server_harness import (
    ServerHarness,
    create_chat_completion,
    create_completion,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer

USER = [{"role": "user", "content": "Name a colour."}]


def _bare_manager(*servers):
    manager = ServerManager.__new__(ServerManager)
    manager.servers = list(servers)
    return manager


def _prompt(tok, messages):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------- ServerManager.__new__


async def test_manager_built_with_new_serves_every_public_method(tokenizer):
    harness = ServerHarness()
    manager = _bare_manager(harness)

    harness.set_desired_response(USER, create_chat_completion(["red", "blue"], n=2))
    assert [c.message.content for c in (await manager.chat_completion(messages=USER)).choices] == [
        "red",
        "blue",
    ]
    # n above the default max_n_completions (8) is split: two calls, four choices.
    harness.set_desired_response(USER, create_chat_completion(["red", "blue"], n=2))
    split = await manager.chat_completion(messages=USER, n=10)
    assert [c.message.content for c in split.choices] == ["red", "blue", "red", "blue"]

    harness.set_desired_completion("1+1=", create_completion("2"))
    assert (await manager.completion(prompt="1+1=")).choices[0].text == "2"

    harness.set_tokens_and_logprobs_response([1, 2, 3], output_tokens_list=[[7, 8]])
    prompt_ids, outputs, logprobs, reasons = await manager.tokens_and_logprobs_completion(
        input_ids=[1, 2, 3]
    )
    assert (prompt_ids, outputs, logprobs, reasons) == (
        [1, 2, 3],
        [[7, 8]],
        [[-0.5, -0.5]],
        ["stop"],
    )

    top = {
        "prompt_tokens": [1, 2],
        "prompt_topk_token_ids": [[1], [2]],
        "prompt_topk_logprobs": [[0.0], [-1.0]],
    }
    harness.set_logprobs_response([1, 2], top)
    assert await manager.get_logprobs(input_ids=[1, 2]) == top

    await asyncio.wait_for(manager.wait_for_sem(), 5)
    async with manager.dedicated_server() as server:
        assert server is harness

    prompt = _prompt(tokenizer, USER)
    out = tokenizer.encode("green", add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(prompt, output_tokens_list=[out])
    async with manager.managed_server(tokenizer=tokenizer) as managed:
        completion = await managed.chat_completion(messages=USER, max_tokens=4)
        assert completion.choices[0].message.content == "green"
        assert len(managed.get_state()["nodes"]) == 1

    await manager.update_weight(0.5)
    assert harness.sem.weight == 0.5 and harness.eval_sem.weight == 0.5
    await manager.update_weight(1.0)

    metrics = await manager.wandb_metrics({})
    assert metrics["server/healthy_servers"] == 1
    assert metrics["server/server_0_average_num_attempts"] == 1.0

    async with manager as entered:
        assert entered is manager
    await manager.close()


async def test_manager_built_with_new_hands_a_freed_slot_to_a_waiting_caller():
    harness = ServerHarness(
        APIServerConfig(model_name="h", health_check=False, num_max_requests_at_once=1)
    )
    manager = _bare_manager(harness)
    harness.set_desired_response(USER, create_chat_completion("red"))
    async with manager.dedicated_server():
        waiting = asyncio.create_task(manager.chat_completion(messages=USER))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # the only slot is held
    completion = await asyncio.wait_for(waiting, 5)  # woken by the release, no polling
    assert completion.choices[0].message.content == "red"
    await manager.close()


# ----------------------------------------------------------------- ManagedServer tokenizer


class _MinimalConfig:
    """A config as users' tests write it: only ``model_name``, no timeout or limits."""

    model_name = "test_model"


async def test_managed_server_takes_the_servers_tokenizer_and_tolerates_a_minimal_config(
    tokenizer,
):
    harness = ServerHarness()
    harness.tokenizer = tokenizer
    harness.config = _MinimalConfig()
    prompt = _prompt(tokenizer, USER)
    out = tokenizer.encode("blue", add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(prompt, output_tokens_list=[out])
    managed = ManagedServer(harness)
    assert managed.tokenizer is tokenizer
    completion = await managed.chat_completion(messages=USER, max_tokens=4)
    assert completion.choices[0].message.content == "blue"
    assert completion.model == "test_model"
    assert managed.get_state()["nodes"][0].masked_tokens[-len(out) :] == out


def test_managed_server_loads_the_tokenizer_the_server_config_names(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    by_model = ServerHarness(APIServerConfig(model_name=str(tmp_path), health_check=False))
    loaded = ManagedServer(by_model).tokenizer
    assert loaded.encode("hello") == tokenizer.encode("hello")
    by_tokenizer_name = ServerHarness(
        APIServerConfig(
            model_name="no/such-model", tokenizer_name=str(tmp_path), health_check=False
        )
    )
    assert ManagedServer(by_tokenizer_name, None, False, None, False).tokenizer.encode(
        "hi"
    ) == tokenizer.encode("hi")
    nameless = ServerHarness()
    nameless.config = SimpleNamespace()
    with pytest.raises(ValueError, match="tokenizer"):
        ManagedServer(nameless)


# ----------------------------------------------------------------- patched module names


class _FakeTokenizerClass:
    loaded: list[str] = []

    @classmethod
    def from_pretrained(cls, name, *args, **kwargs):
        cls.loaded.append(name)
        return cls.tokenizer


class _FakeAiohttp:
    """Stands in for the aiohttp module: records the posts, answers completion_ids."""

    def __init__(self, completion_ids):
        self.completion_ids = completion_ids
        self.posts: list[tuple[str, dict]] = []
        fake = self

        class ClientTimeout:
            def __init__(self, total=None, **_):
                self.total = total

        class _Response:
            status = 200
            headers: dict = {}

            async def json(self):
                return {"completion_ids": fake.completion_ids}

            async def read(self):
                return json.dumps({"completion_ids": fake.completion_ids}).encode()

            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

        class ClientSession:
            def __init__(self, timeout=None, **_):
                self.timeout = timeout

            def post(self, url, json=None, headers=None):
                fake.posts.append((url, json))
                return _Response()

            async def __aenter__(self):
                return self

            async def __aexit__(self, *exc):
                return False

        self.ClientTimeout = ClientTimeout
        self.ClientSession = ClientSession


async def test_trl_server_uses_the_module_aiohttp_and_autotokenizer(monkeypatch, tokenizer):
    ids = tokenizer.encode("purple", add_special_tokens=False) + [tokenizer.eos_token_id]
    fake_http = _FakeAiohttp([ids])
    _FakeTokenizerClass.tokenizer = tokenizer
    _FakeTokenizerClass.loaded = []
    monkeypatch.setattr(trl_vllm_server, "aiohttp", fake_http)
    monkeypatch.setattr(trl_vllm_server, "AutoTokenizer", _FakeTokenizerClass)
    server = TrlVllmServer(
        APIServerConfig(
            base_url="http://127.0.0.1:1", model_name="org/trl-model", server_type="trl"
        )
    )
    completion = await server.chat_completion(messages=USER, max_tokens=9)
    assert completion.choices[0].message.content == "purple"
    assert completion.choices[0].finish_reason == "stop"
    assert _FakeTokenizerClass.loaded == ["org/trl-model"]
    [(url, body)] = fake_http.posts
    assert url == "http://127.0.0.1:1/generate/"
    assert body["max_tokens"] == 9 and body["prompts"] == [_prompt(tokenizer, USER)]
    await server.close()


def test_tool_call_translator_consults_vllm_available_through_the_module(monkeypatch):
    monkeypatch.setattr(tool_call_translator, "VLLM_AVAILABLE", False)
    with pytest.raises(ValueError, match="needs vLLM"):
        tool_call_translator.ToolCallTranslator("llama3_json")
    # The built-in Hermes/Qwen parsers do not need vLLM.
    hermes = tool_call_translator.ToolCallTranslator("hermes")
    _, calls, finish = hermes.parse_model_output(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    assert calls[0].function.name == "f" and finish == "tool_calls"


async def test_vllm_tool_parsers_are_used_when_vllm_is_available(monkeypatch, tokenizer):
    class FakeParser:
        def __init__(self, tok):
            self.tokenizer = tok

        def extract_tool_calls(self, text, request):
            name, _, args = text.partition(":")
            call = SimpleNamespace(id="call_1", function=SimpleNamespace(name=name, arguments=args))
            return SimpleNamespace(tools_called=True, tool_calls=[call], content=None)

    class FakeManager:
        @staticmethod
        def get_tool_parser(name):
            if name != "fake_json":
                raise KeyError(name)
            return FakeParser

    monkeypatch.setattr(tool_call_translator, "VLLM_AVAILABLE", True)
    monkeypatch.setattr(tool_call_translator, "ToolParserManager", FakeManager, raising=False)
    harness = ServerHarness()
    prompt = _prompt(tokenizer, USER)
    out = tokenizer.encode('lookup:{"q": 1}', add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(prompt, output_tokens_list=[out])
    managed = ManagedServer(harness, tokenizer, tool_parser="fake_json")
    assert managed.translator._vllm_parser.tokenizer is tokenizer
    completion = await managed.chat_completion(messages=USER)
    [call] = completion.choices[0].message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1",
        "lookup",
        '{"q": 1}',
    )
    assert completion.choices[0].finish_reason == "tool_calls"
    with pytest.raises(ValueError, match="unknown tool parser"):
        tool_call_translator.ToolCallTranslator("other")


# ----------------------------------------------------------------- reasoning helpers


def test_reasoning_config_from_env_config_and_activity():
    high = ReasoningConfig.from_env_config(BaseEnvConfig(reasoning_effort="high"))
    assert (high.enabled, high.effort, high.is_reasoning_kwargs_active()) == (True, "high", True)
    thinking = ReasoningConfig.from_env_config(BaseEnvConfig(thinking_mode=True))
    assert thinking.is_reasoning_kwargs_active() and thinking.effort is None
    budget = ReasoningConfig.from_env_config(BaseEnvConfig(max_reasoning_tokens=4096))
    assert budget.build_extra_body("http://x") == {
        "reasoning": {"enabled": True, "max_tokens": 4096}
    }
    off = ReasoningConfig.from_env_config(BaseEnvConfig())
    assert not off.is_reasoning_kwargs_active() and off.build_extra_body("http://x") is None
    assert not ReasoningConfig.from_env_config(SimpleNamespace()).is_reasoning_kwargs_active()


@pytest.mark.parametrize(
    "build", [lambda v: ReasoningConfig(effort=v), lambda v: BaseEnvConfig(reasoning_effort=v)]
)
def test_invalid_reasoning_effort_names_the_value_and_the_choices(build):
    with pytest.raises(ValueError, match=r"Invalid reasoning_effort 'extreme'") as info:
        build("extreme")
    assert "none, minimal, low, medium, high, xhigh" in str(info.value)
