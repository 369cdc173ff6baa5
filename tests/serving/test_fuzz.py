"""Schemathesis over a running serve-model's own OpenAPI schema: no client input yields a 5xx.

Every route is fuzzed, valid bodies (``POSITIVE``: they must generate or be refused with a
4xx) and invalid ones (``NEGATIVE``). The server has its own process: the fuzzer pauses
it, asks for weight updates and sends client chat templates, which the shared servers of
the other tests must not see. A template renders in the sandbox (``--allow-client-chat-template``)
and updates only read under ``--weights-root`` (an empty folder here).
"""

from __future__ import annotations

import gzip
from typing import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from tests.serving.support import serve_cmd

EXAMPLES = 16
"""Cases per route and mode: some 300 requests in all."""

_LONE = '"a\\ud800b"'  # a lone UTF-16 surrogate: valid JSON, not valid Unicode
_HOSTILE_TEXT = [
    ("/v1/completions", '{"prompt": LONE, "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop": [LONE], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", LONE: 1, "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": [[]], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [4611686018427387904]}'),
    ("/v1/completions", '{"prompt": NaN}'),
    ("/v1/completions", "[]"),
    ("/v1/completions", "null"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": LONE}]}'),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"a": 1}]}]}',
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], '
        '"chat_template": "{% for i in range(10**9) %}a{% endfor %}"}',
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": 1}}',
    ),
    ("/generate", '{"prompt": {"prompt_token_ids": []}}'),
    ("/generate", '{"prompt": {"prompt_token_ids": [1, 1099511627776]}}'),
    ("/update_weights", '{"path": LONE}'),
    ("/update_weights", '{"path": "\\u0000"}'),
]
HOSTILE = [(path, text.replace("LONE", _LONE).encode()) for path, text in _HOSTILE_TEXT] + [
    ("/v1/completions", b"\xff\xfe"),
]
"""Bodies that break servers which trust their parser: invalid Unicode in values and keys,
empty and out-of-range token ids, templates that fail or never end, bodies that are not
objects or not UTF-8."""


@pytest.fixture(scope="module")
def serve_schema(
    tiny_model_dir, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[schemathesis.BaseSchema, str]]:
    """A serve-model of this module's own and its OpenAPI schema."""
    tmp = tmp_path_factory.mktemp("serve_fuzz")
    (tmp / "weights").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_cmd(
        tiny_model_dir, port,
        "--weights-root", str(tmp / "weights"),
        "--allow-client-chat-template", "--client-template-timeout", "2",
        "--max-model-len", "256",
    )  # fmt: skip
    with running_process(cmd, health_url=f"{url}/health", timeout=180, log_path=tmp / "serve.log"):
        yield schemathesis.openapi.from_url(f"{url}/openapi.json"), url


@pytest.mark.parametrize("path, body", HOSTILE)
@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_hostile_bodies_are_4xx(
    serve_schema: tuple[schemathesis.BaseSchema, str], path: str, body: bytes, encoding: str
) -> None:
    _, url = serve_schema
    data = gzip.compress(body, mtime=0) if encoding == "gzip" else body
    headers = {"content-type": "application/json", "content-encoding": encoding}
    r = httpx.post(f"{url}{path}", content=data, headers=headers, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "error" in r.json()


@pytest.mark.parametrize("encoding", ["garbage", "truncated"])
def test_broken_gzip_bodies_are_4xx(
    serve_schema: tuple[schemathesis.BaseSchema, str], encoding: str
) -> None:
    _, url = serve_schema
    whole = gzip.compress(b'{"prompt": "hi", "max_tokens": 2}', mtime=0)
    data = b"not gzip" if encoding == "garbage" else whole[:-6]
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    r = httpx.post(f"{url}/v1/completions", content=data, headers=headers, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_client_input_makes_serve_model_answer_5xx(
    serve_schema: tuple[schemathesis.BaseSchema, str], mode: GenerationMode
) -> None:
    schema, url = serve_schema
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/update_weights"} <= paths
    calls = 0
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (operation.body or operation.query):
            continue  # nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case: schemathesis.Case) -> None:
            nonlocal calls
            calls += 1
            case.call_and_validate(checks=[not_a_server_error], timeout=30)

        call()
    assert calls >= 2 * EXAMPLES
    # Whatever the fuzzer paused, the server still generates once resumed.
    httpx.post(f"{url}/resume", timeout=10)
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": ""}, timeout=30
    )
    assert r.status_code in (200, 404), r.text
