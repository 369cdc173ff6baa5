"""The server layer as the original's callers and subclasses use it.

Token sequences of ``ManagedServer`` (BOS kept, never doubled, extension, request order),
``get_logprobs`` routing, ``update_weight`` coroutines, the ``ServerHarness`` signatures, the
``APIServer`` entry points a subclass overrides, ``ToolCallTranslator`` and the adapter.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from atroposlib.envs.server_handling.managed_server import (
    DummyManagedServer,
    ManagedServer,
    ManagedServerAdapter,
)
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    ReasoningConfig,
)
from atroposlib.envs.server_handling.server_harness import (
    ServerHarness,
    create_chat_completion,
    create_completion,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator
from atroposlib.testing.tokenizers import llama_style_tokenizer

USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def llama_tok():
    return llama_style_tokenizer()


@pytest.fixture(scope="module")
def llama_tok_bos_template():
    return llama_style_tokenizer(template_writes_bos=True)


class RecordingServer:
    """A tokens/logprobs backend that records the ids it was sent and answers fixed outputs,
    optionally after a per-call delay (to answer concurrent calls out of order)."""

    def __init__(self, outputs: list[list[int]], delays: list[float] | None = None):
        self.outputs = outputs
        self.delays = list(delays or [])
        self.sent: list[list[int]] = []

    async def tokens_and_logprobs_completion(self, **kwargs: Any):
        ids = list(kwargs["input_ids"])
        self.sent.append(ids)
        call = len(self.sent) - 1
        if call < len(self.delays):
            await asyncio.sleep(self.delays[call])
        out = self.outputs[call % len(self.outputs)]
        return ids, [out], [[-0.25] * len(out)], ["stop"]


# ----------------------------------------------------------------- token sequences


async def test_new_completion_prompt_keeps_the_tokenizers_bos(llama_tok):
    out = llama_tok.encode(" 4", add_special_tokens=False)
    server = RecordingServer([out])
    managed = ManagedServer(server, llama_tok)
    await managed.completion(prompt="What is 2+2?")
    expected_prompt = llama_tok.encode("What is 2+2?", add_special_tokens=True)
    assert expected_prompt[0] == llama_tok.bos_token_id
    assert server.sent == [expected_prompt]
    [node] = managed.get_state()["nodes"]
    n = len(expected_prompt)
    assert node.tokens == expected_prompt + out
    assert node.masked_tokens == [-100] * n + out
    assert node.logprobs == [1.0] * n + [-0.25] * len(out)


async def test_chat_prompt_keeps_bos_and_masks_the_whole_prompt(llama_tok):
    out = llama_tok.encode("4", add_special_tokens=False)
    server = RecordingServer([out])
    managed = ManagedServer(server, llama_tok)
    await managed.chat_completion(messages=USER)
    text = llama_tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    expected_prompt = llama_tok.encode(text, add_special_tokens=True)
    assert server.sent == [expected_prompt] and expected_prompt[0] == llama_tok.bos_token_id
    [node] = managed.get_state()["nodes"]
    assert node.masked_tokens == [-100] * len(expected_prompt) + out


async def test_bos_written_by_the_chat_template_is_not_doubled(llama_tok_bos_template):
    tok = llama_tok_bos_template
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token)
    assert tok.encode(text, add_special_tokens=True)[:2] == [tok.bos_token_id] * 2
    server = RecordingServer([tok.encode("4", add_special_tokens=False)])
    managed = ManagedServer(server, tok)
    await managed.chat_completion(messages=USER)
    [sent] = server.sent
    assert sent == tok.encode(text, add_special_tokens=False)
    assert sent[0] == tok.bos_token_id and sent[1] != tok.bos_token_id


async def test_extension_reuses_the_node_and_encodes_the_suffix_without_bos(llama_tok):
    first_out = llama_tok.encode(" 4", add_special_tokens=False)
    second_out = llama_tok.encode(" 6", add_special_tokens=False)
    server = RecordingServer([first_out, second_out])
    managed = ManagedServer(server, llama_tok)
    await managed.completion(prompt="What is 2+2?")
    [first] = managed.get_state()["nodes"]
    follow_up = first.full_text + " And 3+3?"
    await managed.completion(prompt=follow_up)
    [second] = managed.get_state()["nodes"]  # the extension replaced its node
    suffix = llama_tok.encode(" And 3+3?", add_special_tokens=False)
    assert server.sent[1] == first.tokens + suffix
    assert second.tokens == first.tokens + suffix + second_out
    assert second.masked_tokens == first.masked_tokens + [-100] * len(suffix) + second_out
    assert second.logprobs == first.logprobs + [1.0] * len(suffix) + [-0.25] * len(second_out)


async def test_nodes_follow_request_order_when_answers_arrive_reversed(llama_tok):
    outs = [llama_tok.encode(f" {w}", add_special_tokens=False) for w in ("six", "seven", "4")]
    # The first request is answered last, the last first.
    server = RecordingServer(outs, delays=[0.3, 0.15, 0.0])
    managed = ManagedServer(server, llama_tok)
    prompts = ["Hello there", "What is 2+2?", "The answer is"]
    await asyncio.gather(*(managed.completion(prompt=p) for p in prompts))
    nodes = managed.get_state()["nodes"]
    assert [n.full_text for n in nodes] == [
        p + llama_tok.decode(o) for p, o in zip(prompts, outs, strict=True)
    ]


async def test_get_logprobs_without_backend_support_names_the_server_type(llama_tok):
    managed = ManagedServer(RecordingServer([[1]]), llama_tok)
    with pytest.raises(NotImplementedError, match="RecordingServer"):
        await managed.get_logprobs(prompt="Hello")


async def test_managed_get_logprobs_encodes_the_prompt_as_a_new_sequence(llama_tok):
    class LogprobServer(RecordingServer):
        async def get_logprobs(self, **kwargs: Any):
            return {"prompt_tokens": kwargs["input_ids"], "top_k": kwargs.get("top_k")}

    managed = ManagedServer(LogprobServer([[1]]), llama_tok)
    got = await managed.get_logprobs(prompt="Hello", top_k=2)
    assert got == {"prompt_tokens": llama_tok.encode("Hello"), "top_k": 2}


# ----------------------------------------------------------------- routing and weights


class LogprobOnly:
    """A server with nothing but ``get_logprobs`` and the semaphores."""

    def __init__(self, name: str, slots: int):
        self.name = name
        self.server_healthy = True
        self.sem = AsyncSemWithAdaptiveWeight(slots)
        self.eval_sem = AsyncSemWithAdaptiveWeight(slots)
        self.in_flight_seen: list[int] = []

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        self.in_flight_seen.append(self.sem.in_use())
        return {"server": self.name, "prompt_tokens": list(kwargs.get("input_ids") or [])}


async def test_server_manager_get_logprobs_routes_to_the_most_available_server():
    manager = ServerManager.__new__(ServerManager)
    small, big = LogprobOnly("small", 1), LogprobOnly("big", 4)
    manager.servers = [small, big]
    got = await manager.get_logprobs(input_ids=[1, 2], top_k=1)
    assert got == {"server": "big", "prompt_tokens": [1, 2]}
    assert big.in_flight_seen == [1]  # it held one of the chosen server's slots
    assert big.sem.in_use() == 0
    await big.sem.acquire()
    await big.sem.acquire()
    await big.sem.acquire()  # big has 1 free slot, small 1: ties go to the first
    got = await manager.get_logprobs(input_ids=[3])
    assert got["server"] == "small"


async def test_server_manager_get_logprobs_uses_api_servers():
    manager = ServerManager([], testing=True)
    harness = manager.servers[0]
    harness.set_logprobs_response([5, 6], {"prompt_topk_token_ids": [[5], [6]]})
    assert await manager.get_logprobs(input_ids=[5, 6], top_k=1) == {
        "prompt_topk_token_ids": [[5], [6]]
    }


async def test_update_weight_is_a_coroutine_everywhere():
    for fn in (APIServer.update_weight, ServerManager.update_weight, ServerHarness.update_weight):
        assert inspect.iscoroutinefunction(fn)
    manager = ServerManager([], testing=True)
    await manager.update_weight(0.25)
    assert manager.servers[0].sem.weight == 0.25 and manager.servers[0].eval_sem.weight == 0.25
    harness = ServerHarness()
    await harness.update_weight(0.5)
    assert harness.sem.weight == 0.5


async def test_server_harness_takes_the_originals_arguments():
    harness = ServerHarness()
    harness.set_desired_response(
        input_message=USER, desired_response=create_chat_completion("four")
    )
    positional = await harness.chat_completion(USER)
    assert positional.choices[0].message.content == "four"
    keyword = await harness.chat_completion(messages=USER)
    assert keyword.choices[0].message.content == "four"
    harness.set_desired_completion("2+2=", create_completion("4"))
    assert (await harness.completion("2+2=")).choices[0].text == "4"
    with pytest.raises(TypeError, match="once"):
        await harness.chat_completion(USER, messages=USER)


class CountingEntryServer(ServerHarness):
    """Overrides the original's ``_chat_comp`` entry point, as subclasses of the original do."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    async def _chat_comp(self, stat_dict, **kwargs):
        self.calls.append(dict(kwargs))
        result = await super()._chat_comp(stat_dict, **kwargs)
        assert stat_dict["attempts"] == 1 and "start" in stat_dict
        return result


