"""APIServer's request path: the one retry policy and what it retries."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from atroposlib.envs.server_handling.errors import (
    ServerConnectionError,
    ServerUnavailableError,
    status_error,
)
from atroposlib.envs.server_handling.server_baseline import APIServer, APIServerConfig
from atroposlib.testing.aio import swallow_one_cancellation

URL = "http://127.0.0.1:9/v1/chat/completions"


class ScriptedServer(APIServer):
    """A backend whose calls fail with the scripted errors, then answer ``"done"``."""

    retry_multiplier = 0.0  # no sleeping between attempts

    def __init__(self, errors: list[BaseException], **config: Any):
        super().__init__(APIServerConfig(**{"model_name": "m", "health_check": False, **config}))
        self.errors = list(errors)
        self.calls = 0

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        return await self._chat_completion_wrapper(**kwargs)


async def test_a_server_error_is_retried_until_it_succeeds_and_attempts_are_counted():
    server = ScriptedServer([status_error("POST", URL, 500, {}, b""), asyncio.TimeoutError()])
    stat: dict[str, Any] = {}
    assert await server._chat_comp(stat, messages=[], model="m") == "done"
    assert server.calls == 3 and stat["attempts"] == 3 and "start" in stat
    assert list(server.attempts_list) == [3] and len(server.request_timings) == 1


async def test_after_the_last_attempt_the_last_error_is_raised_as_it_is():
    errors = [status_error("POST", URL, 503, {}, b"") for _ in range(3)]
    server = ScriptedServer(errors)
    with pytest.raises(type(errors[2])) as info:
        await server.chat_completion(messages=[])
    assert info.value is errors[2] and server.calls == 3
    assert list(server.attempts_list) == [3] and not server.request_timings


@pytest.mark.parametrize(
    "error",
    [status_error("POST", URL, 400, {}, b""), NotImplementedError("no tokens")],
    ids=["4xx", "not-implemented"],
)
async def test_what_another_attempt_cannot_fix_is_tried_once(error):
    server = ScriptedServer([error, error])
    with pytest.raises(type(error)):
        await server.chat_completion(messages=[])
    assert server.calls == 1 and list(server.attempts_list) == [1]


async def test_an_unreachable_server_fails_fast_for_the_manager_and_is_marked_unhealthy():
    refused = ServerConnectionError("POST", URL, ConnectionRefusedError(111, "refused"))
    server = ScriptedServer([refused], base_url="http://127.0.0.1:9/v1", health_check=True)
    server.start_health_check = lambda: None  # type: ignore[method-assign]  # no probe loop here
    with pytest.raises(ServerUnavailableError) as info:
        await server.run_request("chat", {"messages": []}, slot_held=True, fail_fast=True)
    assert info.value.__cause__ is refused and server.calls == 1
    assert server.server_healthy is False


async def test_the_retry_policy_follows_the_servers_settings():
    server = ScriptedServer([])
    server.retry_attempts, server.retry_multiplier, server.retry_max_wait = 5, 2.0, 7.0
    policy = server.retrying()
    assert policy.stop.max_attempt_number == 5
    assert policy.wait.multiplier == 2.0 and policy.wait.max == 7.0


async def test_close_ends_a_health_loop_that_swallowed_a_cancellation(monkeypatch):
    """``asyncio.wait_for`` before Python 3.12 can swallow a cancellation that lands as its inner
    call finishes; the health loop then goes on probing. ``close`` must still end it."""
    from atroposlib.envs.server_handling import server_baseline

    monkeypatch.setattr(server_baseline, "CLOSE_RECANCEL_S", 0.01, raising=False)
    server = ScriptedServer([])
    probes: list[int] = []
    server.check_task = asyncio.get_running_loop().create_task(swallow_one_cancellation(probes))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(server.close(), 30)  # hang guard only: the old close never returned
    assert server.check_task is None and len(probes) > 1
