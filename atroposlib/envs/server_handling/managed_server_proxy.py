"""An HTTP proxy that exposes ``ManagedServer`` sessions as OpenAI-compatible APIs.

Agent frameworks that only speak the OpenAI API point their ``base_url`` at a session
(``http://proxy/{uuid}/v1``); the proxy records every token, mask and logprob, and the
environment reads the nodes back with ``GET /{uuid}/nodes``.

Endpoints: ``POST /sessions/create``, ``POST /{uuid}/v1/chat/completions``,
``POST /{uuid}/v1/chat/completions/render``, ``POST /{uuid}/v1/completions``,
``GET /{uuid}/v1/models``, ``GET /{uuid}/nodes``, ``POST /{uuid}/reset``, ``DELETE /{uuid}``,
``GET /sessions``, ``GET /servers``, ``POST /setup``, ``GET /v1/models``, ``GET /health``.
Errors use OpenAI's format ``{"error": {"message", "type", "param", "code"}}``; a client's
mistake (bad field, bad template input, an inference server's 4xx) is a 4xx, a failing
inference server a 502, no healthy server a 503.

Security (SPEC D18): with an API key (``--api-key``, ``--api-key-file`` or
``ATROPOS_API_KEY``) every path but ``/health`` needs ``Authorization: Bearer KEY``
(OpenAI clients send it as their ``api_key``). ``POST /setup`` points the proxy at new
inference servers, so it is refused unless a key is configured, and only to hosts that
``--allow-upstream`` allows (default: loopback). Without a key, browser pages still cannot
drive the proxy: foreign ``Origin`` 403, non-loopback ``Host`` 403 on a loopback bind,
bodies that are not JSON 415.

Run::

    python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json --port 9100

where ``servers.json`` is a list of ``APIServerConfig`` objects, or
``{"servers": [...], "tokenizer": "name-or-path", "tool_parser": "hermes"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Sequence, Union
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atroposlib.envs.server_handling._common import config_tokenizer_name, load_tokenizer
from atroposlib.envs.server_handling.errors import NoHealthyServerError
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, config_value
from atroposlib.envs.server_handling.server_manager import ServerManager, supports_tokens
from atroposlib.utils.http_security import (
    BearerAuthMiddleware,
    BrowserGuardMiddleware,
    is_loopback_host,
    json_value_problem,
    load_api_key,
)

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/", "/health")
"""Paths reachable without the API key (health probes)."""


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


class _SamplingFields(BaseModel):
    """OpenAI sampling fields the proxy checks up front, so a bad value is a 400 naming the
    field rather than an inference server's error; other fields pass through."""

    model_config = ConfigDict(extra="allow")
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)


class ChatMessage(BaseModel):
    """One chat message: a ``role`` is required (templates cannot render without one)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Any = None


class ChatRequest(_SamplingFields):
    """The parts of an OpenAI chat request the proxy checks; the rest passes through."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the client sent them (no fields added)."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    """The parts of an OpenAI completion request the proxy checks."""

    prompt: str = Field(..., min_length=1)


@dataclass
class Session:
    """One ManagedServer session."""

    id: str
    managed: ManagedServer
    server_url: str
    created: float = field(default_factory=time.time)
    requests: int = 0


_PASSTHROUGH_DROP = ("model", "stream", "stream_options", "user", "logprobs", "top_logprobs")


class UpstreamPolicy:
    """Which inference-server URLs ``POST /setup`` may point the proxy at.

    Entries are host names or addresses (``gpu-node-3``, ``10.0.0.5``), optionally with a port
    (``gpu-node-3:9001``) or a leading ``*.`` for subdomains (``*.cluster.local``); ``*``
    allows any host. Loopback hosts are always allowed. Only ``http``/``https`` URLs pass.
    """

    def __init__(self, allowed: Iterable[str] = ()):
        self.entries = [a.strip().lower() for a in allowed if a and a.strip()]

    def allows(self, url: str | None) -> bool:
        """Whether ``url`` is an allowed upstream."""
        try:
            parts = urlsplit(url or "")
            host = (parts.hostname or "").lower()
            port = parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host:
            return False
        if is_loopback_host(host):
            return True
        for entry in self.entries:
            if entry == "*":
                return True
            name, _, entry_port = (
                entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
            )
            if entry_port and str(port) != entry_port:
                continue
            if name == host or (name.startswith("*.") and host.endswith(name[1:])):
                return True
        return False


