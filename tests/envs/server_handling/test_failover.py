"""Failure behaviour: unhealthy servers leave rotation fast, rejoin, and nothing hangs."""

from __future__ import annotations

import asyncio
import time

import pytest

from atroposlib.envs.server_handling.errors import NoHealthyServerError
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import stop_process, wait_http
from tests.fake_servers import FakeServer, fake_servers, start_fake

MESSAGES = [{"role": "user", "content": "hello"}]


def _cfg(base_url: str, timeout: int = 10) -> APIServerConfig:
    return APIServerConfig(base_url=base_url, model_name="fake", timeout=timeout)


@pytest.fixture
def clean_pair(fake_pool):
    pair = fake_pool[3:5]
    yield pair
    for s in pair:
        s.configure(latency_ms=5, fail_status=None)


async def test_refused_server_is_marked_unhealthy_and_all_requests_succeed(clean_pair):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    manager = ServerManager([_cfg(dead), _cfg(clean_pair[0].base_url)])
    try:
        before = clean_pair[0].stats()["requests"].get("/v1/chat/completions", 0)
        results = await asyncio.gather(
            *(manager.chat_completion(messages=MESSAGES, max_tokens=4) for _ in range(20))
        )
        assert len(results) == 20
        after = clean_pair[0].stats()["requests"].get("/v1/chat/completions", 0)
        assert after - before == 20  # every request answered by the live server
        assert manager.servers[0].server_healthy is False
        assert manager.servers[1].server_healthy is True
    finally:
        await manager.close()


async def test_timed_out_request_moves_to_another_server(clean_pair):
    slow, fast = clean_pair
    slow.configure(latency_ms=5000)
    manager = ServerManager([_cfg(slow.base_url, timeout=1), _cfg(fast.base_url, timeout=1)])
    try:
        before = fast.stats()["requests"].get("/v1/chat/completions", 0)
        completion = await manager.chat_completion(messages=MESSAGES, max_tokens=4)
        assert completion.choices
        # The slow server timed out (pytest-timeout guards a hang), then the fast one answered.
        assert fast.stats()["requests"].get("/v1/chat/completions", 0) == before + 1
    finally:
        await manager.close()


async def test_server_answering_5xx_is_retried_then_request_moves_on(clean_pair):
    broken, good = clean_pair
    broken.configure(fail_status=500)
    manager = ServerManager([_cfg(broken.base_url), _cfg(good.base_url)])
    for s in manager.servers:
        s.retry_multiplier = 0.01
    try:
        before = broken.stats()["requests"].get("/v1/chat/completions", 0)
        completion = await manager.chat_completion(messages=MESSAGES, max_tokens=4)
        assert completion.choices
        assert broken.stats()["requests"].get("/v1/chat/completions", 0) == before + 3
    finally:
        await manager.close()


async def test_all_servers_down_raises_after_timeout_naming_every_server():
    urls = [f"http://127.0.0.1:{free_port()}/v1" for _ in range(2)]
    manager = ServerManager([_cfg(u, timeout=1) for u in urls])
    try:
        with pytest.raises(NoHealthyServerError) as exc:  # pytest-timeout guards a hang
            await manager.chat_completion(messages=MESSAGES, max_tokens=4)
        for url in urls:
            assert url in str(exc.value)
    finally:
        await manager.close()


async def test_callers_wait_while_all_down_and_succeed_when_a_server_returns(tmp_path):
    port = free_port()
    manager = ServerManager([_cfg(f"http://127.0.0.1:{port}/v1", timeout=20)])
    proc = None
    try:
        task = asyncio.ensure_future(manager.chat_completion(messages=MESSAGES, max_tokens=4))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert manager.servers[0].server_healthy is False
        proc = start_fake(port, "--latency-ms", "1", log_path=tmp_path / "late.log")
        completion = await asyncio.wait_for(task, 15)
        assert completion.choices
    finally:
        await manager.close()
        if proc is not None:
            stop_process(proc)


async def test_killed_server_leaves_rotation_and_rejoins_when_back(tmp_path, fake_pool):
    b = fake_pool[0]
    with fake_servers(1, "--latency-ms", "5", tmp_path=tmp_path) as (a,):
        manager = ServerManager([_cfg(a.base_url), _cfg(b.base_url)])
        try:
            await asyncio.gather(*(manager.chat_completion(messages=MESSAGES) for _ in range(4)))
            stop_process(a.proc)
            # Requests keep succeeding while the dead server is detected, which takes a
            # request or two that would have gone to it (a bound on requests, not on time).
            for _ in range(10):
                if not manager.servers[0].server_healthy:
                    break
                await manager.chat_completion(messages=MESSAGES, max_tokens=2)
            assert not manager.servers[0].server_healthy
            results = await asyncio.gather(
                *(manager.chat_completion(messages=MESSAGES, max_tokens=2) for _ in range(8))
            )
            assert len(results) == 8

            a2 = FakeServer(a.port, start_fake(a.port, "--latency-ms", "5"))
            try:
                wait_http(f"{a2.url}/health", timeout=30, proc=a2.proc)
                deadline = time.monotonic() + 30  # a hang guard; health checks rejoin it
                while not manager.servers[0].server_healthy and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert manager.servers[0].server_healthy
                await asyncio.gather(
                    *(manager.chat_completion(messages=MESSAGES, max_tokens=2) for _ in range(8))
                )
                assert a2.stats()["requests"].get("/v1/chat/completions", 0) > 0
            finally:
                stop_process(a2.proc)
        finally:
            await manager.close()
