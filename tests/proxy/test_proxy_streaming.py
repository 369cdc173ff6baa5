"""The managed-server proxy's ``stream: true`` answers, as processes: a proxy over the fake
inference server (deterministic per seed) and the hostile one (tool calls, failures).

A streamed answer carries the same content, tool calls and finish reasons as the plain
answer to the same request, and the session records the same tokens and logprobs; the
``openai`` SDK reads the stream; errors before streaming are JSON with their status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from atroposlib.testing.proxy import running_proxy
from tests.fake_servers import fake_servers
from tests.hostile_upstream import Upstream, running_upstream

KEY = "stream-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Name three colors."}]
MAX_NODES = 8


class Proxy:
    """The proxy process, with the fake's and the hostile upstream's base URLs."""

    def __init__(self, url: str, fake: str, hostile: Upstream, tokenizer):
        self.url, self.fake, self.hostile, self.tokenizer = url, fake, hostile, tokenizer

    def session(self, base_url: str) -> str:
        r = httpx.post(f"{self.url}/sessions/create", json={"base_url": base_url}, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["uuid"]

    def post(self, sid: str, route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}/{sid}/v1/{route}", json=body, headers=AUTH, timeout=60)

    def nodes(self, sid: str) -> list[dict]:
        return httpx.get(f"{self.url}/{sid}/nodes", headers=AUTH).json()["nodes"]

    def output(self, text: str) -> None:
        """Make the hostile upstream generate ``text``."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.hostile.mode(mode="generate", token_ids=ids)


@pytest.fixture(scope="module")
def proxy(tokenizer, tmp_path_factory) -> Iterator[Proxy]:
    tmp: Path = tmp_path_factory.mktemp("stream-proxy")
    with (
        running_upstream(log_path=tmp / "upstream.log") as hostile,
        fake_servers(1, "--latency-ms", "1") as (fake,),
    ):
        servers = [
            {"base_url": fake.base_url, "server_type": "vllm", "timeout": 20},
            {
                "base_url": f"{hostile.url}/v1",
                "server_type": "vllm",
                "timeout": 20,
                "health_check": False,
            },
        ]
        with running_proxy(
            tmp,
            servers,
            "--max-session-nodes",
            str(MAX_NODES),
            tokenizer=tokenizer,
            model_name="fake",
            api_key=KEY,
        ) as proxy:
            yield Proxy(proxy.url, fake.base_url, hostile, tokenizer)


