"""How ``VLLMServer`` finds out which routes a server has: once per server, logged, before any
rollout is spent; the original's ``/generate`` where it exists (the fake server), vLLM's
``/v1/completions`` and ``/weight_info`` where it does not (a raw stand-in for vLLM's server,
which the tests in ``tests/vllm`` replace with the real one)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from typing import Any, AsyncIterator

import openai
import pytest

from atroposlib.envs.server_handling._vllm_routes import VLLMRoutes, tokens_from_choices
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer


class RawVLLM:
    """A loopback HTTP/1.1 server answering as vLLM's own: no ``/generate``, ``/weight_info``,
    ``/v1/completions`` with token ids and logprobs. Counts the requests per route."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.weight_version = "default"
        self.generate_status = 404
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
            length = 0
            for line in head.decode().split("\r\n")[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            self.hits[f"{method} {path}"] += 1
            status, answer = self.answer(path, body)
            data = json.dumps(answer).encode()
            writer.write(
                f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()

    def answer(self, path: str, body: bytes) -> tuple[int, Any]:
        if path == "/generate":
            return self.generate_status, {"detail": "Not Found"}
        if path == "/weight_info":
            return 200, {"weight_version": self.weight_version}
        if path == "/v1/completions":
            req = json.loads(body)
            self.bodies.append(req)
            n, k = req.get("n", 1), req.get("max_tokens", 16)
            choices = [
                {
                    "index": i,
                    "text": "x" * k,
                    "token_ids": [100 + i] * k,
                    "logprobs": {"token_logprobs": [-0.5] * k},
                    "finish_reason": "length",
                }
                for i in reversed(range(n))  # out of order: the client sorts by index
            ]
            return 200, {"choices": choices}
        return 404, {"detail": "Not Found"}


@pytest.fixture
async def raw_vllm() -> AsyncIterator[RawVLLM]:
    stand_in = RawVLLM()
    server = await asyncio.start_server(stand_in.handle, "127.0.0.1", 0)
    stand_in.port = server.sockets[0].getsockname()[1]
    try:
        yield stand_in
    finally:
        server.close()


def vllm_config(port: int) -> APIServerConfig:
    return APIServerConfig(
        base_url=f"http://127.0.0.1:{port}/v1",
        model_name="m",
        server_type="vllm",
        health_check=False,
        timeout=10,
    )


async def test_vllms_own_server_is_probed_once_and_served_from_completions(raw_vllm, caplog):
    """Before: every request posted to /generate and failed with 404."""
    server = VLLMServer(vllm_config(raw_vllm.port))
    try:
        with caplog.at_level(logging.INFO, "atroposlib.envs.server_handling.vllm_server"):
            results = await asyncio.gather(
                *(
                    server.tokens_and_logprobs_completion(input_ids=[1, 2], n=2, max_tokens=3)
                    for _ in range(3)
                )
            )
        raw_vllm.weight_version = "4"
        newer = await server.tokens_and_logprobs_completion(input_ids=[1, 2], max_tokens=1)
    finally:
        await server.close()
    assert raw_vllm.hits["GET /generate"] == 1  # probed once, concurrent first requests share it
    assert raw_vllm.hits["POST /generate"] == 0
    logged = [r.getMessage() for r in caplog.records if "vLLM-type server" in r.getMessage()]
    assert len(logged) == 1 and "/v1/completions" in logged[0] and "/weight_info" in logged[0]
    for prompt, outs, lps, finish in results:
        assert prompt == [1, 2] and outs == [[100] * 3, [101] * 3]
        assert lps == [[-0.5] * 3] * 2 and finish == ["length", "length"]
    assert results[0].policy_version is None  # "default" names no step
    assert newer.policy_version == 4
    sent = raw_vllm.bodies[0]
    assert sent["prompt"] == [1, 2] and sent["model"] == "m"
    assert sent["return_token_ids"] is True and sent["logprobs"] == 0


async def test_a_server_error_on_the_probe_is_not_remembered(raw_vllm):
    raw_vllm.generate_status = 503
    server = VLLMServer(vllm_config(raw_vllm.port))
    try:
        with pytest.raises(openai.InternalServerError):
            await server.routes()
        raw_vllm.generate_status = 404
        assert await server.routes() == VLLMRoutes(generate=False, weight_info=True)
    finally:
        await server.close()
    assert raw_vllm.hits["GET /generate"] == 2


async def test_a_generate_server_keeps_generate(fake_pool):
    server = VLLMServer(
        APIServerConfig(base_url=fake_pool[0].base_url, model_name="fake", server_type="vllm")
    )
    try:
        _, outs, _, _ = await server.tokens_and_logprobs_completion(input_ids=[3, 4], max_tokens=2)
        assert await server.routes() == VLLMRoutes(generate=True, weight_info=False)
    finally:
        await server.close()
    assert len(outs) == 1 and len(outs[0]) == 2


def test_choices_without_token_ids_name_the_missing_feature():
    with pytest.raises(ValueError, match="return_token_ids"):
        tokens_from_choices([{"index": 0, "text": "a", "logprobs": {"token_logprobs": [-1.0]}}])
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        tokens_from_choices([{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}])
