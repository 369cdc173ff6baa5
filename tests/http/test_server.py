"""``build_server``: the same stack, guard -> CORS -> auth -> size limit, in front of run-api,
serve-model, the managed-server proxy and view-run, checked on each real app.

Each ordering shows in what a request gets refused with: a foreign page's preflight is
refused by the guard before CORS could answer it; an allowed page's preflight is answered by
CORS before auth could ask it for a key; a request without a key is refused before its body
is read, whatever its size.
"""

from __future__ import annotations

import httpx
import pytest
from starlette.middleware.cors import CORSMiddleware

from atroposlib.http.body import BodyLimitMiddleware
from atroposlib.http.security import BearerAuthMiddleware, BrowserGuardMiddleware
from atroposlib.http.server import ServerOptions, build_server, server_middleware

KEY = "s3cret"
ALLOWED = "http://dash.local:3000"
FOREIGN = "http://evil.example"
LIMIT_MB = 1
BIG = b"{" + b" " * (LIMIT_MB * 2**20 + 10) + b"}"
"""A body over every server's limit below."""


def _run_api():
    from atroposlib.api.server import create_app
    from atroposlib.api.settings import APISettings

    settings = APISettings(api_key=KEY, cors_origins=[ALLOWED], max_request_mb=LIMIT_MB)
    return create_app(settings), "/scored_data", "detail"


def _serve_model():
    from atroposlib.serving.app import create_app
    from atroposlib.serving.config import ServeModelConfig

    config = ServeModelConfig(
        model="no-model-loaded", api_key=KEY, cors_origin=[ALLOWED], max_request_mb=LIMIT_MB
    )
    return create_app(config), "/v1/completions", "error"


def _proxy():
    from atroposlib.envs.server_handling.managed_server_proxy import create_app

    app = create_app(
        None,
        None,
        api_key=KEY,
        bind_host="127.0.0.1",
        allowed_origins=[ALLOWED],
        max_request_mb=LIMIT_MB,
    )
    return app, "/sessions/create", "error"


def _view_run():
    gradio = pytest.importorskip("gradio")
    from gradio.routes import App
    from starlette.middleware import Middleware

    from atroposlib.frontend.viewer_app import NoUploads, viewer_middleware

    with gradio.Blocks() as demo:
        gradio.Markdown("viewer")
    stack = [*viewer_middleware("127.0.0.1", False, [ALLOWED]), Middleware(NoUploads)]
    return App.create_app(demo, app_kwargs={"middleware": stack}), "/gradio_api/run/predict", None


SERVERS = {"run-api": _run_api, "serve-model": _serve_model, "proxy": _proxy}


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000"
    )


def _preflight(origin: str) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": "POST"}


@pytest.mark.parametrize("server", sorted(SERVERS))
async def test_guard_then_cors_then_auth_then_size_limit(server):
    app, path, error_key = SERVERS[server]()
    async with _client(app) as client:
        # guard before CORS: a foreign page's preflight never reaches CORS
        foreign = await client.options(path, headers=_preflight(FOREIGN))
        assert foreign.status_code == 403, foreign.text
        assert error_key in foreign.json()
        # CORS before auth: an allowed page's preflight (no key, as browsers send it) is answered
        allowed = await client.options(path, headers=_preflight(ALLOWED))
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == ALLOWED
        # guard before auth: a foreign origin with no key is refused as foreign
        assert (await client.post(path, json={}, headers={"origin": FOREIGN})).status_code == 403
        # auth before the size limit: no key and a body over the limit is a 401, not a 413
        anonymous = await client.post(
            path, content=BIG, headers={"content-type": "application/json"}
        )
        assert anonymous.status_code == 401
        assert error_key in anonymous.json()
        # with the key, the body reaches the size limit
        keyed = await client.post(
            path,
            content=BIG,
            headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        )
        assert keyed.status_code == 413
        assert error_key in keyed.json()


async def test_view_run_has_the_same_stack_without_a_key():
    """Gradio answers preflights itself, ahead of any middleware it is given, and grants
    nothing to a foreign origin; every other request meets the shared stack."""
    from atroposlib.frontend.viewer_app import MAX_BODY_BYTES

    app, path, _ = _view_run()
    async with _client(app) as client:
        foreign_preflight = await client.options(path, headers=_preflight(FOREIGN))
        assert foreign_preflight.headers.get("access-control-allow-origin") != FOREIGN
        # guard before the size limit: a foreign page's oversized post is refused as foreign
        foreign_big = await client.post(path, content=BIG, headers={"origin": FOREIGN})
        assert foreign_big.status_code == 403 and "Origin" in foreign_big.json()["detail"]
        # an allowed page passes the guard and CORS, then meets the size limit
        huge = b" " * (MAX_BODY_BYTES + 1)
        allowed_big = await client.post(path, content=huge, headers={"origin": ALLOWED})
        assert allowed_big.status_code == 413
        assert allowed_big.headers["access-control-allow-origin"] == ALLOWED
        assert (await client.get("/", headers={"host": "rebind.example"})).status_code == 403
        # a local client's request passes the whole stack and reaches Gradio's router
        plain = await client.post("/no-such-route", json={"data": []})
        assert plain.status_code == 404, plain.text


def test_server_middleware_lists_the_layers_in_one_order():
    options = ServerOptions(
        bind_host="127.0.0.1", api_key=KEY, allowed_origins=(ALLOWED,), max_body_bytes=10
    )
    kinds = [entry.cls for entry in server_middleware(options)]
    assert kinds == [
        BrowserGuardMiddleware,
        CORSMiddleware,
        BearerAuthMiddleware,
        BodyLimitMiddleware,
    ]
    bare = [entry.cls for entry in server_middleware(ServerOptions(bind_host="127.0.0.1"))]
    assert bare == [BrowserGuardMiddleware]


def test_build_server_refuses_an_app_that_already_serves():
    from fastapi import FastAPI

    app = FastAPI()
    app.middleware_stack = app.build_middleware_stack()
    with pytest.raises(RuntimeError, match="already started"):
        build_server(app, ServerOptions(bind_host="127.0.0.1"))
