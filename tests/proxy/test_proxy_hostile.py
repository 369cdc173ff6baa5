"""The managed-server proxy, as a process, in front of a hostile inference server (also a
process): every fault lands in its status class (the inference server's -> 502
``upstream_error``, the client's -> 400), oversized answers are dropped at a bound, model
output that cannot be encoded is a JSON 502, ``NaN`` in tool-call arguments is never passed
on, ``extra_body`` cannot get around the sampling bounds, ``/setup`` resolves names, and an
IPv6 upstream works."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import stop_process, wait_http
from atroposlib.testing.proxy import running_proxy
from tests.fake_servers import start_fake
from tests.hostile_upstream import Upstream, running_upstream

KEY = "hostile-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]


def _pid_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Proxy:
    """A proxy process over one hostile upstream (sessions pinned to it by default)."""

    def __init__(self, url: str, proc, upstream: Upstream, tokenizer, log: Path):
        self.url, self.proc, self.upstream, self.tokenizer, self.log = (
            url,
            proc,
            upstream,
            tokenizer,
            log,
        )

    def session(self, **body: object) -> str:
        r = httpx.post(f"{self.url}/sessions/create", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json()["uuid"]

    def chat(self, sid: str, body: dict, timeout: float = 60) -> httpx.Response:
        return httpx.post(
            f"{self.url}/{sid}/v1/chat/completions", json=body, headers=AUTH, timeout=timeout
        )

    def output(self, text: str) -> None:
        """Make the upstream generate ``text`` (as the proxy's tokenizer encodes it)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.upstream.mode(mode="generate", token_ids=ids)


def _upstream(base_url: str) -> dict:
    """The proxy's config entry for one upstream (not health-checked: faults are the point)."""
    return {"base_url": base_url, "server_type": "vllm", "timeout": 20, "health_check": False}


def _running_proxy(tmp: Path, tokenizer, upstream_url: str, *extra: str):
    """The proxy, keyed, over the one upstream at ``upstream_url``."""
    return running_proxy(
        tmp, [_upstream(upstream_url)], *extra, tokenizer=tokenizer, model_name="fake", api_key=KEY
    )


@pytest.fixture(scope="module")
def proxy(tokenizer, tmp_path_factory) -> Iterator[Proxy]:
    tmp = tmp_path_factory.mktemp("hostile-proxy")
    with (
        running_upstream(log_path=tmp / "upstream.log") as upstream,
        _running_proxy(tmp, tokenizer, f"{upstream.url}/v1", "--max-upstream-mb", "1") as p,
    ):
        yield Proxy(p.url, p.proc, upstream, tokenizer, p.log)


def _error(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    return r.json()["error"]


# ------------------------------------------------------------------ status classes


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ({"status": 200, "body": "<html>not json</html>"}, "JSONDecodeError"),
        ({"status": 200, "body": json.dumps({"token_ids": "abc", "logprobs": [[1]]})}, ""),
        ({"status": 200, "body": json.dumps({"token_ids": [[1, 2]], "logprobs": None})}, ""),
        ({"status": 200, "body": "[1, 2]"}, ""),
    ],
    ids=["non-JSON 200", "token_ids a string", "logprobs null", "not an object"],
)
def test_answers_outside_the_protocol_are_502_upstream_errors(proxy, answer, words):
    """Before: 400 invalid_request_error, as if the client had sent something wrong."""
    sid = proxy.session()
    proxy.upstream.mode(mode="raw", **answer)
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 502, r.text
    error = _error(r)
    assert error["type"] == "upstream_error" and words in error["message"], error


def test_a_model_number_of_4400_digits_in_tool_arguments_is_not_the_clients_fault(proxy):
    """Before: 400. The call cannot be parsed (Python refuses such integers): the model's
    fault, a 502 — or, with a parser that leaves unparseable calls in the content, a 200."""
    sid = proxy.session(tool_parser="hermes")
    proxy.output('<tool_call>{"name": "f", "arguments": {"x": ' + "7" * 4400 + "}}</tool_call>")
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    if r.status_code == 200:
        assert "7" * 4400 in r.json()["choices"][0]["message"]["content"]
    else:
        assert r.status_code == 502 and _error(r)["type"] == "upstream_error", r.text


