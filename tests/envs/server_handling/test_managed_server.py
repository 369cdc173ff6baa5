"""ManagedServer: token/mask/logprob tracking over ServerHarness and a real /generate server."""

from __future__ import annotations

import copy
import json
import threading
from types import SimpleNamespace

import pytest

from atroposlib.envs.server_handling.managed_server import (
    OFFLOAD_CHARS,
    DummyManagedServer,
    ManagedServer,
    ManagedServerAdapter,
    fit_logprobs,
    server_tokenizer,
)
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_harness import ServerHarness, create_chat_completion
from atroposlib.envs.server_handling.server_manager import ServerManager

USER = [{"role": "user", "content": "What is 2+2?"}]


def _prompt(tok, messages, add_generation_prompt=True):
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


async def test_chat_completion_records_masked_prompt_and_output_logprobs(tokenizer):
    harness = ServerHarness()
    prompt = _prompt(tokenizer, USER)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    out_a = tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]
    out_b = tokenizer.encode("four", add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(
        prompt,
        prompt_ids,
        [out_a, out_b],
        [[-0.1] * len(out_a), [-0.2] * len(out_b)],
        ["stop", "length"],
    )
    managed = ManagedServer(harness, tokenizer)
    completion = await managed.chat_completion(messages=USER, n=2, max_tokens=8)
    assert [c.message.content for c in completion.choices] == ["4", "four"]
    assert [c.finish_reason for c in completion.choices] == ["stop", "length"]
    nodes = managed.get_state()["nodes"]
    assert len(nodes) == 2
    for node, out, lp in zip(nodes, [out_a, out_b], [-0.1, -0.2], strict=False):
        n_prompt = len(prompt_ids)
        assert node.tokens == prompt_ids + out
        assert node.masked_tokens == [-100] * n_prompt + out
        assert node.logprobs == [1.0] * n_prompt + [lp] * len(out)
    assert nodes[0].metadata["finish_reason"] == "stop"
    assert nodes[1].metadata["finish_reason"] == "length"
    managed.reset()
    assert managed.get_state() == {"nodes": []}


async def test_second_turn_extends_the_first_node_in_place(tokenizer):
    harness = ServerHarness()
    prompt1 = _prompt(tokenizer, USER)
    ids1 = tokenizer.encode(prompt1, add_special_tokens=False)
    out1 = tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]
    harness.set_tokens_and_logprobs_response(prompt1, ids1, [out1], [[-0.3] * len(out1)])
    managed = ManagedServer(harness, tokenizer)
    await managed.chat_completion(messages=USER)
    first = managed.get_state()["nodes"][0]

    turn2 = USER + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    prompt2 = _prompt(tokenizer, turn2)
    assert prompt2.startswith(first.full_text)
    suffix = tokenizer.encode(prompt2[len(first.full_text) :], add_special_tokens=False)
    out2 = tokenizer.encode("6", add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(
        prompt2, first.tokens + suffix, [out2], [[-0.4] * len(out2)]
    )
    await managed.chat_completion(messages=turn2)
    nodes = managed.get_state()["nodes"]
    assert len(nodes) == 1  # replaced in place
    node = nodes[0]
    assert node.tokens == first.tokens + suffix + out2
    assert node.masked_tokens == first.masked_tokens + [-100] * len(suffix) + out2
    assert node.logprobs == first.logprobs + [1.0] * len(suffix) + [-0.4] * len(out2)


async def test_unrelated_prompt_appends_a_fresh_node(tokenizer):
    harness = ServerHarness()
    managed = ManagedServer(harness, tokenizer)
    for text in ("a", "b"):
        msgs = [{"role": "user", "content": text}]
        p = _prompt(tokenizer, msgs)
        harness.set_tokens_and_logprobs_response(p, None, [[5, 6]], [[-1.0, -1.0]])
        await managed.chat_completion(messages=msgs)
    assert len(managed.get_state()["nodes"]) == 2


def test_logprobs_are_padded_with_one_or_truncated():
    assert fit_logprobs([-1.0], 3) == [-1.0, 1.0, 1.0]
    assert fit_logprobs([-1.0, -2.0, -3.0], 2) == [-1.0, -2.0]


async def test_tool_parser_returns_openai_tool_calls_and_node_keeps_raw_text(tokenizer):
    harness = ServerHarness()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    prompt = tokenizer.apply_chat_template(
        USER, tools=tools, tokenize=False, add_generation_prompt=True
    )
    raw = 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    out = tokenizer.encode(raw, add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(prompt, None, [out], [[-0.5] * len(out)])
    managed = ManagedServer(harness, tokenizer, tool_parser="hermes")
    completion = await managed.chat_completion(messages=USER, tools=tools)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 2}
    assert "<tool_call>" in managed.get_state()["nodes"][0].full_text


def test_think_blocks_are_shielded_from_a_stripping_template(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>hmm</think>A"},
        {"role": "user", "content": "q2"},
    ]
    shielded = ManagedServer(ServerHarness(), tok)._convert_messages_to_prompt(msgs)
    assert "<think>hmm</think>A" in shielded
    plain = ManagedServer(
        ServerHarness(), tok, preserve_think_blocks=True
    )._convert_messages_to_prompt(msgs)
    assert "<think>" not in plain


async def test_tree_mode_keeps_every_node_with_its_parent(tokenizer):
    harness = ServerHarness()
    managed = ManagedServer(harness, tokenizer, track_tree=True)
    p1 = _prompt(tokenizer, USER)
    harness.set_tokens_and_logprobs_response(p1, None, [[5], [6]], [[-1.0], [-1.0]])
    await managed.chat_completion(messages=USER, n=2)
    state = managed.get_state()
    assert set(state) == {"sequences", "tree"}
    assert len(state["sequences"]) == 2
    assert all(parent is None for parent in state["tree"].values())


async def test_completion_and_get_logprobs_pass_through(tokenizer):
    harness = ServerHarness()
    harness.set_tokens_and_logprobs_response("Once", None, [[7, 8]], [[-0.1, -0.2]])
    ids = tokenizer.encode("Once", add_special_tokens=False)
    harness.set_logprobs_response(
        ids, {"prompt_tokens": ids, "prompt_topk_token_ids": [[1]], "prompt_topk_logprobs": [[0.0]]}
    )
    managed = ManagedServer(harness, tokenizer)
    completion = await managed.completion(prompt="Once", max_tokens=2)
    assert completion.choices[0].text == tokenizer.decode([7, 8], skip_special_tokens=True)
    out = await managed.get_logprobs(prompt="Once", top_k=1)
    assert out["prompt_tokens"] == ids
    with pytest.raises(ValueError):
        await managed.completion(prompt="")


async def test_adapter_duck_types_async_openai(tokenizer):
    harness = ServerHarness()
    harness.set_tokens_and_logprobs_response(_prompt(tokenizer, USER), None, [[5]], [[-1.0]])
    adapter = ManagedServerAdapter(ManagedServer(harness, tokenizer), base_url="http://x/v1")
    completion = await adapter.chat.completions.create(messages=USER, max_tokens=2)
    assert completion.choices and adapter.base_url == "http://x/v1"
    assert len(adapter.managed_server.get_state()["nodes"]) == 1


async def test_manager_managed_server_uses_harness_and_resets_on_exit(tokenizer):
    manager = ServerManager([], testing=True)
    harness = manager.servers[0]
    harness.set_tokens_and_logprobs_response(
        _prompt(tokenizer, USER), None, [[5, 6]], [[-1.0, -1.0]]
    )
    async with manager.managed_server(tokenizer=tokenizer) as managed:
        assert isinstance(managed, ManagedServer)
        await managed.chat_completion(messages=USER)
        assert len(managed.get_state()["nodes"]) == 1
    assert managed.get_state()["nodes"] == []


async def test_openai_server_needs_opt_in_for_dummy_managed_server(monkeypatch, fake_pool):
    manager = ServerManager([APIServerConfig(base_url=fake_pool[0].base_url, timeout=10)])
    try:
        monkeypatch.delenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", raising=False)
        with pytest.raises(NotImplementedError):
            async with manager.managed_server():
                pass
        monkeypatch.setenv("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "yes")
        async with manager.managed_server() as managed:
            assert isinstance(managed, DummyManagedServer)
            await managed.chat_completion(messages=USER, n=2, max_tokens=4)
            nodes = managed.get_state()["nodes"]
            assert len(nodes) == 2 and nodes[0].tokens == list(range(128))
            assert nodes[0].masked_tokens[0] == -100 and nodes[0].logprobs[1] == -0.5
    finally:
        await manager.close()


async def test_managed_server_over_real_vllm_generate(fake_pool, tokenizer):
    manager = ServerManager(
        [APIServerConfig(base_url=fake_pool[1].base_url, server_type="vllm", timeout=10)]
    )
    try:
        async with manager.managed_server(tokenizer=tokenizer) as managed:
            completion = await managed.chat_completion(messages=USER, n=3, max_tokens=6)
            assert len(completion.choices) == 3
            nodes = managed.get_state()["nodes"]
            prompt_len = len(tokenizer.encode(_prompt(tokenizer, USER), add_special_tokens=False))
            for node in nodes:
                assert len(node.tokens) == len(node.masked_tokens) == len(node.logprobs)
                out = len(node.tokens) - prompt_len
                assert 1 <= out <= 6
                assert node.masked_tokens[:prompt_len] == [-100] * prompt_len
                assert all(lp <= 0 for lp in node.logprobs[prompt_len:])
                assert node.metadata["finish_reason"] in ("stop", "length")
    finally:
        await manager.close()


def test_harness_completion_helper_validates_counts():
    with pytest.raises(ValueError):
        create_chat_completion(["a", "b"], n=3)


class _ThreadRecordingTokenizer:
    """Delegates to the tiny tokenizer and records which thread rendered and encoded."""

    def __init__(self, inner):
        self.inner = inner
        self.threads: list[tuple[str, int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(("render", threading.get_ident()))
        return self.inner.apply_chat_template(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.threads.append(("encode", threading.get_ident()))
        return self.inner.encode(*args, **kwargs)


@pytest.mark.parametrize("size, off_loop", [(100, False), (OFFLOAD_CHARS + 1, True)])
async def test_large_prompts_are_rendered_and_tokenized_off_the_event_loop(
    tokenizer, size, off_loop
):
    recorder = _ThreadRecordingTokenizer(tokenizer)
    messages = [{"role": "user", "content": "a" * size}]
    harness = ServerHarness()
    harness.set_tokens_and_logprobs_response(
        _prompt(tokenizer, messages), output_tokens_list=[[5, 6]]
    )
    managed = ManagedServer(harness, recorder)
    await managed.chat_completion(messages=messages)
    loop_thread = threading.get_ident()
    assert [kind for kind, _ in recorder.threads] == ["render", "encode"]
    assert all((tid != loop_thread) == off_loop for _, tid in recorder.threads)


class _FailedLazyTokenizer:
    """A backend whose lazily loaded tokenizer failed, and whose config names none."""

    config = SimpleNamespace(tokenizer_name="none", model_name="")

    @property
    def tokenizer(self):
        raise ValueError("could not load")


def test_the_tokenizer_is_the_servers_own_else_its_configs_else_a_clear_error(tmp_path):
    assert server_tokenizer(SimpleNamespace(tokenizer="own", config=None)) == "own"
    with pytest.raises(ValueError, match="needs a tokenizer"):
        server_tokenizer(_FailedLazyTokenizer())
    absent = SimpleNamespace(config=SimpleNamespace(tokenizer_name=str(tmp_path / "absent")))
    with pytest.raises(ValueError, match="could not load the tokenizer"):
        server_tokenizer(absent)


@pytest.mark.parametrize("finish", ["stop", "length"])
async def test_a_reply_shown_without_its_special_tokens_still_extends_its_node(tokenizer, finish):
    """The environment gets the reply without special tokens and renders the next turn from
    it: the turn continues the same node (the sampled tokens kept verbatim, both turns
    trained) and an end of turn the model sampled is not encoded a second time."""
    harness = ServerHarness()
    prompt1 = _prompt(tokenizer, USER)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    reply = tokenizer.encode("ab", add_special_tokens=False) + [im_start]
    reply += tokenizer.encode("cd", add_special_tokens=False)
    if finish == "stop":
        reply.append(tokenizer.eos_token_id)
    harness.set_tokens_and_logprobs_response(prompt1, None, [reply], [[-0.3] * len(reply)])
    managed = ManagedServer(harness, tokenizer)
    first = await managed.chat_completion(messages=USER, max_tokens=8)
    shown = first.choices[0].message.content
    assert shown == "abcd"
    (node1,) = managed.get_state()["nodes"]
    assert node1.full_text == prompt1 + tokenizer.decode(reply)  # special tokens kept

    turn2 = USER + [{"role": "assistant", "content": shown}, {"role": "user", "content": "3+3?"}]
    prompt2 = _prompt(tokenizer, turn2)
    assert not prompt2.startswith(node1.full_text)
    # What follows the reply: its end of turn only when the model did not sample it.
    rest = prompt2[len(prompt1 + shown) :]
    if finish == "stop":
        rest = rest[len(tokenizer.eos_token) :]
    suffix = tokenizer.encode(rest, add_special_tokens=False)
    out2 = tokenizer.encode("6", add_special_tokens=False)
    harness.set_tokens_and_logprobs_response(prompt2, None, [out2], [[-0.4] * len(out2)])
    await managed.chat_completion(messages=turn2, max_tokens=8)
    (node,) = managed.get_state()["nodes"]
    assert node.tokens == node1.tokens + suffix + out2
    assert node.masked_tokens == node1.masked_tokens + [-100] * len(suffix) + out2
    assert node.logprobs == node1.logprobs + [1.0] * len(suffix) + [-0.4] * len(out2)
    assert node.tokens.count(tokenizer.eos_token_id) == prompt2.count(tokenizer.eos_token)