class ProxyState:
    """The proxy's state: the server pool, tokenizers and sessions."""

    def __init__(
        self,
        manager: ServerManager | None = None,
        tokenizer: Any = None,
        tool_parser: str | None = None,
        model_name: str = "unknown",
    ):
        self.manager = manager
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.model_name = model_name
        self.sessions: dict[str, Session] = {}
        self._tokenizers: dict[str, Any] = {}

    def require_manager(self) -> ServerManager:
        if self.manager is None:
            raise ProxyError(
                409, "the proxy has no servers yet; POST /setup first", "invalid_state"
            )
        return self.manager

    def model_names(self) -> list[str]:
        """The names ``/v1/models`` lists: ``model_name`` when given, else the servers'."""
        if self.model_name != "unknown" or self.manager is None:
            return [self.model_name]
        names = {str(config_value(s.config, "model_name")) for s in self.manager.servers}
        return sorted(names) or [self.model_name]

    def tokenizer_for(self, server: Any) -> Any:
        """The proxy's tokenizer, else the server's own, else the one its config names."""
        if self.tokenizer is not None:
            return self.tokenizer
        try:
            existing = getattr(server, "tokenizer", None)
        except ValueError:  # a backend whose lazy tokenizer failed to load
            existing = None
        if existing is not None:
            return existing
        name = config_tokenizer_name(getattr(server, "config", None))
        if name is None:
            raise ProxyError(
                409,
                "no tokenizer configured for this server: start the proxy with --tokenizer or "
                "POST /setup with 'tokenizer'",
                "invalid_state",
                "tokenizer",
            )
        if name not in self._tokenizers:
            self._tokenizers[name] = load_tokenizer(name)
        if self._tokenizers[name] is None:
            raise ProxyError(
                409,
                f"could not load tokenizer {name!r} named by the server's config: POST /setup "
                "with a loadable 'tokenizer'",
                "invalid_state",
                "tokenizer",
            )
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


def _upstream_status(exc: BaseException) -> tuple[int, str] | None:
    """The status and message of an inference server's HTTP error answer, if ``exc`` is one."""
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None) or getattr(response, "status_code", None)
    if not isinstance(status, int):
        return None
    try:
        text = response.text if response is not None else str(exc)
    except Exception:  # noqa: BLE001 - a streamed body cannot be read here; the summary will do
        text = str(exc)
    return status, text[:1000]


