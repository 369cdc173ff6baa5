"""OpenAIServer over the layer's one HTTP client: what reaches the server, what comes back,
and the openai exceptions a caller of the openai client expects."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage

from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.policy_version import recording_versions
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.testing.ports import free_port

USER = [{"role": "user", "content": "hi"}]
CHAT = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
    ],
}


def _server(url: str, cls=OpenAIServer, **kw) -> OpenAIServer:
    server = cls(
        APIServerConfig(
            **{"model_name": "m", "api_key": "k", "health_check": False, "timeout": 10, **kw},
            base_url=url,
        )
    )
    server.retry_multiplier = 0.0  # no sleeping between attempts
    return server


class OneShotServer:
    """A loopback HTTP server answering every request with ``answer`` (raw bytes) and
    recording each request's head and body."""

    def __init__(self, answer: bytes = b"", stall: bool = False):
        self.answer = answer
        self.stall = stall
        self.requests: list[tuple[bytes, bytes]] = []

    async def __aenter__(self) -> OneShotServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                self.requests.append((head, body))
                if self.stall:
                    await asyncio.sleep(30)
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def _json_answer(payload: object, headers: bytes = b"") -> bytes:
    body = json.dumps(payload).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + headers
        + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


async def test_a_refused_server_raises_the_openai_connection_error():
    """Before: the raw ``ConnectionRefusedError`` came out of the lean path."""
    server = _server(f"http://127.0.0.1:{free_port()}/v1")
    try:
        with pytest.raises(openai.APIConnectionError) as info:
            await server.chat_completion(messages=USER)
        assert isinstance(info.value.__cause__, OSError)
        assert server.attempts_list[-1] == 3  # retried by the one policy, then raised
    finally:
        await server.close()


async def test_no_answer_in_time_raises_the_openai_timeout_error():
    """Before: a bare ``asyncio.TimeoutError``."""
    async with OneShotServer(stall=True) as upstream:
        server = _server(upstream.url, timeout=1)
        server.retry_attempts = 1
        try:
            with pytest.raises(openai.APITimeoutError):
                await server.chat_completion(messages=USER)
        finally:
            await server.close()


async def test_a_generate_error_answer_is_the_openai_status_error():
    """Before: ``/generate`` errors were ``httpx.HTTPStatusError``, chat errors openai's."""
    body = b'{"error": {"message": "max_tokens: must be >= 1"}}'
    answer = b"HTTP/1.1 422 Unprocessable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with OneShotServer(answer) as upstream:
        server = _server(upstream.url, cls=VLLMServer)
        try:
            with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
                await server.tokens_and_logprobs_completion(input_ids=[1, 2], max_tokens=0)
            posts = [head for head, _ in upstream.requests if head.startswith(b"POST ")]
            assert len(posts) == 1  # a 4xx is not retried (the GET is the one-time route probe)
        finally:
            await server.close()


async def test_chat_answers_report_the_policy_version_header():
    """Before: only ``/generate`` answers' headers were read; chat read the body only."""
    answer = _json_answer(CHAT, b"X-Atropos-Policy-Version: 6\r\n")
    async with OneShotServer(answer) as upstream:
        server = _server(upstream.url)
        try:
            with recording_versions() as seen:
                completion = await server.chat_completion(messages=USER)
            assert isinstance(completion, ChatCompletion)
            assert seen == [6] and server.policy_version == 6
        finally:
            await server.close()


async def test_client_options_and_sdk_objects_reach_the_server_as_the_openai_client_sends_them():
    async with OneShotServer(_json_answer(CHAT)) as upstream:
        server = _server(upstream.url)
        message = ChatCompletionMessage(role="assistant", content="earlier")
        try:
            await server.chat_completion(
                messages=[*USER, message],
                max_tokens=openai.NOT_GIVEN,
                extra_body={"top_k": 5},
                extra_headers={"X-Trace": "t1"},
                extra_query={"api-version": "2"},
                timeout=5,
            )
        finally:
            await server.close()
    [(head, body)] = upstream.requests
    assert head.startswith(b"POST /v1/chat/completions?api-version=2 HTTP/1.1\r\n")
    assert b"x-trace: t1\r\n" in head.lower() and b"authorization: bearer k\r\n" in head.lower()
    sent = json.loads(body)
    assert sent == {
        "messages": [*USER, {"role": "assistant", "content": "earlier"}],
        "top_k": 5,
        "model": "m",
    }


async def test_stream_true_yields_the_openai_chunks():
    chunk = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "o"}, "finish_reason": None}],
    }
    events = b"".join(b"data: %s\n\n" % json.dumps(chunk).encode() for _ in range(2))
    events += b"data: [DONE]\n\n"
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(events), events)
    )
    async with OneShotServer(answer) as upstream:
        server = _server(upstream.url)
        try:
            stream = await server.chat_completion(messages=USER, stream=True)
            async with stream:
                chunks = [c async for c in stream]
        finally:
            await server.close()
    assert [type(c) for c in chunks] == [ChatCompletionChunk, ChatCompletionChunk]
    assert "".join(c.choices[0].delta.content for c in chunks) == "oo"
    assert json.loads(upstream.requests[0][1])["stream"] is True
