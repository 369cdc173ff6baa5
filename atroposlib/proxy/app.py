"""``create_app``: the proxy's FastAPI app, wired: its state on ``app.state.proxy``, the
shared server stack in front (guard, CORS, bearer auth, body bounds) and the routes of
:mod:`atroposlib.proxy.routes`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI

from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.client_session import DEFAULT_MAX_ANSWER_BYTES
from atroposlib.http.openai_protocol import install_error_handlers
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.proxy.routes import router
from atroposlib.proxy.state import ProxyState, SessionLimits
from atroposlib.proxy.upstream import UpstreamPolicy

OPEN_PATHS = ("/", "/health")
"""Paths reachable without the API key (health probes)."""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    state: ProxyState = app.state.proxy
    if state.manager is not None:
        await state.manager.close()


def create_app(
    server_manager: ServerManager | None,
    tokenizer: Any,
    model_name: str = "unknown",
    *,
    tool_parser: str | None = None,
    api_key: str | None = None,
    bind_host: str | None = None,
    allow_upstream: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    max_request_mb: float = 64.0,
    limits: SessionLimits | None = None,
    max_upstream_mb: float | None = 64.0,
) -> FastAPI:
    """Build the proxy app over ``server_manager`` (None: configure it later with ``/setup``).

    ``tokenizer`` renders and encodes every session's prompts (None: each server's own, or
    the one its config names). ``model_name`` is what ``/health`` and ``/v1/models`` report.
    ``api_key`` turns on bearer auth (and enables ``/setup``); ``bind_host`` is the address
    the app will listen on (a loopback one turns on the ``Host`` check); ``allow_upstream``
    lists the non-loopback hosts ``/setup`` may use; ``allowed_origins`` the browser origins
    that may call the proxy; bodies above ``max_request_mb`` get a 413. ``limits`` bounds the
    sessions (:class:`SessionLimits`), ``max_upstream_mb`` each inference server answer
    (None: the HTTP client's default, ``ATROPOS_MAX_UPSTREAM_ANSWER_MB`` or 256).
    """
    app = FastAPI(title="atroposlib managed-server proxy", lifespan=_lifespan)
    app.state.proxy = ProxyState(
        server_manager,
        tokenizer,
        tool_parser,
        model_name,
        limits,
        api_key_set=bool(api_key),
        upstreams=UpstreamPolicy(allow_upstream),
        max_answer_bytes=(
            DEFAULT_MAX_ANSWER_BYTES if max_upstream_mb is None else int(max_upstream_mb * 2**20)
        ),
    )
    install_error_handlers(app)
    build_server(
        app,
        ServerOptions(
            bind_host=bind_host,
            api_key=api_key,
            allowed_origins=tuple(allowed_origins),
            open_paths=OPEN_PATHS,
            max_body_bytes=int(max_request_mb * 2**20),
            body_hints={"timeout": "ATROPOS_BODY_TIMEOUT"},
            shape=openai_error_bytes,
        ),
    )
    app.include_router(router)
    return app
