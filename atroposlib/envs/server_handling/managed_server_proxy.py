"""An HTTP proxy that exposes ``ManagedServer`` sessions as OpenAI-compatible APIs.

Agent frameworks that only speak the OpenAI API point their ``base_url`` at a session
(``http://proxy/{uuid}/v1``); the proxy records every token, mask and logprob, and the
environment reads the nodes back with ``GET /{uuid}/nodes``.

Endpoints: ``POST /sessions/create``, ``POST /{uuid}/v1/chat/completions``,
``POST /{uuid}/v1/chat/completions/render``, ``POST /{uuid}/v1/completions``,
``GET /{uuid}/nodes``, ``POST /{uuid}/reset``, ``DELETE /{uuid}``, ``GET /sessions``, ``GET /servers``,
``POST /setup``, ``GET /v1/models``, ``GET /health``. Errors use OpenAI's format
``{"error": {"message", "type", "param", "code"}}``.

Run::

    python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json --port 9100

where ``servers.json`` is a list of ``APIServerConfig`` objects, or
``{"servers": [...], "tokenizer": "name-or-path", "tool_parser": "hermes"}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atroposlib.envs.server_handling._common import load_tokenizer
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager, supports_tokens

logger = logging.getLogger(__name__)


class ProxyError(Exception):
    """An error answered to the client in OpenAI's error format."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param


def openai_error(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    """A JSON response in OpenAI's error format."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": err_type, "param": param, "code": status}},
    )


class SetupRequest(BaseModel):
    """Body of ``POST /setup``: the servers (and tokenizer) the proxy should use."""

    servers: list[APIServerConfig] = Field(..., min_length=1, description="Inference servers.")
    tokenizer: str | None = Field(None, description="Tokenizer name or path for every session.")
    tool_parser: str | None = Field(None, description="Tool-call parser, e.g. 'hermes'.")


class CreateSessionRequest(BaseModel):
    """Body of ``POST /sessions/create`` (all optional)."""

    model_config = ConfigDict(extra="forbid")
    base_url: str | None = Field(None, description="Pin the session to this server.")
    tool_parser: str | None = Field(None, description="Override the proxy's tool parser.")
    preserve_think_blocks: bool = Field(False, description="Do not shield <think> blocks.")
    track_tree: bool = Field(False, description="Keep every node keyed by its text (tree mode).")


class ChatRequest(BaseModel):
    """The parts of an OpenAI chat request the proxy checks; the rest passes through."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    n: int = Field(1, ge=1, le=128)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(BaseModel):
    """The parts of an OpenAI completion request the proxy checks."""

    model_config = ConfigDict(extra="allow")
    prompt: str = Field(..., min_length=1)
    n: int = Field(1, ge=1, le=128)


@dataclass
class Session:
    """One ManagedServer session."""

    id: str
    managed: ManagedServer
    server_url: str
    created: float = field(default_factory=time.time)
    requests: int = 0


_PASSTHROUGH_DROP = ("model", "stream", "stream_options", "user", "logprobs", "top_logprobs")


class ProxyState:
    """The proxy's state: the server pool, tokenizers and sessions."""

    def __init__(
        self,
        manager: ServerManager | None = None,
        tokenizer: Any = None,
        tool_parser: str | None = None,
    ):
        self.manager = manager
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.sessions: dict[str, Session] = {}
        self._tokenizers: dict[str, Any] = {}

    def require_manager(self) -> ServerManager:
        if self.manager is None:
            raise ProxyError(
                409, "the proxy has no servers yet; POST /setup first", "invalid_state"
            )
        return self.manager

    def tokenizer_for(self, server: Any) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        existing = getattr(server, "tokenizer", None)
        if existing is not None:
            return existing
        name = server.config.tokenizer_name
        name = server.config.model_name if name == "none" else name
        if name not in self._tokenizers:
            self._tokenizers[name] = load_tokenizer(name)
        if self._tokenizers[name] is None:
            raise ProxyError(500, f"could not load tokenizer {name!r}", "server_error")
        return self._tokenizers[name]

    def session(self, session_id: str) -> Session:
        if session_id not in self.sessions:
            raise ProxyError(404, f"unknown session {session_id!r}", "not_found_error", "uuid")
        return self.sessions[session_id]


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, first = [], None
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        first = first or loc
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts), first