def _client_error_types() -> tuple[type[BaseException], ...]:
    import jinja2

    return (ValueError, KeyError, TypeError, jinja2.TemplateError)


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
) -> FastAPI:
    """Build the proxy app over ``server_manager`` (None: configure it later with ``/setup``).

    ``tokenizer`` renders and encodes every session's prompts (None: each server's own, or
    the one its config names). ``model_name`` is what ``/health`` and ``/v1/models`` report.
    ``api_key`` turns on bearer auth (and enables ``/setup``); ``bind_host`` is the address
    the app will listen on (a loopback one turns on the ``Host`` check); ``allow_upstream``
    lists the non-loopback hosts ``/setup`` may use; ``allowed_origins`` the browser origins
    that may call the proxy; bodies above ``max_request_mb`` get a 413.
    """
    state = ProxyState(server_manager, tokenizer, tool_parser, model_name)
    upstreams = UpstreamPolicy(allow_upstream)
    client_errors = _client_error_types()
    max_bytes = int(max_request_mb * 1024 * 1024)

    async def _read_body(request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds ``max_request_mb``."""
        too_big = ProxyError(
            413, f"request body exceeds the proxy's limit of {max_request_mb:g} MB", param="body"
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if state.manager is not None:
            await state.manager.close()

    app = FastAPI(title="atroposlib managed-server proxy", lifespan=lifespan)
    app.state.proxy = state
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key, open_paths=OPEN_PATHS)
    app.add_middleware(
        BrowserGuardMiddleware,
        allowed_origins=allowed_origins,
        check_host=bind_host is not None and is_loopback_host(bind_host),
        require_json=True,
        open_paths=("/health",),
    )

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
        return openai_error(exc.status, exc.message, exc.err_type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return openai_error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return openai_error(exc.status_code, str(exc.detail), err_type)

    async def _body(request: Request, model: type[BaseModel], allow_empty: bool = False) -> Any:
        raw = await _read_body(request)
        if not raw and allow_empty:
            data: Any = {}
        else:
            try:
                data = json.loads(raw)
            except RecursionError as e:
                raise ProxyError(400, "body is not valid JSON: nested too deeply") from e
            except ValueError as e:  # bad JSON or UTF-8, a number of thousands of digits
                raise ProxyError(400, f"body is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ProxyError(400, "body must be a JSON object")
        problem = json_value_problem(data)  # what the upstream client could not send on
        if problem is not None:
            raise ProxyError(400, f"'{problem[0]}' {problem[1]}", param=problem[0])
        try:
            return model.model_validate(data)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise ProxyError(400, message, param=param) from e

    async def _run(coro: Any) -> Any:
        """Await a ManagedServer call, mapping failures to the right status class."""
        try:
            return await coro
        except ProxyError:
            raise
        except NotImplementedError as e:
            raise ProxyError(501, str(e), "not_implemented") from e
        except NoHealthyServerError as e:
            raise ProxyError(503, str(e), "server_error") from e
        except client_errors as e:
            raise ProxyError(400, f"{type(e).__name__}: {e}") from e
        except Exception as e:  # the inference server failed: report it, never a bare 500
            upstream = _upstream_status(e)
            if upstream is not None and 400 <= upstream[0] < 500:
                status, text = upstream
                raise ProxyError(
                    status if status != 404 else 400, f"inference server refused: {text}"
                ) from e
            if isinstance(e, asyncio.TimeoutError):
                raise ProxyError(504, "inference server timed out", "server_error") from e
            logger.exception("proxy request failed")
            raise ProxyError(
                502, f"inference server error: {type(e).__name__}: {e}", "server_error"
            ) from e

    def _models_payload() -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {"id": n, "object": "model", "created": created, "owned_by": "atropos"}
                for n in state.model_names()
            ],
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": state.model_name, "sessions": len(state.sessions)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return _models_payload()

    @app.get("/servers")
    async def servers() -> dict[str, Any]:
        manager = state.manager
        out = []
        for s in manager.servers if manager else []:
            sem = getattr(s, "sem", None)
            out.append(
                {
                    "base_url": config_value(s.config, "base_url") or None,
                    "model_name": config_value(s.config, "model_name"),
                    "server_type": config_value(s.config, "server_type"),
                    "healthy": bool(getattr(s, "server_healthy", True)),
                    "free_slots": sem.free_slots() if hasattr(sem, "free_slots") else None,
                    "supports_tokens": supports_tokens(s),
                }
            )
        return {"servers": out}

    @app.post("/setup")
    async def setup(request: Request) -> dict[str, Any]:
        if not api_key:
            raise ProxyError(
                403,
                "POST /setup is disabled: it points the proxy at new inference servers, so it "
                "needs the proxy to run with an API key (--api-key-file, ATROPOS_API_KEY)",
                "permission_error",
            )
        body: SetupRequest = await _body(request, SetupRequest)
        for i, server in enumerate(body.servers):
            if not upstreams.allows(server.base_url):
                raise ProxyError(
                    403,
                    f"upstream {server.base_url!r} is not allowed: only loopback servers and "
                    "the hosts given with --allow-upstream may be set up",
                    "permission_error",
                    f"servers.{i}.base_url",
                )
        tok = None
        if body.tokenizer:
            tok = await asyncio.to_thread(load_tokenizer, body.tokenizer)
            if tok is None:
                raise ProxyError(
                    400, f"could not load tokenizer {body.tokenizer!r}", param="tokenizer"
                )
        if state.manager is not None:
            await state.manager.close()
        state.manager = ServerManager(body.servers)
        if tok is not None:
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
        # Loading a tokenizer named by a config can take a minute (hub retries): off the loop.
        tokenizer = await asyncio.to_thread(state.tokenizer_for, server)
        try:
            managed = ManagedServer(
                server,
                tokenizer,
                track_tree=body.track_tree,
                tool_parser=body.tool_parser or state.tool_parser,
                preserve_think_blocks=body.preserve_think_blocks,
            )
        except ValueError as e:
            raise ProxyError(400, str(e), param="tool_parser") from e
        sid = str(uuid.uuid4())
        session = Session(sid, managed, str(getattr(server, "name", "")))
        state.sessions[sid] = session
        return {
            "uuid": sid,
            "model_name": _session_model(session),
            "base_url": f"{str(request.base_url).rstrip('/')}/{sid}/v1",
            "created_at": session.created,
            "server": session.server_url,
        }

    def _session_model(session: Session) -> str:
        if state.model_name != "unknown":
            return state.model_name
        return str(config_value(getattr(session.managed.server, "config", None), "model_name"))

    @app.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        out = []
        for s in state.sessions.values():
            num_nodes = len(s.managed.current_nodes) + len(s.managed.sequences)
            out.append(
                {
                    "uuid": s.id,
                    "server": s.server_url,
                    "created_at": s.created,
                    "requests": s.requests,
                    "num_nodes": num_nodes,
                }
            )
        return {"sessions": out}

    @app.get("/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        state.session(session_id)
        return _models_payload()

    @app.post("/{session_id}/v1/chat/completions")
    async def chat(session_id: str, request: Request) -> JSONResponse:
        session = state.session(session_id)
        body: ChatRequest = await _body(request, ChatRequest)
        if body.model_extra and body.model_extra.get("stream"):
            raise ProxyError(400, "streaming is not supported by the proxy", param="stream")
        kwargs = {
            k: v
            for k, v in body.model_dump().items()
            if k not in _PASSTHROUGH_DROP and (v is not None or k in (body.model_extra or {}))
        }
        kwargs["messages"] = body.message_dicts()
        session.requests += 1
        completion = await _run(session.managed.chat_completion(**kwargs))
        if state.model_name != "unknown":
            completion.model = state.model_name
        return JSONResponse(completion.model_dump(exclude_none=True))

    @app.post("/{session_id}/v1/chat/completions/render")
    async def render(session_id: str, request: Request) -> dict[str, Any]:
        session = state.session(session_id)
        body: ChatRequest = await _body(request, ChatRequest)
        prompt = await _run(session.managed._arender(body.message_dicts(), body.tools))
        token_ids = await session.managed._aencode(prompt)
        return {
            "prompt": prompt,
            "input_ids": token_ids,
            "num_tokens": len(token_ids),
        }

    @app.post("/{session_id}/v1/completions")
    async def completions(session_id: str, request: Request) -> JSONResponse:
        session = state.session(session_id)
        body: CompletionRequest = await _body(request, CompletionRequest)
        kwargs = {
            k: v
            for k, v in body.model_dump().items()
            if k not in _PASSTHROUGH_DROP and (v is not None or k in (body.model_extra or {}))
        }
        session.requests += 1
        completion = await _run(session.managed.completion(**kwargs))
        if state.model_name != "unknown":
            completion.model = state.model_name
        return JSONResponse(completion.model_dump(exclude_none=True))

    @app.get("/{session_id}/nodes")
    async def nodes(session_id: str) -> dict[str, Any]:
        session = state.session(session_id)
        st = session.managed.get_state()
        if "nodes" in st:
            return {"uuid": session_id, "nodes": [n.model_dump() for n in st["nodes"]]}
        return {
            "uuid": session_id,
            "sequences": {k: v.model_dump() for k, v in st["sequences"].items()},
            "tree": st["tree"],
        }

    @app.post("/{session_id}/reset")
    async def reset(session_id: str) -> dict[str, Any]:
        state.session(session_id).managed.reset()
        return {"status": "reset", "uuid": session_id}

    @app.delete("/{session_id}")
    async def delete(session_id: str) -> dict[str, Any]:
        state.session(session_id)
        del state.sessions[session_id]
        return {"status": "deleted", "uuid": session_id}

    return app


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
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (loopback).")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer name or path for all sessions."
    )
    parser.add_argument("--tool-parser", default=None, help="Tool-call parser, e.g. hermes.")
    parser.add_argument(
        "--model-name",
        default=None,
        help="Model name reported by /health and /v1/models (default: the first server's).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on every path but /health (visible in ps: "
        "prefer ATROPOS_API_KEY or --api-key-file).",
    )
    parser.add_argument("--api-key-file", default=None, help="File holding the API key.")
    parser.add_argument(
        "--allow-upstream",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="Non-loopback host POST /setup may point the proxy at (repeatable; '*.domain' "
        "for subdomains, '*' for any). Loopback is always allowed.",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=64.0,
        help="Largest request body accepted (413 above it).",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="Browser origin allowed to call the proxy (repeatable).",
    )
    args = parser.parse_args(argv)
    import uvicorn

    try:
        api_key = load_api_key(args.api_key, args.api_key_file, component="managed-server proxy")
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback_host(args.host) and not api_key:
        logger.warning(
            "the managed-server proxy listens on %s without an API key: anyone who can reach "
            "it can read and delete sessions; set ATROPOS_API_KEY or --api-key-file",
            args.host,
        )
    manager, tokenizer, tool_parser = None, None, args.tool_parser
    model_name = args.model_name
    if args.config:
        servers, tok_name, cfg_parser = load_config(args.config)
        manager = ServerManager(servers)
        model_name = model_name or servers[0].model_name
        tok_name = args.tokenizer or tok_name
        tool_parser = tool_parser or cfg_parser
        if tok_name:
            tokenizer = load_tokenizer(tok_name)
            if tokenizer is None:
                parser.error(f"could not load tokenizer {tok_name!r}")
    elif args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    app = create_app(
        manager,
        tokenizer,
        model_name or "unknown",
        tool_parser=tool_parser,
        api_key=api_key,
        bind_host=args.host,
        allow_upstream=args.allow_upstream,
        allowed_origins=args.cors_origin,
        max_request_mb=args.max_request_mb,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