def test_client_tool_arguments_nested_too_deeply_are_400(proxy):
    """Before: 502 (the template's RecursionError was taken for an inference server fault)."""
    sid = proxy.session()
    proxy.output("ok")
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    r = proxy.chat(sid, {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert _error(r)["type"] == "invalid_request_error"


def test_model_output_that_cannot_be_encoded_is_a_json_502(proxy):
    """Before: a plain-text 500 (the lone surrogate the model spelled out could not be
    encoded into the response)."""
    sid = proxy.session(tool_parser="hermes")
    proxy.output('<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>')
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 502, r.text
    error = _error(r)
    assert error["type"] == "upstream_error" and "cannot be sent as JSON" in error["message"]


def test_nan_in_model_tool_arguments_is_never_passed_on_as_invalid_json(proxy):
    sid = proxy.session(tool_parser="hermes")
    proxy.output(
        '<tool_call>{"name": "f", "arguments": {"x": NaN, "y": [Infinity, 1], "z": "NaN"}}'
        "</tool_call>"
    )
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"].get("tool_calls")
    assert calls, r.json()
    arguments = calls[0]["function"]["arguments"]

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    assert json.loads(arguments, parse_constant=refuse) == {"x": None, "y": [None, 1], "z": "NaN"}


@pytest.mark.parametrize("status", [401, 403, 404])
def test_upstream_auth_and_routing_errors_do_not_look_like_the_proxys_own(proxy, status):
    """Before: the upstream's 401 came back as a 401, which an OpenAI client reports as a
    bad API key for the proxy."""
    sid = proxy.session()
    proxy.upstream.mode(mode="raw", status=status, body='{"detail": "no"}')
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 502, r.text
    error = _error(r)
    assert error["type"] == "upstream_error" and f"{status}" in error["message"]


def test_an_upstream_client_error_keeps_its_status_marked_as_the_upstreams(proxy):
    sid = proxy.session()
    proxy.upstream.mode(mode="raw", status=422, body='{"detail": "bad sampling"}')
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 422 and _error(r)["type"] == "upstream_error", r.text
    assert "bad sampling" in _error(r)["message"]


def test_an_upstream_redirect_is_a_502_not_a_200_without_choices(proxy):
    sid = proxy.session()
    proxy.upstream.mode(
        mode="raw", status=307, headers={"Location": "http://elsewhere.example/generate"}, body=""
    )
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 502, r.text
    assert "redirect" in _error(r)["message"] and "elsewhere.example" in _error(r)["message"]


# ------------------------------------------------------------------ answer size


@pytest.mark.parametrize("mode", ["huge_length", "stream_close", "endless_headers"])
def test_oversized_upstream_answers_are_dropped_at_the_bound(proxy, mode):
    """Before: Content-Length 10**12 streaming 300 MB grew the proxy by ~600 MB; 100 MB of
    headers without an end were buffered whole. Now each stops at --max-upstream-mb (1 MB
    here) or the header bound; three attempts of 32 MB each leave the proxy's memory alone."""
    sid = proxy.session()
    before = _pid_rss_mb(proxy.proc.pid)
    proxy.upstream.mode(mode=mode, mb=32)
    r = proxy.chat(sid, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 502, r.text
    error = _error(r)
    assert error["type"] == "upstream_error"
    assert ("limit of 1 MB" in error["message"]) or ("headers exceed" in error["message"])
    assert _pid_rss_mb(proxy.proc.pid) - before < 24
    health = httpx.get(f"{proxy.url}/health")
    assert health.status_code == 200


# ------------------------------------------------------------------ requests and setup


def test_extra_body_cannot_get_around_the_sampling_bounds(proxy):
    """Before: ``extra_body: {"n": 100000}`` was 200 and the upstream received n=100000."""
    sid = proxy.session()
    proxy.output("ok")
    r = proxy.chat(sid, {"messages": USER, "extra_body": {"n": 100000}})
    assert r.status_code == 400 and _error(r)["param"] == "n", r.text
    r = proxy.chat(sid, {"messages": USER, "extra_body": {"max_tokens": 0}})
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens", r.text
    r = proxy.chat(sid, {"messages": USER, "extra_body": "n=5"})
    assert r.status_code == 400 and _error(r)["param"] == "extra_body", r.text
    r = httpx.post(
        f"{proxy.url}/{sid}/v1/completions",
        json={"prompt": "hi", "extra_body": {"n": 100000}},
        headers=AUTH,
    )
    assert r.status_code == 400 and _error(r)["param"] == "n", r.text
    ok = proxy.chat(sid, {"messages": USER, "max_tokens": 2, "extra_body": {"top_k": 5}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "host", ["foo.localhost", "localhost.localdomain", "ip6-localhost", "x.y.localhost."]
)
def test_setup_resolves_loopback_names_before_accepting_them(proxy, host):
    """Before: any name that looked like loopback was accepted unresolved (``foo.localhost``
    may resolve anywhere). A name that does not resolve, or resolves to anything but
    loopback, is refused; a name resolving to loopback only is accepted."""
    import socket

    try:
        addresses = {i[4][0] for i in socket.getaddrinfo(host, 80, type=socket.SOCK_STREAM)}
    except OSError:
        addresses = set()
    body = {"servers": [{"base_url": f"http://{host}:{proxy.upstream.port}/v1"}]}
    r = httpx.post(f"{proxy.url}/setup", json=body, headers=AUTH)
    loopback = addresses and all(a.startswith("127.") or a == "::1" for a in addresses)
    if loopback:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 403, r.text
        assert _error(r)["param"] == "servers.0.base_url"
        assert "resolve" in _error(r)["message"]
    restore = {"servers": [_upstream(f"{proxy.upstream.url}/v1")]}
    assert httpx.post(f"{proxy.url}/setup", json=restore, headers=AUTH).status_code == 200


def test_an_ipv6_upstream_serves_sessions(tokenizer, tmp_path):
    """Before: ``http://[::1]:PORT/v1`` passed the policy but every call failed to connect."""
    fake_port = free_port()
    fake = start_fake(fake_port, "--host", "::1", "--latency-ms", "1")
    try:
        wait_http(f"http://[::1]:{fake_port}/health", timeout=60, proc=fake)
        with _running_proxy(tmp_path, tokenizer, f"http://[::1]:{fake_port}/v1") as proxy:
            url = proxy.url
            sid = httpx.post(f"{url}/sessions/create", json={}, headers=AUTH).json()["uuid"]
            r = httpx.post(
                f"{url}/{sid}/v1/chat/completions",
                json={"messages": USER, "max_tokens": 3},
                headers=AUTH,
                timeout=60,
            )
            assert r.status_code == 200 and r.json()["choices"], r.text
    finally:
        stop_process(fake)


def test_a_long_prompt_with_many_choices_is_refused_before_anything_is_stored(proxy):
    """Before: a 4 MB prompt with n=8 was sent and stored eight times (589 MB more RSS)."""
    sid = proxy.session()
    proxy.output("ok")
    before = _pid_rss_mb(proxy.proc.pid)
    long_prompt = [{"role": "user", "content": "x" * 4_000_000}]
    r = proxy.chat(sid, {"messages": long_prompt, "n": 8, "max_tokens": 4})
    assert r.status_code == 400 and _error(r)["param"] == "n", r.text[:500]
    assert "--max-stored-tokens" in _error(r)["message"]
    assert _pid_rss_mb(proxy.proc.pid) - before < 100
    nodes = httpx.get(f"{proxy.url}/{sid}/nodes", headers=AUTH).json()["nodes"]
    assert nodes == []


# ------------------------------------------------------------------ the original's client


async def test_the_originals_client_opens_uses_and_cleans_up_a_session(proxy, monkeypatch):
    from atroposlib.envs.server_handling.proxy_client import (
        ProxyManagedServer,
        create_proxy_session,
    )

    monkeypatch.setenv("ATROPOS_API_KEY", KEY)
    proxy.output('<tool_call>{"name": "lookup", "arguments": {"q": 1}}</tool_call>')
    session = await create_proxy_session(proxy.url)  # tool_parser "hermes" by default
    assert session.get_url() == f"{proxy.url}/{session.session_uuid}/v1"
    assert session.model_name == "fake" and session.base_url == f"{proxy.upstream.url}/v1"
    completion = await session.chat_completion(messages=USER, max_tokens=3)
    assert completion.choices[0].message.tool_calls[0].function.name == "lookup"
    assert completion.choices[0].finish_reason == "tool_calls"
    rendered = await session.render(USER)
    assert set(rendered) == {"prompt_text", "token_ids", "num_tokens"}
    assert rendered["num_tokens"] == len(rendered["token_ids"]) > 0
    same = ProxyManagedServer(proxy.url, session.session_uuid, "fake", session.base_url)
    assert len((await same.fetch_state())["nodes"]) == 1
    await session.cleanup()
    gone = httpx.get(f"{proxy.url}/{session.session_uuid}/nodes", headers=AUTH)
    assert gone.status_code == 404
    await same.cleanup()  # already deleted: not an error
    created = httpx.post(f"{proxy.url}/sessions/create", json={}, headers=AUTH).json()
    assert created["tool_parser"] == "hermes" and set(created) >= {
        "uuid",
        "model_name",
        "tool_parser",
        "base_url",
        "created_at",
    }
    off = httpx.post(f"{proxy.url}/sessions/create", json={"tool_parser": None}, headers=AUTH)
    assert off.json()["tool_parser"] is None