def create_app(
    server_manager: ServerManager | None = None,
    tokenizer: Any = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """Build the proxy app over ``server_manager`` (or configure it later with ``/setup``)."""
    state = ProxyState(server_manager, tokenizer, tool_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if state.manager is not None:
            await state.manager.close()

    app = FastAPI(title="atroposlib managed-server proxy", lifespan=lifespan)
    app.state.proxy = state

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.err_type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return openai_error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return openai_error(exc.status_code, str(exc.detail), "invalid_request_error")

    async def _body(request: Request, model: type[BaseModel], allow_empty: bool = False) -> Any:
        raw = await request.body()
        if not raw and allow_empty:
            data: Any = {}
        else:
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ProxyError(400, f"body is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ProxyError(400, "body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise ProxyError(400, message, param=param) from e

    async def _run(coro: Any) -> Any:
        try:
            return await coro
        except ProxyError:
            raise
        except (ValueError, KeyError) as e:
            raise ProxyError(400, str(e)) from e
        except NotImplementedError as e:
            raise ProxyError(501, str(e), "not_implemented") from e
        except Exception as e:  # upstream failure: report it, never a bare 500
            logger.exception("proxy request failed")
            raise ProxyError(
                502, f"inference server error: {type(e).__name__}: {e}", "server_error"
            ) from e

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = sorted(
            {s.config.model_name for s in (state.manager.servers if state.manager else [])}
        )
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "owned_by": "atropos"} for n in names],
        }

    @app.get("/servers")
    async def servers() -> dict[str, Any]:
        manager = state.manager
        return {
            "servers": [
                {
                    "base_url": getattr(s.config, "base_url", None),
                    "model_name": s.config.model_name,
                    "server_type": s.config.server_type,
                    "healthy": s.server_healthy,
                    "free_slots": s.sem.free_slots(),
                    "supports_tokens": supports_tokens(s),
                }
                for s in (manager.servers if manager else [])
            ]
        }

    @app.post("/setup")
    async def setup(request: Request) -> dict[str, Any]:
        body: SetupRequest = await _body(request, SetupRequest)
        if state.manager is not None:
            await state.manager.close()
        state.manager = ServerManager(body.servers)
        if body.tokenizer:
            tok = load_tokenizer(body.tokenizer)
            if tok is None:
                raise ProxyError(
                    400, f"could not load tokenizer {body.tokenizer!r}", param="tokenizer"
                )
            state.tokenizer = tok
        if body.tool_parser is not None:
            state.tool_parser = body.tool_parser
        return {"status": "ok", "servers": len(body.servers)}

    @app.post("/sessions/create")
    async def create_session(request: Request) -> dict[str, Any]:
        body: CreateSessionRequest = await _body(request, CreateSessionRequest, allow_empty=True)
        manager = state.require_manager()
        try:
            server = manager._server_for_managed(body.base_url)
        except ValueError as e:
            raise ProxyError(404, str(e), "not_found_error", "base_url") from e
        if not supports_tokens(server):
            raise ProxyError(
                400,
                f"server {server.name} cannot return tokens/logprobs (use vllm or sglang)",
                param="base_url",
            )
        try:
            managed = ManagedServer(
                server,
                state.tokenizer_for(server),
                track_tree=body.track_tree,
                tool_parser=body.tool_parser or state.tool_parser,
                preserve_think_blocks=body.preserve_think_blocks,
            )
        except ValueError as e:
            raise ProxyError(400, str(e), param="tool_parser") from e
        sid = uuid.uuid4().hex
        state.sessions[sid] = Session(sid, managed, server.name)
        return {"uuid": sid, "base_url": f"/{sid}/v1", "server": server.name}

    @app.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        return {
            "sessions": [
                {
                    "uuid": s.id,
                    "server": s.server_url,
                    "created": s.created,
                    "requests": s.requests,
                    "nodes": len(s.managed.current_nodes) + len(s.managed.sequences),
                }
                for s in state.sessions.values()
            ]
        }

    @app.post("/{session_id}/v1/chat/completions")
    async def chat(session_id: str, request: Request) -> JSONResponse:
        session = state.session(session_id)
        body: ChatRequest = await _body(request, ChatRequest)
        if body.model_extra and body.model_extra.get("stream"):
            raise ProxyError(400, "streaming is not supported by the proxy", param="stream")
        kwargs = {k: v for k, v in body.model_dump().items() if k not in _PASSTHROUGH_DROP}
        if kwargs.get("tools") is None:
            kwargs.pop("tools", None)
        session.requests += 1
        completion = await _run(session.managed.chat_completion(**kwargs))
        return JSONResponse(completion.model_dump(exclude_none=True))

    @app.post("/{session_id}/v1/chat/completions/render")
    async def render(session_id: str, request: Request) -> dict[str, Any]:
        session = state.session(session_id)
        body: ChatRequest = await _body(request, ChatRequest)
        prompt = await _run(_render(session.managed, body.messages, body.tools))
        return {"prompt": prompt, "input_ids": session.managed._encode(prompt)}

    @app.post("/{session_id}/v1/completions")
    async def completions(session_id: str, request: Request) -> JSONResponse:
        session = state.session(session_id)
        body: CompletionRequest = await _body(request, CompletionRequest)
        kwargs = {k: v for k, v in body.model_dump().items() if k not in _PASSTHROUGH_DROP}
        session.requests += 1
        completion = await _run(session.managed.completion(**kwargs))
        return JSONResponse(completion.model_dump(exclude_none=True))

    @app.get("/{session_id}/nodes")
    async def nodes(session_id: str) -> dict[str, Any]:
        session = state.session(session_id)
        st = session.managed.get_state()
        if "nodes" in st:
            return {"nodes": [n.model_dump() for n in st["nodes"]]}
        return {
            "sequences": {k: v.model_dump() for k, v in st["sequences"].items()},
            "tree": st["tree"],
        }

    @app.post("/{session_id}/reset")
    async def reset(session_id: str) -> dict[str, Any]:
        state.session(session_id).managed.reset()
        return {"reset": session_id}

    @app.delete("/{session_id}")
    async def delete(session_id: str) -> dict[str, Any]:
        state.session(session_id)
        del state.sessions[session_id]
        return {"deleted": session_id}

    return app


