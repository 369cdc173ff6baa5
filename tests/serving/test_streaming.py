"""``stream: true`` on the OpenAI endpoints: deltas add up to the non-streamed answer."""

from __future__ import annotations

import openai
import pytest

PROMPT = "Liam bakes 6 pies and sells 2. How many pies are left?"


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.v1, api_key="unused", timeout=60, max_retries=0) as c:
        yield c


def test_chat_stream_concatenates_to_the_unstreamed_text(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=20,
        seed=9,
        n=2,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    texts = {0: "", 1: ""}
    finishes = {}
    roles = set()
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            roles.add(c.delta.role)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {0: "length", 1: "length"}
    assert "assistant" in roles
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    assert len(chunks) > 4  # really incremental, not one blob


def test_completion_stream_never_leaks_the_stop_string(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=24, seed=2)
    base = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 4]
    assert stop.strip() and base.find(stop) > 0
    want = base[: base.find(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            **kw, stop=[stop], stream=True, extra_body={"ignore_eos": True}
        )
        if c.choices
    )
    assert streamed == want


def test_completion_stream_with_logprobs_and_several_prompts(client):
    stream = client.completions.create(
        model="tiny",
        prompt=["a", "b"],
        n=2,
        max_tokens=5,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = {i: 0 for i in range(4)}
    for ch in stream:
        for c in ch.choices:
            if c.logprobs is not None:
                tokens[c.index] += len(c.logprobs.token_logprobs)
    assert tokens == {i: 5 for i in range(4)}
