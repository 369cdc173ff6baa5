"""The shared browser guard and bearer auth, on a minimal ASGI app behind ``build_server``."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from atroposlib.http.security import (
    BrowserGuardMiddleware,
    is_loopback_host,
    json_value_problem,
    load_api_key,
)
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.testing.asgi import read_body, send_plain


def _secured(app, *, api_key, bind_host, allowed_origins=(), **options):
    """``app`` behind the shared stack with the given guard and auth options."""
    return build_server(
        app,
        ServerOptions(
            bind_host=bind_host,
            api_key=api_key,
            allowed_origins=tuple(allowed_origins),
            **options,
        ),
    )


async def _echo(scope, receive, send):
    await send_plain(send, b"ok:" + await read_body(receive))


def _client(app, host="127.0.0.1:8000"):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("localhost", True),
        ("localhost:9001", True),
        ("LOCALHOST.", True),
        ("app.localhost:80", True),
        ("127.0.0.1", True),
        ("127.8.9.10:8000", True),
        ("[::1]:8000", True),
        ("::1", True),
        ("", False),
        ("example.com", False),
        ("attacker.example:8000", False),
        ("10.0.0.5:8000", False),
        ("0.0.0.0", False),
        ("localhost.attacker.example", False),
    ],
)
def test_is_loopback_host(host, loopback):
    assert is_loopback_host(host) is loopback


async def test_plain_client_passes_and_json_body_passes():
    app = _secured(_echo, api_key=None, bind_host="127.0.0.1")
    async with _client(app) as client:
        r = await client.post("/scored_data", json={"a": 1})
        assert r.status_code == 200 and r.text == 'ok:{"a":1}'
        assert (await client.get("/status")).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_non_json_body_is_415(content_type):
    app = _secured(_echo, api_key=None, bind_host="127.0.0.1")
    headers = {"content-type": content_type} if content_type else {}
    async with _client(app) as client:
        r = await client.post("/register", content=b'{"x": 1}', headers=headers)
    assert r.status_code == 415
    assert "application/json" in r.json()["detail"]


async def test_json_variants_and_bodiless_posts_pass():
    app = _secured(_echo, api_key=None, bind_host="127.0.0.1")
    async with _client(app) as client:
        for ct in (
            "application/json; charset=utf-8",
            "application/vnd.api+json",
            "APPLICATION/JSON",
        ):
            r = await client.post("/x", content=b"{}", headers={"content-type": ct})
            assert r.status_code == 200, ct
        assert (await client.post("/disconnect")).status_code == 200


async def test_require_json_predicate_exempts_paths():
    app = _secured(
        _echo,
        api_key=None,
        bind_host="127.0.0.1",
        require_json=lambda p: not p.startswith("/upload"),
    )
    async with _client(app) as client:
        assert (
            await client.post("/upload", content=b"raw", headers={"content-type": "text/plain"})
        ).status_code == 200
        assert (
            await client.post("/other", content=b"raw", headers={"content-type": "text/plain"})
        ).status_code == 415


async def test_foreign_origin_is_403_own_and_allowed_origins_pass():
    app = _secured(
        _echo, api_key=None, bind_host="127.0.0.1", allowed_origins=["http://dash.local:3000/"]
    )
    async with _client(app) as client:
        r = await client.post("/x", json={}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "--cors-origin http://evil.example" in r.json()["detail"]
        r = await client.get("/status", headers={"origin": "null"})
        assert r.status_code == 403
        r = await client.post("/x", json={}, headers={"origin": "http://127.0.0.1:8000"})
        assert r.status_code == 200
        r = await client.post("/x", json={}, headers={"origin": "http://dash.local:3000"})
        assert r.status_code == 200
        r = await client.options(
            "/x", headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
        )
        assert r.status_code == 403


async def test_wildcard_origin_allows_any():
    app = _secured(_echo, api_key=None, bind_host="127.0.0.1", allowed_origins=["*"])
    async with _client(app) as client:
        assert (
            await client.post("/x", json={}, headers={"origin": "http://a.example"})
        ).status_code == 200


async def test_non_loopback_host_refused_when_bound_to_loopback():
    app = _secured(_echo, api_key=None, bind_host="127.0.0.1")
    async with _client(app, host="rebind.attacker.example:8000") as client:
        r = await client.get("/status")
    assert r.status_code == 403 and "DNS-rebinding" in r.json()["detail"]
    public = _secured(_echo, api_key=None, bind_host="0.0.0.0")
    async with _client(public, host="trainer-node-3:8000") as client:
        assert (await client.get("/status")).status_code == 200


async def test_health_is_open_to_every_check():
    app = _secured(_echo, api_key="k", bind_host="127.0.0.1")
    async with _client(app, host="whatever.example") as client:
        assert (
            await client.get("/health", headers={"origin": "http://evil.example"})
        ).status_code == 200


async def test_guarded_get_refused_from_browsers_only():
    app = _secured(
        _echo,
        api_key=None,
        bind_host="127.0.0.1",
        guarded_get_paths={"/reset_data": "use POST /reset_data"},
    )
    async with _client(app) as client:
        assert (await client.get("/reset_data")).status_code == 200
        r = await client.get(
            "/reset_data", headers={"sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"}
        )
        assert r.status_code == 403 and "POST /reset_data" in r.json()["detail"]
        r = await client.get("/reset_data", headers={"origin": "http://127.0.0.1:8000"})
        assert r.status_code == 403
        assert (
            await client.get("/reset_data", headers={"sec-fetch-site": "none"})
        ).status_code == 200


async def test_bearer_auth_guards_everything_but_open_paths():
    app = _secured(_echo, api_key="s3cret", bind_host="127.0.0.1")
    async with _client(app) as client:
        assert (await client.get("/")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        for path in ("/docs", "/openapi.json", "/batch"):
            r = await client.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert (
            await client.get("/batch", headers={"authorization": "Bearer wrong"})
        ).status_code == 401
        assert (
            await client.get("/batch", headers={"authorization": "Bearer s3cret"})
        ).status_code == 200


async def test_browser_guard_runs_before_auth():
    """A foreign page learns nothing about the key: it is refused before auth is considered."""
    app = _secured(_echo, api_key="s3cret", bind_host="127.0.0.1")
    async with _client(app) as client:
        r = await client.get(
            "/batch", headers={"authorization": "Bearer s3cret", "origin": "http://evil.example"}
        )
    assert r.status_code == 403


async def test_websocket_with_foreign_origin_is_closed():
    events = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        events.append(message)

    guard = BrowserGuardMiddleware(_echo)
    scope = {
        "type": "websocket",
        "path": "/queue/join",
        "headers": [(b"host", b"127.0.0.1:7860"), (b"origin", b"http://evil.example")],
        "scheme": "ws",
    }
    await guard(scope, receive, send)
    assert events == [{"type": "websocket.close", "code": 1008, "reason": events[0]["reason"]}]


def test_load_api_key_precedence_and_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATROPOS_API_KEY", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert load_api_key(None, None) == "from-env"
    assert load_api_key(None, key_file) == "from-file"
    with caplog.at_level(logging.WARNING):
        assert load_api_key("from-flag", key_file, component="run-api") == "from-flag"
    assert (
        "ps" in caplog.text and "ATROPOS_API_KEY" in caplog.text and "--api-key-file" in caplog.text
    )
    monkeypatch.delenv("ATROPOS_API_KEY")
    assert load_api_key(None, None) is None


def test_load_api_key_bad_file_names_it(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_api_key(None, empty)
    with pytest.raises(ValueError, match="missing-file"):
        load_api_key(None, tmp_path / "missing-file")


# json_value_problem: names the first value of parsed JSON that no UTF-8 or C JSON encoder
# takes (a lone surrogate, an integer beyond 64 bits), and costs one encode for clean data.


def test_clean_data_passes():
    assert json_value_problem({"a": [1, "é", {"b": None, "c": 1.5}], "d": 2**64 - 1}) is None
    assert json_value_problem(json.loads('"\\ud83d\\ude00"')) is None  # a valid pair


def test_lone_surrogates_are_named_by_path():
    data = json.loads('{"messages": [{"content": "ok"}, {"content": "a\\ud800"}]}')
    assert json_value_problem(data)[0] == "messages.1.content"
    assert json_value_problem(json.loads('"\\udfff"'))[0] == "body"
    key = json_value_problem(json.loads('{"x": {"\\ud800": 1}}'))
    assert key is not None and key[0].startswith("x.") and "key" in key[1]


def test_integers_beyond_64_bits_are_named_unless_ints_are_not_checked():
    data = {"logit_bias": {"7": 2**70}, "seed": -(2**63)}
    assert json_value_problem(data) == ("logit_bias.7", "is an integer outside the 64-bit range")
    assert json_value_problem(data, check_ints=False) is None
    assert json_value_problem([True, 2**64])[0] == "1"


def test_deep_nesting_does_not_recurse():
    deep: list = []
    node = deep
    for _ in range(20_000):
        node.append([])
        node = node[0]
    node.append("\ud800")
    path, _ = json_value_problem(deep)
    assert path.count(".") == 20_000