async def test_subclass_entry_point_override_is_used_directly_and_through_the_manager():
    server = CountingEntryServer()
    server.set_desired_response(USER, create_chat_completion("hi"))
    await server.chat_completion(messages=USER)
    manager = ServerManager.__new__(ServerManager)
    manager.servers = [server]
    await manager.chat_completion(messages=USER)
    assert [c["messages"] for c in server.calls] == [USER, USER]
    assert all(c["model"] == "harness" and "split" not in c for c in server.calls)
    # Eval requests take the eval entry point instead.
    await server.chat_completion(messages=USER, split="eval")
    assert len(server.calls) == 2


async def test_private_entry_points_run_one_request_with_a_stat_dict():
    server = ServerHarness()
    server.set_desired_completion("x", create_completion("y"))
    stat = {"attempts": 0}
    result = await server._comp(stat, prompt="x", model="harness")
    assert result.choices[0].text == "y" and stat["attempts"] == 1
    assert isinstance(stat["start"], float)


def test_reasoning_constants_and_injection():
    from atroposlib.envs.server_handling import server_baseline

    assert server_baseline.VALID_REASONING_EFFORTS == {
        "none",
        "minimal",
        "low",
        "medium",
        "high",
        "xhigh",
    }
    assert ReasoningConfig.EFFORT_TO_MAX_TOKENS["high"] == 25600
    server = ServerHarness(
        APIServerConfig(model_name="m", base_url="", health_check=False),
    )
    server.reasoning_config = ReasoningConfig(effort="low")
    out = server._inject_reasoning_kwargs({"messages": USER})
    assert out["extra_body"] == {"reasoning": {"enabled": True, "effort": "low"}}