async def _render(managed: ManagedServer, messages: list[dict[str, Any]], tools: Any) -> str:
    return managed._convert_messages_to_prompt(messages, tools)


def load_config(path: str) -> tuple[list[APIServerConfig], str | None, str | None]:
    """Read a servers file: a list of server configs, or an object with ``servers``."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        data = {"servers": data}
    setup = SetupRequest.model_validate(data)
    return setup.servers, setup.tokenizer, setup.tool_parser


def main(argv: list[str] | None = None) -> None:
    """``python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json``."""
    parser = argparse.ArgumentParser(
        description="OpenAI-compatible proxy over ManagedServer sessions."
    )
    parser.add_argument(
        "--config", help="JSON file with the server configs (or POST /setup later)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer name or path for all sessions."
    )
    parser.add_argument("--tool-parser", default=None, help="Tool-call parser, e.g. hermes.")
    args = parser.parse_args(argv)
    import uvicorn

    manager, tokenizer, tool_parser = None, None, args.tool_parser
    if args.config:
        servers, tok_name, cfg_parser = load_config(args.config)
        manager = ServerManager(servers)
        tok_name = args.tokenizer or tok_name
        tool_parser = tool_parser or cfg_parser
        if tok_name:
            tokenizer = load_tokenizer(tok_name)
            if tokenizer is None:
                parser.error(f"could not load tokenizer {tok_name!r}")
    elif args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    uvicorn.run(
        create_app(manager, tokenizer, tool_parser),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
