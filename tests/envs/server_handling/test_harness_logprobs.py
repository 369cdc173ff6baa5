"""``ServerHarness`` has ``get_logprobs`` only once a response is set for it, so
``ManagedServer.get_logprobs`` over a bare harness raises NotImplementedError, as over any
backend without prompt logprobs; a test may still give one instance its own."""

from __future__ import annotations

from typing import Any

import pytest

from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_manager import ServerManager


class CharTokenizer:
    """One token per character, BOS 1 first."""

    eos_token_id = 2
    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in tokens if t > 31)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@pytest.fixture
def harness() -> ServerHarness:
    server = ServerHarness()
    server.tokenizer = CharTokenizer()
    return server


async def test_managed_get_logprobs_over_a_bare_harness_is_not_implemented(harness):
    assert not hasattr(harness, "get_logprobs")
    managed = ManagedServer(harness, tokenizer=harness.tokenizer)
    with pytest.raises(NotImplementedError, match="ServerHarness does not implement get_logprobs"):
        await managed.get_logprobs(prompt="Hello", n=1)
    with pytest.raises(AttributeError, match="set_logprobs_response"):
        harness.get_logprobs  # noqa: B018 - the lookup itself is what is checked


async def test_a_test_may_give_the_harness_its_own_get_logprobs(harness):
    seen: list[dict[str, Any]] = []

    async def get_logprobs(**kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs)
        return {"prompt_topk_token_ids": [[5]], "prompt_topk_logprobs": [[-0.1]]}

    harness.get_logprobs = get_logprobs
    managed = ManagedServer(harness, tokenizer=harness.tokenizer)
    messages = [{"role": "user", "content": "Hello"}]
    out = await managed.get_logprobs(messages=messages, top_k=1)
    assert out["prompt_topk_token_ids"] == [[5]]
    assert seen[0]["prompt"] == managed._convert_messages_to_prompt(messages)


async def test_a_set_response_gives_the_harness_get_logprobs(harness):
    top = {"prompt_topk_token_ids": [[7], [8]], "prompt_topk_logprobs": [[0.0], [-1.0]]}
    harness.set_logprobs_response([7, 8], top)
    assert await harness.get_logprobs(input_ids=[7, 8]) == top
    managed = ManagedServer(harness, tokenizer=harness.tokenizer)
    assert await managed.get_logprobs(input_ids=[7, 8], top_k=1) == top
    manager = ServerManager([], testing=True)
    manager.servers[0].set_logprobs_response([7, 8], top)
    assert await manager.get_logprobs(input_ids=[7, 8]) == top
