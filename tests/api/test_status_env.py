"""``GET /status-env``: one route, in both its forms (``?env_id=N`` and the
original's JSON body ``{"env_id": N}``), with FastAPI's 422 wording and its schema entry.

The expected answers were read from a run-api whose FastAPI route still served the JSON-body
form and the 422s; they are pinned here byte for byte, each 422 entry with the ``input`` it
refused, as FastAPI writes it (a very long one described, not echoed).
"""

from __future__ import annotations

import gzip
import socket

import pytest
from fastapi.routing import APIRoute

from atroposlib.api.routes import router
from tests.api.conftest import Api


def _not_int(value: str) -> bytes:
    return (
        b'{"detail":[{"type":"int_parsing","loc":["query","env_id"],'
        b'"msg":"Input should be a valid integer, unable to parse string as an integer",'
        b'"input":' + value.encode() + b"}]}"
    )


def _too_long(digits: int) -> bytes:
    return (
        b'{"detail":[{"type":"int_parsing_size","loc":["query","env_id"],'
        b'"msg":"Unable to parse input string as an integer, exceeded maximum size",'
        b'"input":"<str: ' + str(digits + 2).encode() + b' JSON characters, not echoed>"}]}'
    )


_MISSING = (
    b'{"detail":[{"type":"missing","loc":["query","env_id"],'
    b'"msg":"env_id is required: GET /status-env?env_id=N"}]}'
)


def _unknown(env_id: int) -> bytes:
    message = f"unknown env_id {env_id}: register the environment with /register-env first"
    return f'{{"detail":"{message}","status":"failure","error":"{message}"}}'.encode()


def _get(api: Api, url: str, body: bytes | None = None):
    headers = {"content-type": "application/json"} if body is not None else {}
    return api.client.request("GET", url, content=body, headers=headers)


