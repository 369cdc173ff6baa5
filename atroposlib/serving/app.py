"""``atropos-serve-model``'s app: ``create_app`` wires the state, the shared server stack and
the routes (:mod:`.routes`, :mod:`.pause`).

Endpoints: ``GET /health``, ``GET /health_generate``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, the vLLM-style
``POST /generate`` used by ``VLLMServer`` and ``POST /update_weights``; ``POST /pause``,
``POST /resume`` and ``GET /weights_history`` (see :mod:`.pause`).

Security (docs/design.md, "Security model"): :func:`atroposlib.http.server.build_server`
puts the shared guard, CORS, bearer auth and body bounds in front of the routes, answering
in OpenAI's error format; templating and tokenising run in a thread pool, client chat templates in a sandboxed
process (:mod:`.chat_templates`), and weight updates only from ``--weights-root``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI

from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.openai_protocol import install_error_handlers
from atroposlib.http.server import ServerOptions, build_server
from atroposlib.serving import pause, routes
from atroposlib.serving.chat_templates import ClientTemplateRenderer
from atroposlib.serving.config import ServeModelConfig
from atroposlib.serving.loader import weight_roots
from atroposlib.serving.pause import PauseGate, PauseMiddleware
from atroposlib.serving.state import ServingState, build_state

__all__ = ["ServingState", "build_state", "create_app"]


def create_app(config: ServeModelConfig, state: ServingState | None = None) -> FastAPI:
    """Build the FastAPI app; the model is loaded at startup unless ``state`` is given."""
    gate = PauseGate()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st = state or await asyncio.to_thread(build_state, config)
        st.prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prep")
        st.renderer = (
            ClientTemplateRenderer(
                timeout=config.client_template_timeout,
                max_chars=config.client_template_max_chars,
            )
            if config.allow_client_chat_template
            else None
        )
        st.weight_roots = weight_roots(config)
        st.pause_gate = gate
        app.state.serving = st
        await st.engine.start()
        try:
            yield
        finally:
            await st.engine.stop()
            if st.renderer is not None:
                await st.renderer.close()
            st.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="atropos-serve-model", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(PauseMiddleware, gate=gate)  # innermost: after the stack below
    build_server(
        app,
        ServerOptions(
            bind_host=config.host,
            api_key=config.api_key,
            allowed_origins=tuple(config.cors_origin or ()),
            max_body_bytes=int(config.max_request_mb * 2**20),
            body_timeout=config.body_timeout,
            shape=openai_error_bytes,
        ),
    )
    app.include_router(routes.router)
    app.include_router(pause.router)
    return app
