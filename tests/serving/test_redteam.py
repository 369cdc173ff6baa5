"""Attacks on a real ``atropos-serve-model`` process: every bad value of every sampling field on
every endpoint is a 400 naming the field, text no tokenizer takes is refused up front, one
request cannot ask for an unbounded number of completions, and a page on another site cannot
post even when its browser withholds ``Origin``."""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest

from tests.serving.support import AUTH

CHAT = [{"role": "user", "content": "hi"}]
BASES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1},
    "/generate": {"prompt": "hi", "max_tokens": 1},
}
# Values every numeric sampling field must refuse: beyond int64/uint64, beyond float range
# (written as JSON literals: NaN/Infinity, 1e400), and the wrong JSON types.
NUMERIC_FIELDS = [
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
BAD_LITERALS = [
    str(2**64),
    str(-(2**64)),
    "1e400",
    "-1e400",
    "NaN",
    "Infinity",
    '"x"',
    "[1]",
    '{"a": 1}',
    "[[[[1]]]]",
]
SURROGATE = "\\ud800"  # a lone UTF-16 surrogate, as JSON text


def _post_raw(url: str, text: str, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(
        url,
        content=text.encode(),
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


def _with_literal(body: dict, field: str, literal: str) -> str:
    marker = "__VALUE__"
    return json.dumps({**body, field: marker}).replace(f'"{marker}"', literal)


def test_bad_sampling_values_are_400_naming_the_field_on_every_endpoint(served):
    failures = []
    with httpx.Client(timeout=30.0) as client:
        for path, base in BASES.items():
            streams = (False, True) if path != "/generate" else (False,)
            for field in NUMERIC_FIELDS:
                for literal in BAD_LITERALS:
                    for stream in streams:
                        body = {**base, "stream": True} if stream else base
                        r = client.post(
                            f"{served.url}{path}",
                            content=_with_literal(body, field, literal).encode(),
                            headers={"Content-Type": "application/json"},
                        )
                        err = r.json().get("error", {}) if r.status_code == 400 else {}
                        if r.status_code != 400 or not str(err.get("param", "")).startswith(field):
                            failures.append((path, field, literal, stream, r.status_code))
    assert not failures, failures[:10]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}, "stop.0"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "model": SURROGATE}, "model"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages.0.content",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "user": "a" + SURROGATE}, "user"),
        ("/generate", {"prompt": SURROGATE}, "prompt"),
        ("/generate", {"prompt": "hi", "extra": {"deep": [1, SURROGATE]}}, "extra.deep.1"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(served, path, body, param):
    """Python's JSON parser accepts ``"\\ud800"``; the tokenizer and the UTF-8 answer encoder
    do not (a 500 before)."""
    text = json.dumps({"max_tokens": 1, **body}).replace("\\\\ud800", "\\ud800")
    r = _post_raw(f"{served.url}{path}", text)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "surrogate" in r.json()["error"]["message"]


def test_one_request_cannot_ask_for_unbounded_completions(served):
    """Prompts times ``n`` is bounded: 2,000 prompts at n=128 would hold every other client
    back for minutes (the engine serves requests in order)."""
    many = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": [[1, 2]] * 2000, "n": 128, "max_tokens": 1},
        timeout=30,
    )
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
    flood = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": [[1]] * 5000, "max_tokens": 1},
        timeout=30,
    )
    assert flood.status_code == 400 and flood.json()["error"]["param"] == "prompt"
    fine = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": [[1, 2]] * 4, "n": 2, "max_tokens": 1},
        timeout=30,
    )
    assert fine.status_code == 200 and len(fine.json()["choices"]) == 8


def test_nul_or_overlong_name_in_a_weights_path_is_400_not_500(keyed, tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp())
    r = httpx.post(
        f"{keyed}/update_weights",
        json={"path": os.path.join(root, "ckpt\x00/../../etc")},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    too_long = httpx.post(
        f"{keyed}/update_weights",
        json={"path": os.path.join(root, "a" * 5000)},
        headers=AUTH,
        timeout=30,
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "path"


def test_cross_site_post_without_origin_is_refused(served):
    """A browser names its page's origin on POSTs; a cross-site one without it is refused
    too (it cannot be checked against --cors-origin)."""
    r = httpx.post(
        f"{served.url}/v1/completions",
        json=BASES["/v1/completions"],
        headers={"Sec-Fetch-Site": "cross-site"},
        timeout=30,
    )
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    same = httpx.post(
        f"{served.url}/v1/completions",
        json=BASES["/v1/completions"],
        headers={"Sec-Fetch-Site": "same-origin"},
        timeout=30,
    )
    assert same.status_code == 200


def test_docs_and_schema_need_the_key(keyed):
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models", "/weights_history"):
        assert httpx.get(f"{keyed}{path}", timeout=30).status_code == 401, path
    assert httpx.get(f"{keyed}/health", timeout=30).status_code == 200


def test_bodies_over_the_limit_are_413_declared_or_chunked(served):
    """Nothing bounded a body before: one client posting gigabytes took the server's memory."""
    port = int(served.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
        )
        answer = b""
        for _ in range(100):  # the server closes the connection after its answer
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b'"param": "body"' in answer

    def chunks():
        for _ in range(66):  # 66 MiB without a Content-Length; the default bound is 64
            yield b" " * 2**20

    r = httpx.post(
        f"{served.url}/v1/completions",
        content=chunks(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"]["message"]
    ok = httpx.post(f"{served.url}/v1/completions", json=BASES["/v1/completions"], timeout=30)
    assert ok.status_code == 200


def test_a_chat_with_too_many_messages_is_refused_before_validating_them(served):
    """1.5 million one-word messages (48 MB) used to hold /health back for 13 s while each was
    validated on the event loop; the count is checked first now."""
    many = [{"role": "user", "content": "x"}] * 200_001
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"messages": many, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "200001 messages" in r.json()["error"]["message"]