def _events(r: httpx.Response) -> list[dict]:
    """The chunks of an SSE answer (checking its framing and the final ``[DONE]``)."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n")
    events = r.text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def _node_records(nodes: list[dict]) -> list[tuple]:
    return [(n["tokens"], n["masked_tokens"], n["logprobs"]) for n in nodes]


def test_a_streamed_chat_equals_the_plain_one_token_for_token(proxy):
    """Before: 400 'streaming is not supported by the proxy'."""
    body = {"messages": USER, "n": 3, "max_tokens": 12, "seed": 7}
    plain_sid, stream_sid = proxy.session(proxy.fake), proxy.session(proxy.fake)
    plain = proxy.post(plain_sid, "chat/completions", body)
    assert plain.status_code == 200, plain.text
    streamed = proxy.post(
        stream_sid,
        "chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = _events(streamed)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {"fake"}
    usage = chunks[-1]
    assert usage["choices"] == [] and all(c["usage"] is None for c in chunks[:-1])
    content: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        i = choice["index"]
        content[i] = content.get(i, "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"] is not None:
            assert i not in finish  # one finish reason per choice
            finish[i] = choice["finish_reason"]
    expected = plain.json()["choices"]
    assert sorted(content) == sorted(finish) == [0, 1, 2]
    assert [content[c["index"]] for c in expected] == [c["message"]["content"] for c in expected]
    assert [finish[c["index"]] for c in expected] == [c["finish_reason"] for c in expected]
    assert len(set(content.values())) == 3  # the choices differ: the indexes are not mixed up
    plain_nodes, stream_nodes = proxy.nodes(plain_sid), proxy.nodes(stream_sid)
    assert len(stream_nodes) == 3
    assert _node_records(stream_nodes) == _node_records(plain_nodes)
    prompt = stream_nodes[0]["masked_tokens"].count(-100)
    completion = sum(len(n["tokens"]) - prompt for n in stream_nodes)
    assert usage["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def test_the_openai_sdk_reads_the_stream(proxy):
    sid, plain_sid = proxy.session(proxy.fake), proxy.session(proxy.fake)
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/{sid}/v1", api_key=KEY, max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="fake",
            messages=USER,
            max_tokens=9,
            seed=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        content = {0: "", 1: ""}
        finish, usage = {}, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finish[choice.index] = choice.finish_reason
    finally:
        await client.close()
    plain = proxy.post(
        plain_sid, "chat/completions", {"messages": USER, "max_tokens": 9, "seed": 3, "n": 2}
    ).json()
    assert content == {c["index"]: c["message"]["content"] for c in plain["choices"]}
    assert finish == {c["index"]: c["finish_reason"] for c in plain["choices"]}
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert _node_records(proxy.nodes(sid)) == _node_records(proxy.nodes(plain_sid))


async def test_tool_calls_stream_as_the_plain_answer_parses_them(proxy):
    proxy.output('<tool_call>{"name": "lookup", "arguments": {"q": 1}}</tool_call>')
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    body = {"messages": USER, "max_tokens": 30, "tools": tools}
    sid = proxy.session(f"{proxy.hostile.url}/v1")
    plain = proxy.post(sid, "chat/completions", body).json()["choices"][0]
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/{sid}/v1", api_key=KEY, max_retries=0)
    try:
        stream = await client.chat.completions.create(model="fake", stream=True, **body)
        calls, finish, content = [], None, None
        async for chunk in stream:
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
                if choice.delta.content is not None:
                    content = (content or "") + choice.delta.content
    finally:
        await client.close()
    assert plain["finish_reason"] == finish == "tool_calls"
    assert content == plain["message"].get("content")
    expected = plain["message"]["tool_calls"]
    assert [c.function.name for c in calls] == [c["function"]["name"] for c in expected]
    assert [c.function.arguments for c in calls] == [c["function"]["arguments"] for c in expected]
    assert all(c.id and c.type == "function" for c in calls)  # ids are new per answer
    assert [c.index for c in calls] == list(range(len(expected)))
    nodes = proxy.nodes(sid)
    assert len(nodes) == 2 and nodes[0]["tokens"] == nodes[1]["tokens"]


def test_a_streamed_text_completion_equals_the_plain_one(proxy):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "seed": 5, "n": 2}
    plain_sid, stream_sid = proxy.session(proxy.fake), proxy.session(proxy.fake)
    plain = proxy.post(plain_sid, "completions", body).json()["choices"]
    chunks = _events(proxy.post(stream_sid, "completions", {**body, "stream": True}))
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert all("usage" not in c for c in chunks)  # not asked for
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        (choice,) = c["choices"]
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert text == {c["index"]: c["text"] for c in plain}
    assert finish == {c["index"]: c["finish_reason"] for c in plain}
    assert _node_records(proxy.nodes(stream_sid)) == _node_records(proxy.nodes(plain_sid))
    sdk = openai.OpenAI(base_url=f"{proxy.url}/{stream_sid}/v1", api_key=KEY, max_retries=0)
    with sdk:
        sdk_text = {0: "", 1: ""}
        for chunk in sdk.completions.create(model="fake", stream=True, **body):
            for choice in chunk.choices:
                sdk_text[choice.index] += choice.text
    assert sdk_text == text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"stream": "yes"}, 400, "stream"),
        ({"stream": True, "stream_options": "usage"}, 400, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": 1}},
            400,
            "stream_options.include_usage",
        ),
        ({"stream": True, "n": 0}, 400, "n"),
        ({"stream": True, "max_tokens": 0}, 400, "max_tokens"),
        ({"stream": True, "n": MAX_NODES + 1}, 400, "n"),
        ({"stream": True, "extra_body": {"temperature": -1}}, 400, "temperature"),
    ],
    ids=[
        "stream-not-bool",
        "options-not-object",
        "usage-not-bool",
        "n",
        "max_tokens",
        "nodes-bound",
        "extra_body",
    ],
)
def test_a_bad_streamed_request_is_a_json_error_naming_the_field(proxy, body, status, param):
    sid = proxy.session(proxy.fake)
    r = proxy.post(sid, "chat/completions", {"messages": USER, **body})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == param
    assert proxy.nodes(sid) == []


def test_errors_before_streaming_keep_their_status(proxy):
    sid = proxy.session(proxy.fake)
    full = proxy.post(sid, "chat/completions", {"messages": USER, "n": MAX_NODES, "max_tokens": 2})
    assert full.status_code == 200
    over = proxy.post(sid, "chat/completions", {"messages": USER, "stream": True, "max_tokens": 2})
    assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
    unknown = proxy.post("no-such-session", "chat/completions", {"messages": USER, "stream": True})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    pinned = proxy.session(f"{proxy.hostile.url}/v1")
    try:
        proxy.hostile.mode(mode="raw", status=500, body="boom")
        broken = proxy.post(pinned, "chat/completions", {"messages": USER, "stream": True})
        assert broken.status_code == 502 and broken.json()["error"]["type"] == "upstream_error"
        proxy.hostile.mode(mode="raw", status=422, body="bad request")
        refused = proxy.post(pinned, "completions", {"prompt": "x", "stream": True})
        assert refused.status_code == 422 and refused.json()["error"]["type"] == "upstream_error"
    finally:
        proxy.output("ok")
    assert proxy.nodes(pinned) == []


def test_stream_false_is_a_plain_answer(proxy):
    sid = proxy.session(proxy.fake)
    r = proxy.post(sid, "chat/completions", {"messages": USER, "stream": False, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
