"""Unit tests: semaphore, configs, reasoning, SLURM discovery, routing, metrics, harness."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    OpenaiConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_harness import (
    ServerHarness,
    create_chat_completion,
    create_completion,
)
from atroposlib.envs.server_handling.server_manager import (
    ServerManager,
    ServerManagerConfig,
    slurm_inference_urls,
    split_n,
)
from atroposlib.utils.tool_call_parser import extract_tool_calls, parse_tool_call

MESSAGES = [{"role": "user", "content": "hi"}]


class SleepServer(APIServer):
    """In-process server that answers after a delay and records peak concurrency."""

    def __init__(self, config: Any, delay: float = 0.01, **kw: Any):
        super().__init__(config, **kw)
        self.delay = delay
        self.calls = 0
        self.in_flight = 0
        self.peak = 0
        self.seen_kwargs: list[dict] = []

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        self.calls += 1
        self.seen_kwargs.append(kwargs)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return create_chat_completion("ok", n=int(kwargs.get("n") or 1))

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        return create_completion("ok", n=int(kwargs.get("n") or 1))


def _cfg(**kw: Any) -> APIServerConfig:
    return APIServerConfig(**{"health_check": False, "timeout": 5, **kw})


def test_config_defaults_match_the_original():
    b = ServerBaseline()
    assert (b.timeout, b.num_max_requests_at_once, b.num_requests_for_eval) == (1200, 512, 64)
    assert (b.model_name, b.rolling_buffer_length, b.server_type, b.tokenizer_name) == (
        "default",
        1000,
        "openai",
        "none",
    )
    c = APIServerConfig()
    assert (c.api_key, c.base_url, c.n_kwarg_is_ignored, c.health_check) == ("", "", False, True)
    m = ServerManagerConfig()
    assert (m.slurm, m.testing, m.max_n_completions, m.proxy_url) == (False, False, 8, None)
    assert OpenaiConfig is APIServerConfig
    for model in (ServerBaseline, APIServerConfig, ServerManagerConfig, ReasoningConfig):
        assert all(f.description for f in model.model_fields.values()), model


def test_unknown_server_type_is_rejected_naming_the_field():
    with pytest.raises(ValidationError, match="server_type"):
        APIServerConfig(server_type="tgi")


async def test_semaphore_capacity_follows_weight_and_serves_fifo():
    sem = AsyncSemWithAdaptiveWeight(4)
    sem.update_weight(0.5)
    assert sem.try_acquire() and sem.try_acquire()
    assert not sem.try_acquire() and sem.free_slots() == 0
    order: list[int] = []

    async def waiter(i: int) -> None:
        await sem.acquire()
        order.append(i)

    tasks = [asyncio.ensure_future(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    sem.release()
    await asyncio.sleep(0)
    assert order == [0]
    sem.update_weight(1.0)  # two more slots open: the next two waiters get them
    await asyncio.sleep(0)
    assert order == [0, 1, 2]
    await asyncio.gather(*tasks)
    with pytest.raises(ValueError):
        for _ in range(5):
            sem.release()


async def test_semaphore_with_zero_weight_still_admits_one_request():
    sem = AsyncSemWithAdaptiveWeight(8)
    sem.update_weight(0.0)
    assert sem.try_acquire()
    assert not sem.try_acquire()


async def test_cancelled_waiter_does_not_leak_a_slot():
    sem = AsyncSemWithAdaptiveWeight(1)
    await sem.acquire()
    task = asyncio.ensure_future(sem.acquire())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    sem.release()
    assert sem.free_slots() == 1


def test_reasoning_config_builds_extra_body_per_provider():
    assert ReasoningConfig().build_extra_body("http://x") is None
    effort = ReasoningConfig(effort="high")
    assert effort.enabled
    assert effort.build_extra_body("https://api.openai.com/v1") == {"reasoning_effort": "high"}
    assert effort.build_extra_body("https://openrouter.ai/api/v1") == {
        "reasoning": {"enabled": True, "effort": "high"}
    }
    assert effort.build_extra_body("http://x", use_max_tokens=True) == {
        "reasoning": {"enabled": True, "max_tokens": 25600}
    }
    both = ReasoningConfig(effort="low", max_tokens=100)
    assert both.build_extra_body("http://x") == {"reasoning": {"enabled": True, "effort": "low"}}
    assert ReasoningConfig(max_tokens=100).build_extra_body("http://x") == {
        "reasoning": {"enabled": True, "max_tokens": 100}
    }
    assert ReasoningConfig(enabled=True).build_extra_body("https://api.openai.com/v1") == {
        "reasoning_effort": "medium"
    }
    assert ReasoningConfig(enabled=None).enabled is False
    with pytest.raises(ValidationError, match="effort"):
        ReasoningConfig(effort="extreme")


async def test_reasoning_is_injected_in_chat_only_and_can_be_skipped():
    server = SleepServer(
        _cfg(base_url="https://api.openai.com/v1"),
        delay=0,
        reasoning_config=ReasoningConfig(effort="low"),
    )
    await server.chat_completion(messages=MESSAGES, max_tokens=10, temperature=0.2)
    sent = server.seen_kwargs[-1]
    assert sent["extra_body"] == {"reasoning_effort": "low"}
    assert sent["temperature"] == 1.0 and sent["max_completion_tokens"] == 10
    assert "max_tokens" not in sent and sent["model"] == "default"
    await server.chat_completion(messages=MESSAGES, skip_reasoning=True)
    assert "extra_body" not in server.seen_kwargs[-1]


def test_slurm_discovery_reads_infer_tp_as_int():
    env = {"NUM_TRAINING_NODES": "1", "INFER_TP": "4"}
    urls = slurm_inference_urls(env, hostnames=["train0", "inf0", "inf1"])
    assert urls == [
        "http://inf0:9000/v1",
        "http://inf0:9001/v1",
        "http://inf1:9000/v1",
        "http://inf1:9001/v1",
    ]
    assert slurm_inference_urls(env, hostnames=["only"]) is None
    with pytest.raises(ValueError, match="INFER_TP"):
        slurm_inference_urls({"INFER_TP": "two"}, hostnames=["a", "b"])


def test_baseline_template_without_slurm_gives_four_local_servers(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    manager = ServerManager(ServerBaseline(model_name="m", num_max_requests_at_once=7))
    urls = [s.config.base_url for s in manager.servers]
    assert urls == [f"http://localhost:{p}/v1" for p in range(9004, 9008)]
    assert all(s.config.api_key == "x" and s.config.model_name == "m" for s in manager.servers)
    assert all(s.sem.max_val == 7 for s in manager.servers)


def test_server_class_is_chosen_by_server_type_and_unknown_class_rejected():
    from atroposlib.envs.server_handling.openai_server import OpenAIServer
    from atroposlib.envs.server_handling.sglang_server import SGLangServer
    from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    types = ["openai", "vllm", "sglang", "trl"]
    manager = ServerManager(
        [_cfg(base_url=f"http://h{i}/v1", server_type=t) for i, t in enumerate(types)]
    )
    assert [type(s) for s in manager.servers] == [
        OpenAIServer,
        VLLMServer,
        SGLangServer,
        TrlVllmServer,
    ]
    custom = ServerManager([_cfg(base_url="http://h/v1")], server_class=SleepServer)
    assert isinstance(custom.servers[0], SleepServer)
    with pytest.raises(ValueError):
        ServerManager([])


def test_split_n_chunks():
    assert split_n(20, 8) == [8, 8, 4]
    assert split_n(16, 8) == [8, 8]
    assert split_n(3, 8) == [3]


async def test_routing_prefers_most_free_slots_and_never_oversubscribes():
    manager = ServerManager(
        [
            _cfg(base_url="http://a/v1", num_max_requests_at_once=2),
            _cfg(base_url="http://b/v1", num_max_requests_at_once=6),
        ],
        server_class=SleepServer,
    )
    await asyncio.gather(*(manager.chat_completion(messages=MESSAGES) for _ in range(40)))
    a, b = manager.servers
    assert a.calls + b.calls == 40
    assert b.calls > a.calls
    assert a.peak <= 2 and b.peak <= 6


async def test_unhealthy_server_gets_no_traffic():
    manager = ServerManager(
        [_cfg(base_url="http://a/v1"), _cfg(base_url="http://b/v1")], server_class=SleepServer
    )
    manager.servers[0].server_healthy = False
    await asyncio.gather(*(manager.chat_completion(messages=MESSAGES) for _ in range(10)))
    assert manager.servers[0].calls == 0 and manager.servers[1].calls == 10


async def test_eval_split_uses_eval_semaphore_and_eval_metrics():
    manager = ServerManager(
        [_cfg(base_url="http://a/v1", num_requests_for_eval=1)], server_class=SleepServer
    )
    server = manager.servers[0]
    await asyncio.gather(
        *(manager.chat_completion(messages=MESSAGES, split="eval") for _ in range(3))
    )
    assert server.peak == 1  # eval concurrency is 1
    assert len(server.eval_request_timings) == 3 and len(server.request_timings) == 0
    assert "split" not in server.seen_kwargs[-1]
    metrics = await manager.wandb_metrics()
    assert "server/server_0_eval_request_time_avg" in metrics
    assert metrics["server/server_0_eval_retry_rate"] == 1.0


async def test_timings_honour_rolling_buffer_length_and_all_servers_are_reported():
    manager = ServerManager(
        [_cfg(base_url=f"http://{h}/v1", rolling_buffer_length=5) for h in "ab"],
        server_class=SleepServer,
    )
    for s in manager.servers:
        s.delay = 0
    await asyncio.gather(*(manager.chat_completion(messages=MESSAGES) for _ in range(30)))
    assert all(len(s.request_timings) <= 5 for s in manager.servers)
    metrics = await manager.wandb_metrics({})
    for i in range(2):
        for key in (
            "request_time_avg",
            "request_time_std",
            "request_time_99p",
            "average_num_attempts",
        ):
            assert f"server/server_{i}_{key}" in metrics
    assert metrics["server/healthy_servers"] == 2


async def test_update_weight_scales_capacity_on_every_server():
    manager = ServerManager(
        [_cfg(base_url="http://a/v1", num_max_requests_at_once=10)], server_class=SleepServer
    )
    await manager.update_weight(0.3)
    await asyncio.gather(*(manager.chat_completion(messages=MESSAGES) for _ in range(20)))
    assert manager.servers[0].peak == 3


async def test_dedicated_server_holds_a_slot():
    manager = ServerManager(
        [_cfg(base_url="http://a/v1", num_max_requests_at_once=3)], server_class=SleepServer
    )
    async with manager.dedicated_server() as server:
        assert server.sem.in_use() == 1
    assert manager.servers[0].sem.in_use() == 0


async def test_harness_works_directly_and_through_manager():
    manager = ServerManager([], testing=True)
    harness = manager.servers[0]
    assert isinstance(harness, ServerHarness)
    harness.set_desired_response(MESSAGES, create_chat_completion(["a", "b"], n=2))
    harness.set_desired_completion("p", create_completion("c"))
    direct = await harness.chat_completion(messages=MESSAGES, n=2)
    routed = await manager.chat_completion(messages=MESSAGES, n=2)
    assert (
        [c.message.content for c in routed.choices]
        == ["a", "b"]
        == [c.message.content for c in direct.choices]
    )
    assert (await manager.completion(prompt="p")).choices[0].text == "c"
    harness.set_tokens_and_logprobs_response([1, 2], None, [[3]], [[-0.1]], ["length"])
    assert await manager.tokens_and_logprobs_completion(input_ids=[1, 2]) == (
        [1, 2],
        [[3]],
        [[-0.1]],
        ["length"],
    )
    with pytest.raises(KeyError, match="no response"):
        await manager.chat_completion(messages=[{"role": "user", "content": "unknown"}])


def test_tool_call_parser_extracts_calls_and_keeps_malformed_text():
    content, calls = extract_tool_calls(
        'x<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    assert calls == [{"name": "f", "arguments": {"a": 1}}]
    assert content == "x<tool_call>{not json}</tool_call>"
    _, cut = extract_tool_calls('<tool_call>{"name": "g", "arguments": {}}')
    assert cut == [{"name": "g", "arguments": {}}]
    assert parse_tool_call("nothing") == ("-ERROR-", {}, True)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_tool_call('<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools) == (
        "f",
        {},
        False,
    )
    assert (
        parse_tool_call('<tool_call>{"name": "h", "arguments": {}}</tool_call>', tools)[2] is True
    )


def test_unknown_tool_parser_is_rejected():
    from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator

    with pytest.raises(ValueError, match="tool parser"):
        ToolCallTranslator("nope")


class HangingServer(SleepServer):
    """Never answers (until the request deadline cancels it)."""

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        self.calls += 1
        await asyncio.sleep(3600)


async def test_hanging_server_times_out_and_request_moves_on():
    manager = ServerManager(
        [_cfg(base_url="http://hang/v1", timeout=1)], server_class=HangingServer
    )
    manager.servers.append(SleepServer(_cfg(base_url="http://ok/v1", timeout=1), delay=0))
    ok = manager.servers[1]
    ok.sem.add_listener(manager._dispatch)
    # The 30 s bound only guards against a hang; the request times out after 1 s.
    completion = await asyncio.wait_for(manager.chat_completion(messages=MESSAGES), 30)
    assert completion.choices and ok.calls == 1
    assert manager.servers[0].calls == 1  # one timeout, then straight to the other server
    assert manager.servers[0].server_healthy  # no health checks: kept in rotation


async def test_only_server_hanging_raises_after_the_timeout_instead_of_hanging():
    from atroposlib.envs.server_handling.errors import NoHealthyServerError

    manager = ServerManager(
        [_cfg(base_url="http://hang/v1", timeout=1)], server_class=HangingServer
    )
    with pytest.raises(NoHealthyServerError, match="http://hang/v1"):
        await asyncio.wait_for(manager.chat_completion(messages=MESSAGES), 30)  # a hang guard
    assert manager.servers[0].calls == 1  # one attempt, timed out, not retried


def test_slurm_without_scontrol_gives_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="scontrol"):
        slurm_inference_urls({"SLURM_JOB_NODELIST": "node[1-3]"})


def test_use_proxy_without_url_is_rejected(monkeypatch):
    monkeypatch.delenv("ATROPOS_PROXY_URL", raising=False)
    with pytest.raises(ValueError, match="proxy_url"):
        ServerManager([], testing=True, use_proxy=True)


def test_generate_body_drops_openai_only_keys_and_merges_extra_body():
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    body = VLLMServer._sampling_kwargs(
        {
            "model": "m",
            "max_completion_tokens": 5,
            "stream": False,
            "top_logprobs": 3,
            "extra_body": {"top_k": 20},
            "temperature": 0.7,
            "stop": None,
        }
    )
    assert body == {"max_tokens": 5, "top_k": 20, "temperature": 0.7}


async def test_invalid_n_is_rejected_naming_n():
    manager = ServerManager([], testing=True)
    for bad in (0, -2, "3", 1.5):
        with pytest.raises(ValueError, match="n must be a positive integer"):
            await manager.chat_completion(messages=MESSAGES, n=bad)