@pytest.fixture
def registered(fresh: Api) -> Api:
    """A reset server with a trainer and one env (``env_id`` 0)."""
    fresh.start_trainer()
    assert fresh.register_env() == 0
    return fresh


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/status-env?env_id=0", None),
        ("/status-env", b'{"env_id": 0}'),
        ("/status-env", b'{"env_id": "0"}'),
        ("/status-env?foo=1", b'{"env_id": 0, "extra": 1}'),
        ("/status-env?env_id=0", b'{"env_id": 99}'),  # the query wins over the body
        ("/status-env?env_id=00", None),
        ("/status-env?env_id=x&env_id=0", None),  # the last value counts
    ],
)
def test_status_env_answers_the_query_and_the_legacy_body_form_alike(
    registered: Api, url: str, body: bytes | None
):
    answer = _get(registered, url, body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == registered.client.get("/status-env", params={"env_id": 0}).json()
    assert set(answer.json()) >= {"current_step", "queue_size", "env_weight", "max_group_size"}


@pytest.mark.parametrize(
    ("url", "body", "status", "expected"),
    [
        ("/status-env", None, 422, _MISSING),
        ("/status-env", b"   ", 422, _MISSING),
        ("/status-env?foo=1", b"", 422, _MISSING),
        ("/status-env?env_id=abc", None, 422, _not_int('"abc"')),
        ("/status-env?env_id=", None, 422, _not_int('""')),
        ("/status-env?env_id=1.5", None, 422, _not_int('"1.5"')),
        ("/status-env?env_id=0&env_id=x", None, 422, _not_int('"x"')),
        ("/status-env?env_id=0&env_id=", None, 422, _not_int('""')),  # a blank last value counts
        ("/status-env?env_id=%E0%A5%A9", None, 422, _not_int('"\u0969"')),  # no int; UTF-8 as FastAPI writes it
        # Past Python's 4,300-digit int limit: a 422 naming env_id, never a 500.
        ("/status-env?env_id=" + "9" * 4301, None, 422, _too_long(4301)),
        ("/status-env?env_id=" + "1" * 20_000, None, 422, _too_long(20_000)),
        ("/status-env?env_id=" + "9" * 5000, b'{"env_id": 0}', 422, _too_long(5000)),
        ("/status-env?env_id=abc", b'{"env_id": 0}', 422, _not_int('"abc"')),
        (
            "/status-env",
            b"{oops",
            422,
            b'{"detail":[{"type":"json_invalid","loc":["body"],'
            b'"msg":"Invalid JSON: key must be a string at line 1 column 2","input":"{oops"}]}',
        ),
        (
            "/status-env",
            b"{}",
            422,
            b'{"detail":[{"type":"missing","loc":["body","env_id"],"msg":"Field required",'
            b'"input":{}}]}',
        ),
        (
            "/status-env",
            b"[]",
            422,
            b'{"detail":[{"type":"model_type","loc":["body"],"msg":"Input should be an object",'
            b'"input":[]}]}',
        ),
        (
            "/status-env",
            b'{"env_id": 1.5}',
            422,
            b'{"detail":[{"type":"int_from_float","loc":["body","env_id"],'
            b'"msg":"Input should be a valid integer, got a number with a fractional part",'
            b'"input":1.5}]}',
        ),
        ("/status-env?env_id=99", None, 404, _unknown(99)),
        ("/status-env?env_id=1.0", None, 404, _unknown(1)),
        ("/status-env", b'{"env_id": 99}', 404, _unknown(99)),
        ("/status-env?env_id=99", b'{"env_id": 0}', 404, _unknown(99)),
    ],
)
def test_status_env_errors_are_answered_as_before(
    registered: Api, url: str, body: bytes | None, status: int, expected: bytes
):
    answer = _get(registered, url, body)
    assert (answer.status_code, answer.content) == (status, expected)
    assert answer.headers["content-type"] == "application/json"


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_other_methods_on_status_env_are_405_with_allow_get(fresh: Api, method: str):
    answer = fresh.client.request(method, "/status-env?env_id=0")
    assert (answer.status_code, answer.headers["allow"]) == (405, "GET")
    assert answer.content == b'{"detail":"Method Not Allowed"}'


def test_status_env_with_a_trailing_slash_is_redirected_with_its_query(fresh: Api):
    answer = fresh.client.get("/status-env/?env_id=0", follow_redirects=False)
    assert answer.status_code == 307
    assert answer.headers["location"] == f"{fresh.base_url}/status-env?env_id=0"


def test_status_env_schema_entry_is_the_one_fastapi_wrote(fresh: Api):
    schema = fresh.client.get("/openapi.json").json()
    description = "The asking env's id."
    assert schema["paths"]["/status-env"] == {
        "get": {
            "summary": "Status Env",
            "description": "An env's throttling signal; ``env_id`` as query parameter or "
            "(old clients) JSON body.",
            "operationId": "status_env_status_env_get",
            "parameters": [
                {
                    "name": "env_id",
                    "in": "query",
                    "required": False,
                    "schema": {
                        "anyOf": [{"type": "integer"}, {"type": "null"}],
                        "description": description,
                        "title": "Env Id",
                    },
                    "description": description,
                }
            ],
            "responses": {
                "200": {
                    "description": "Successful Response",
                    "content": {"application/json": {"schema": {}}},
                },
                "422": {
                    "description": "Validation Error",
                    "content": {
                        "application/json": {
                            "schema": {"$ref": "#/components/schemas/HTTPValidationError"}
                        }
                    },
                },
            },
        }
    }
    components = schema["components"]["schemas"]
    assert components["HTTPValidationError"]["properties"]["detail"]["items"] == {
        "$ref": "#/components/schemas/ValidationError"
    }
    assert components["ValidationError"]["required"] == ["loc", "msg", "type"]


def test_status_env_is_one_route_of_the_router():
    routes = [r for r in router.routes if isinstance(r, APIRoute) and r.path == "/status-env"]
    assert [r.methods for r in routes] == [{"GET"}]


def _raw_exchange(base_url: str, request: bytes) -> list[bytes]:
    """The status lines a real run-api answers ``request`` with (read until it goes quiet)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        sock.settimeout(0.5)
        data = b""
        while b'"env_weight"' not in data and b'"detail"' not in data:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
    return [line for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


_BODY = b'{"env_id": 0}'
_GZ = gzip.compress(_BODY, mtime=0)
_FORMS = {
    "query": b"GET /status-env?env_id=0 HTTP/1.1\r\n{host}\r\n",
    "JSON body": b"GET /status-env HTTP/1.1\r\n{host}"
    + b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    + _BODY,
    "body, no Content-Type": b"GET /status-env HTTP/1.1\r\n{host}Content-Length: 13\r\n\r\n"
    + _BODY,
    "chunked body": b"GET /status-env HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
    + b"Transfer-Encoding: chunked\r\n\r\nd\r\n"
    + _BODY
    + b"\r\n0\r\n\r\n",
    "gzip body": b"GET /status-env HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
    + b"Content-Encoding: gzip\r\nContent-Length: "
    + str(len(_GZ)).encode()
    + b"\r\n\r\n"
    + _GZ,
    "Expect: 100-continue": b"GET /status-env HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
    + b"Expect: 100-continue\r\nContent-Length: 13\r\n\r\n"
    + _BODY,
    "absolute URI": b"GET http://{hostport}/status-env?env_id=0 HTTP/1.1\r\n{host}\r\n",
    "HTTP/1.0": b"GET /status-env?env_id=0 HTTP/1.0\r\n{host}\r\n",
    "query and body": b"GET /status-env?env_id=0 HTTP/1.1\r\n{host}"
    + b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    + _BODY,
    "fragment": b"GET /status-env?env_id=0#x HTTP/1.1\r\n{host}\r\n",
}


@pytest.mark.parametrize("form", list(_FORMS))
def test_every_request_form_of_status_env_is_answered_200_by_a_real_server(
    registered: Api, form: str
):
    hostport = registered.base_url.removeprefix("http://").encode()
    request = _FORMS[form].replace(b"{host}", b"Host: " + hostport + b"\r\n")
    request = request.replace(b"{hostport}", hostport)
    statuses = _raw_exchange(registered.base_url, request)
    assert statuses and statuses[-1].startswith(b"HTTP/1.1 200"), statuses
