"""What the proxy takes back for an answer it did not deliver (``atroposlib.proxy.delivery``): a
request's nodes leave the session, a node it continued gets its place back, other
requests' nodes stay; and an answer whose client left before its end is not sent."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import Response

from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.proxy.delivery import (
    STORED,
    ClientWatch,
    RecordingManagedServer,
    Stored,
)


def _prompt(tok: Any, messages: list) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def _recorded(managed: RecordingManagedServer, messages: list, **kw: Any) -> Stored:
    stored: Stored = []
    token = STORED.set(stored)
    try:
        await managed.chat_completion(messages=messages, **kw)
    finally:
        STORED.reset(token)
    return stored


async def test_withdrawing_a_continuation_gives_the_continued_node_back(tokenizer):
    harness = ServerHarness()
    managed = RecordingManagedServer(harness, tokenizer)
    first_msgs = [{"role": "user", "content": "a"}]
    harness.set_tokens_and_logprobs_response(
        _prompt(tokenizer, first_msgs), None, [[5, 6]], [[-1.0, -1.0]]
    )
    await managed.chat_completion(messages=first_msgs)
    other_msgs = [{"role": "user", "content": "b"}]
    harness.set_tokens_and_logprobs_response(_prompt(tokenizer, other_msgs), None, [[7]], [[-1.0]])
    await managed.chat_completion(messages=other_msgs)
    first, other = managed.get_state()["nodes"]
    turn2 = first_msgs + [
        {"role": "assistant", "content": tokenizer.decode([5, 6])},
        {"role": "user", "content": "c"},
    ]
    harness.set_tokens_and_logprobs_response(
        _prompt(tokenizer, turn2), None, [[8], [9]], [[-1.0], [-1.0]]
    )
    stored = await _recorded(managed, turn2, n=2)
    assert len(managed.get_state()["nodes"]) == 3  # first's place now holds its two continuations
    assert managed.withdraw(stored) == 2
    assert managed.get_state()["nodes"] == [first, other]
    assert managed.withdraw(stored) == 0  # nothing twice


async def test_withdrawing_in_tree_mode_restores_what_was_displaced(tokenizer):
    harness = ServerHarness()
    managed = RecordingManagedServer(harness, tokenizer, track_tree=True)
    msgs = [{"role": "user", "content": "a"}]
    harness.set_tokens_and_logprobs_response(_prompt(tokenizer, msgs), None, [[5]], [[-1.0]])
    await managed.chat_completion(messages=msgs)
    kept = dict(managed.get_state()["sequences"])
    harness.set_tokens_and_logprobs_response(
        _prompt(tokenizer, msgs), None, [[5], [6]], [[-1.0], [-1.0]]
    )
    stored = await _recorded(managed, msgs, n=2)
    assert len(managed.get_state()["sequences"]) == 2
    assert managed.withdraw(stored) == 2
    assert managed.get_state()["sequences"] == kept


async def test_an_answer_is_not_sent_once_its_client_is_gone():
    messages: asyncio.Queue = asyncio.Queue()

    async def receive() -> dict:
        return await messages.get()

    sent: list = []

    async def send(message: dict) -> None:
        sent.append(message["type"])

    gone: list = []
    watch = ClientWatch(receive)
    answer = watch.deliver(Response(b"{}"), lambda: gone.append(True))
    await messages.put({"type": "http.disconnect"})
    await asyncio.sleep(0)
    await answer({"type": "http"}, receive, send)
    assert gone == [True] and "http.response.body" not in sent

    delivered = ClientWatch(receive)
    answer = delivered.deliver(Response(b"{}"), lambda: gone.append(True))
    await answer({"type": "http"}, receive, send)
    assert gone == [True] and sent.count("http.response.body") == 1