def test_server_manager_base_url_of_a_server():
    manager = ServerManager(
        [APIServerConfig(base_url="http://a/v1", health_check=False, model_name="m")]
    )
    assert manager._get_server_base_url() == "http://a/v1"
    assert manager._get_server_base_url(3) is None


# ----------------------------------------------------------------- tools and adapter


def test_tool_call_translator_takes_the_tokenizer_first(llama_tok):
    translator = ToolCallTranslator(llama_tok, "hermes")
    assert translator.tokenizer is llama_tok and translator.parser_name == "hermes"
    raw = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    content, calls, finish = translator.parse_model_output(raw, tool_choice="auto")
    assert content == "Sure." and finish == "tool_calls"
    assert calls[0].function.name == "add" and calls[0].function.arguments == '{"a": 1}'
    assert translator.parse_model_output("plain") == ("plain", None, "stop")
    assert translator.parse_model_output(raw, tool_choice="none") == (raw, None, "stop")
    rebuilt = translator.reconstruct_raw_text_from_tool_calls([c.model_dump() for c in calls])
    assert translator.parse_model_output(rebuilt)[1][0].function.name == "add"
    ids = llama_tok.encode("Hello", add_special_tokens=True)
    assert translator.decode_with_tool_awareness(ids) == "Hello"
    assert translator.decode_with_tool_awareness(ids, has_tools=True) == "<s>Hello"


async def test_adapter_post_and_copy_go_through_the_managed_server(llama_tok):
    server = RecordingServer([llama_tok.encode("4", add_special_tokens=False)])
    managed = ManagedServer(server, llama_tok)
    adapter = ManagedServerAdapter(managed, "http://x/v1")
    result = await adapter.post(
        "/chat/completions", body={"messages": USER, "max_tokens": 3}, cast_to=ChatCompletion
    )
    assert isinstance(result, ChatCompletion) and result.choices[0].message.content == "4"
    twin = adapter.copy(base_url="http://y/v1")
    assert twin.managed_server is managed and twin.base_url == "http://y/v1"
    await twin.completions.create(prompt="Hello", extra_body={"top_k": 1})
    assert len(managed.get_state()["nodes"]) == 2
    with pytest.raises(ValueError, match="/embeddings"):
        await adapter.post("/embeddings", body={}, cast_to=dict)


async def test_dummy_managed_server_placeholder_nodes():
    class ChatOnly:
        async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
            return create_chat_completion("hi")

    dummy = DummyManagedServer(ChatOnly())
    assert DummyManagedServer.DUMMY_TOKENS == list(range(128))
    assert DummyManagedServer.DUMMY_MASKED_TOKENS == [-100] + list(range(1, 128))
    assert DummyManagedServer.DUMMY_LOGPROBS == [-0.5] * 128
    await dummy.chat_completion(messages=USER)
    [node] = dummy.get_state()["nodes"]
    assert node.full_text == dummy._messages_to_text(USER) + "hi"
    assert node.tokens == DummyManagedServer.DUMMY_TOKENS
    assert node.logprobs == DummyManagedServer.DUMMY_LOGPROBS
    with pytest.raises(NotImplementedError, match="ChatOnly"):
        await dummy.get_logprobs(prompt="x")


def test_backend_modules_keep_the_originals_helpers():
    from atroposlib.envs.server_handling import openai_server, sglang_server, vllm_server

    assert sglang_server.resolve_openai_configs is openai_server.resolve_openai_configs
    assert vllm_server.resolve_openai_configs is openai_server.resolve_openai_configs
    normalize = vllm_server.VLLMServer._normalize_topk_entry
    assert normalize({"3": -1.5, "7": -0.5}) == ([7, 3], [-0.5, -1.5])
    assert normalize([{"4": {"logprob": -2.0}}, {5: -0.1}]) == ([5, 4], [-0.1, -2.0])
    assert normalize(None) == ([], [])
