"""errors.py: the one mapping of client failures, and the one classification of errors."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import openai
import pytest
import yarl
from multidict import CIMultiDict, CIMultiDictProxy

from atroposlib.envs.server_handling.errors import (
    ServerConnectionError,
    ServerTimeoutError,
    ServerUnavailableError,
    is_client_error,
    is_retryable,
    is_transient,
    is_transport_error,
    mapped_errors,
    status_code,
    status_error,
)
from atroposlib.proxy.upstream import proxy_error_for

URL = "http://127.0.0.1:9/v1/chat/completions"


def test_unreachable_and_timed_out_are_both_the_openai_and_the_builtin_kind():
    refused = ServerConnectionError("POST", URL, ConnectionRefusedError(111, "refused"))
    assert isinstance(refused, openai.APIConnectionError) and isinstance(refused, ConnectionError)
    assert URL in str(refused) and "refused" in str(refused)
    assert str(refused.request.url) == URL
    slow = ServerTimeoutError("POST", URL, asyncio.TimeoutError("no answer within 2s"))
    assert isinstance(slow, openai.APITimeoutError) and isinstance(slow, asyncio.TimeoutError)
    assert URL in str(slow) and "no answer within 2s" in str(slow)


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, openai.BadRequestError),
        (401, openai.AuthenticationError),
        (403, openai.PermissionDeniedError),
        (404, openai.NotFoundError),
        (409, openai.ConflictError),
        (422, openai.UnprocessableEntityError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
        (503, openai.InternalServerError),
        (302, openai.APIStatusError),
        (418, openai.APIStatusError),
    ],
)
def test_status_answers_raise_the_exception_the_openai_client_raises(status, cls):
    body = b'{"error": {"message": "messages: field required", "type": "invalid", "param": "m"}}'
    error = status_error("POST", URL, status, {"x-request-id": "r1"}, body)
    assert type(error) is cls
    assert error.status_code == status and error.request_id == "r1"
    assert str(error) == f"Error code: {status} - messages: field required"
    assert error.body == {"message": "messages: field required", "type": "invalid", "param": "m"}
    assert error.param == "m" and error.response.json()["error"]["type"] == "invalid"


def test_a_status_answer_that_is_not_json_keeps_its_text():
    error = status_error("GET", URL, 502, {}, b"<html>bad gateway</html>")
    assert str(error) == "Error code: 502" and error.body == "<html>bad gateway</html>"


def test_failures_are_mapped_once_and_answers_pass_through():
    with pytest.raises(ServerConnectionError) as refused:
        with mapped_errors("POST", URL):
            raise ConnectionRefusedError(111, "Connect call failed")
    assert isinstance(refused.value.__cause__, ConnectionRefusedError)
    with pytest.raises(ServerConnectionError):
        with mapped_errors("POST", URL):
            raise aiohttp.ClientConnectionError("reset")
    with pytest.raises(ServerTimeoutError):
        with mapped_errors("POST", URL):
            raise asyncio.TimeoutError()
    with pytest.raises(ValueError, match="not JSON"):  # the server answered, wrongly
        with mapped_errors("POST", URL):
            raise ValueError("not JSON")
    already = status_error("POST", URL, 500, {}, b"")
    with pytest.raises(openai.InternalServerError) as same:
        with mapped_errors("POST", URL):
            raise already
    assert same.value is already


def _httpx_status(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", URL)
    return httpx.HTTPStatusError(
        "x", request=request, response=httpx.Response(code, request=request)
    )


@pytest.mark.parametrize(
    "error, code, transport, client, retryable, transient",
    [
        (status_error("POST", URL, 400, {}, b""), 400, False, True, False, False),
        (status_error("POST", URL, 429, {}, b""), 429, False, False, True, True),
        (status_error("POST", URL, 503, {}, b""), 503, False, False, True, True),
        (_httpx_status(404), 404, False, True, False, False),
        (_httpx_status(408), 408, False, False, True, True),
        (
            aiohttp.ClientResponseError(None, (), status=422),  # type: ignore[arg-type]
            422,
            False,
            True,
            False,
            False,
        ),
        (ServerConnectionError("POST", URL, OSError("x")), None, True, False, True, True),
        (ServerTimeoutError("POST", URL), None, True, False, True, True),
        (httpx.ConnectError("refused"), None, True, False, True, True),
        (ServerUnavailableError("s"), None, True, False, False, True),
        (NotImplementedError("no tokens"), None, False, False, False, False),
        (ValueError("bad answer"), None, False, False, True, False),
    ],
)
def test_every_error_is_classified_in_one_place(
    error, code, transport, client, retryable, transient
):
    assert status_code(error) == code
    assert is_transport_error(error) is transport
    assert is_client_error(error) is client
    assert is_retryable(error) is retryable
    assert is_transient(error) is transient


def test_cancellation_is_never_retried():
    assert not is_retryable(asyncio.CancelledError())


@pytest.mark.parametrize(
    ("exc", "status", "words"),
    [
        (
            status_error("POST", "http://u/v1", 418, {}, b'{"error": {"message": "teapot"}}'),
            418,
            "teapot",
        ),
        (
            httpx.HTTPStatusError(
                "moved",
                request=httpx.Request("POST", "http://u"),
                response=httpx.Response(301, headers={"location": "http://elsewhere/"}),
            ),
            502,
            "http://elsewhere/",
        ),
        (
            aiohttp.ClientResponseError(
                aiohttp.RequestInfo(yarl.URL(URL), "POST", CIMultiDictProxy(CIMultiDict())),
                (),
                status=500,
                message="boom",
            ),
            502,
            "HTTP 500",
        ),
    ],
)
def test_the_proxy_reads_the_status_of_every_client_familys_error_answer(exc, status, words):
    error = proxy_error_for(exc, reached_upstream=True)
    assert error.status == status and error.type == "upstream_error" and words in error.message
