"""Delivery of groups: gzip, 503 Retry-After, outbox on failure, FIFO drain, rejections."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from atroposlib.envs.api_client import GZIP_MIN_BYTES, RolloutAPIClient, encode_body
from atroposlib.envs.outbox import Outbox
from atroposlib.envs.sender import GroupSender


class ScriptedAPI:
    """An httpx transport that answers from a script and records what arrived."""

    def __init__(self, script):
        self.reject_if = None
        self.script = list(script)
        self.received: list = []
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        action = self.script.pop(0) if self.script else 200
        if action == "down":
            raise httpx.ConnectError("refused", request=request)
        if action == 200:
            body = request.content
            if request.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            data = json.loads(body)
            if self.reject_if is not None and self.reject_if(data):
                return httpx.Response(422, json={"detail": "scores[0]: negative"})
            self.received.append(data)
            return httpx.Response(200, json={"status": "received"})
        if isinstance(action, tuple):
            status, headers = action
            return httpx.Response(status, headers=headers, json={"detail": "busy"})
        return httpx.Response(action, json={"detail": f"tokens[0]: bad length ({action})"})


def make_sender(tmp_path, script, **kwargs):
    api = ScriptedAPI(script)
    client = RolloutAPIClient("http://api.test", transport=httpx.MockTransport(api))
    return api, GroupSender(client, Outbox(tmp_path / "outbox"), **kwargs)


def group(i: int) -> dict:
    return {"tokens": [[i, 1]], "masks": [[-100, 1]], "scores": [float(i)], "env_id": 0}


def test_small_body_is_plain_json_and_large_body_is_gzipped():
    small, headers = encode_body({"a": 1})
    assert "Content-Encoding" not in headers and json.loads(small) == {"a": 1}
    payload = {"tokens": [[7] * 2000]}
    big, headers = encode_body(payload)
    assert headers["Content-Encoding"] == "gzip"
    assert len(big) < GZIP_MIN_BYTES and json.loads(gzip.decompress(big)) == payload


def test_body_keeps_the_json_dumps_rules_for_nan_keys_and_big_ints():
    # The fast encoder is used only where it writes the same JSON value; the rest is
    # written by json.dumps as before (NaN as NaN, int keys as strings, big ints exact).
    for payload in (
        {"scores": [1.0, float("nan")], "tokens": [[1, 2]]},
        {"overrides": [{1: "a"}]},
        {"tokens": [[2**70, 1]]},
        {"messages": [("user", "\ud800")]},
    ):
        body, _ = encode_body(payload)
        assert body == json.dumps(payload, separators=(",", ":")).encode()


def test_plain_body_encodes_to_the_same_json_value():
    payload = [
        group(i) | {"generation_params": {"temperature": 0.7}, "note": "é"} for i in range(3)
    ]
    body, headers = encode_body(payload, minimum_size=10**9)
    assert "Content-Encoding" not in headers
    assert json.loads(body) == json.loads(json.dumps(payload))


@pytest.fixture
def sleeps(monkeypatch) -> list:
    """Every ``asyncio.sleep`` delay requested during the test (the sleeps still happen)."""
    requested: list = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args, **kwargs):
        requested.append(delay)
        return await real_sleep(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    return requested


async def test_503_with_retry_after_is_honoured_and_same_group_resent(tmp_path, sleeps):
    api, sender = make_sender(tmp_path, [(503, {"Retry-After": "0.2"}), 200])
    assert await sender.send(group(1)) is True
    assert sleeps == [0.2]  # one wait, of the length the API asked for
    assert api.received == [group(1)] and api.calls == 2
    assert len(sender.outbox) == 0
    await sender.close(drain_timeout_s=0.1)


async def test_unreachable_api_parks_group_in_outbox_then_flushes_in_order(tmp_path):
    api, sender = make_sender(tmp_path, ["down"] * 3, attempts=3)
    assert await sender.send(group(1)) is False
    assert sender.outboxed >= 1
    await sender.send(group(2))
    for _ in range(100):
        if sender.idle:
            break
        await asyncio.sleep(0.05)
    await sender.close(drain_timeout_s=1)
    assert api.received == [group(1), group(2)]
    assert sender.delivered == 2 and not sender.rejected


async def test_concurrent_groups_are_coalesced_in_order(tmp_path):
    api, sender = make_sender(tmp_path, [])
    results = await asyncio.gather(*(sender.send(group(i)) for i in range(20)))
    await sender.close(drain_timeout_s=1)
    assert all(results)
    flat = [g for body in api.received for g in (body if isinstance(body, list) else [body])]
    assert flat == [group(i) for i in range(20)]
    assert api.calls < 20


async def test_rejected_list_is_split_so_only_the_bad_group_is_refused(tmp_path):
    api, sender = make_sender(tmp_path, [])
    api.reject_if = lambda body: isinstance(body, list) or body["scores"][0] < 0
    bad = group(-1)
    results = await asyncio.gather(sender.send(group(1)), sender.send(bad), sender.send(group(2)))
    await sender.close(drain_timeout_s=1)
    flat = [g for body in api.received for g in (body if isinstance(body, list) else [body])]
    assert sorted(g["scores"][0] for g in flat) == [1.0, 2.0]
    assert sender.rejected == {"http_422": 1}
    assert results.count(False) == 1


async def test_client_error_is_counted_per_reason_not_outboxed(tmp_path):
    api, sender = make_sender(tmp_path, [422])
    assert await sender.send(group(1)) is False
    await sender.close(drain_timeout_s=0.1)
    assert sender.rejected == {"http_422": 1}
    assert len(sender.outbox) == 0 and api.received == []


async def test_persistent_503_ends_in_outbox_after_busy_wait(tmp_path):
    api, sender = make_sender(tmp_path, [(503, {"Retry-After": "0.05"})] * 50, busy_wait_s=0.3)
    assert await sender.send(group(3)) is False
    assert sender.outboxed == 1
    await sender.close(drain_timeout_s=0.1)


async def test_close_keeps_undelivered_groups_on_disk(tmp_path):
    api, sender = make_sender(tmp_path, ["down"] * 1000, attempts=1)
    sender.start()
    await sender.send(group(5))
    await sender.close(drain_timeout_s=0.2)
    reopened = Outbox(tmp_path / "outbox")
    assert len(reopened) == 1 and reopened.peek()[1] == group(5)


def test_outbox_is_fifo_and_survives_reopening(tmp_path):
    box = Outbox(tmp_path / "box")
    for i in range(3):
        box.put(group(i))
    again = Outbox(tmp_path / "box")
    seen = []
    while len(again):
        key, payload = again.peek()
        seen.append(payload["tokens"][0][0])
        again.remove(key)
    assert seen == [0, 1, 2]
    box2 = Outbox(tmp_path / "box")
    box2.put(group(9))
    assert box2.peek()[1] == group(9)


async def test_api_client_sends_bearer_key_from_environment(monkeypatch):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        seen["query"] = request.url.query.decode()
        return httpx.Response(200, json={"current_step": 0})

    monkeypatch.setenv("ATROPOS_API_KEY", "s3cret")
    client = RolloutAPIClient("http://api.test", transport=httpx.MockTransport(handler))
    await client.status_env(3)
    await client.aclose()
    assert seen == {"auth": "Bearer s3cret", "query": "env_id=3"}


@pytest.mark.parametrize("value, expected", [("2", 2.0), ("junk", None)])
async def test_retry_after_parsing(value, expected):
    def handler(request):
        return httpx.Response(503, headers={"Retry-After": value})

    client = RolloutAPIClient("http://api.test", transport=httpx.MockTransport(handler))
    result = await client.post_scored(group(1))
    await client.aclose()
    assert result.status == 503 and result.retry_after == expected


def test_outbox_adopts_entries_of_dead_processes_only(tmp_path):
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = Outbox(tmp_path / f"myenv-{dead.pid}")
    old.put(group(1))
    old.put(group(2))
    alive = Outbox(tmp_path / f"myenv-{os.getppid()}")
    alive.put(group(7))
    other_env = Outbox(tmp_path / f"otherenv-{dead.pid}")
    other_env.put(group(8))
    mine = Outbox(tmp_path / f"myenv-{os.getpid()}")
    assert mine.adopt_orphans(tmp_path, "myenv") == 2
    seen = []
    while len(mine):
        key, payload = mine.peek()
        seen.append(payload["scores"][0])
        mine.remove(key)
    assert seen == [1.0, 2.0]
    assert not (tmp_path / f"myenv-{dead.pid}").exists()
    assert len(Outbox(tmp_path / f"myenv-{os.getppid()}")) == 1
    assert len(Outbox(tmp_path / f"otherenv-{dead.pid}")) == 1


async def test_list_too_big_for_the_free_space_is_split_into_single_groups(tmp_path, sleeps):
    api, sender = make_sender(tmp_path, [])
    lists_refused = []

    def busy_for_lists(request: httpx.Request) -> httpx.Response:
        body = request.content
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        data = json.loads(body)
        if isinstance(data, list):
            lists_refused.append(len(data))
            return httpx.Response(503, headers={"Retry-After": "30"}, json={"detail": "queue full"})
        api.received.append(data)
        return httpx.Response(200, json={"status": "received"})

    sender.client = RolloutAPIClient(
        "http://api.test", transport=httpx.MockTransport(busy_for_lists)
    )
    results = await asyncio.gather(*(sender.send(group(i)) for i in range(6)))
    assert all(results) and 30 not in sleeps  # no 30 s Retry-After wait for lists
    await sender.close(drain_timeout_s=1)
    assert [g["scores"][0] for g in api.received] == [float(i) for i in range(6)]
    assert lists_refused


async def test_outbox_list_entry_refused_as_busy_is_split_in_place(tmp_path):
    box = Outbox(tmp_path / "outbox")
    box.put([group(1), group(2)])
    box.put(group(3))
    api, sender = make_sender(tmp_path, [(503, {"Retry-After": "30"})])
    sender.outbox = box
    sender.start()
    for _ in range(100):
        if sender.idle:
            break
        await asyncio.sleep(0.05)
    await sender.close(drain_timeout_s=1)
    assert [g["scores"][0] for g in api.received] == [1.0, 2.0, 3.0]
