"""An HTTP proxy that exposes ``ManagedServer`` sessions as OpenAI-compatible APIs.

Agent frameworks that only speak the OpenAI API point their ``base_url`` at a session
(``http://proxy/{uuid}/v1``); the proxy records every token, mask and logprob, and the
environment reads the nodes back with ``GET /{uuid}/nodes``.

Endpoints: ``POST /sessions/create``, ``POST /{uuid}/v1/chat/completions``,
``POST /{uuid}/v1/chat/completions/render``, ``POST /{uuid}/v1/completions``,
``GET /{uuid}/v1/models``, ``GET /{uuid}/nodes``, ``POST /{uuid}/reset``, ``DELETE /{uuid}``,
``GET /sessions``, ``GET /servers``, ``POST /setup``, ``GET /v1/models``, ``GET /health``.
With ``"stream": true`` the chat and text completion routes answer server-sent events in
OpenAI's chunk format (``include_usage`` honoured), after the same generation, bounds and
node recording as a plain request; an error is still a JSON error with its status.
A session keeps only the nodes of answers it delivered: a client that disconnects cancels
its generation (the upstream request is dropped and its slot freed), and a request whose
client left before the answer's end has its nodes taken back (``_proxy_delivery``;
counted in ``/health`` as ``requests_abandoned`` and ``nodes_withdrawn``).
Errors use OpenAI's format ``{"error": {"message", "type", "param", "code"}}``. Status
classes: the client's mistake (a bad field, bad template input) is a 400 naming the field;
the inference server's fault (its 5xx, an answer that is not what the protocol says, too
large, a redirect, output that cannot be encoded) is a 502 of type ``upstream_error``; an
inference server's own 4xx keeps its status with type ``upstream_error``, except 401/403/407
and 404, which say the proxy's configuration is wrong (502), so they never look like the
proxy's own authentication errors; no healthy server is a 503, a timeout a 504.

Bounds (``SessionLimits``): at most ``--max-sessions`` sessions (429 when full), evicted
after ``--session-idle-s`` unused (counted in ``/health``), ``--max-session-nodes`` nodes
per session (429), ``--max-stored-tokens`` tokens over all sessions (503), inference server
answers of at most ``--max-upstream-mb`` (502 above). ``extra_body`` is merged into the
request before it is checked, so the bounds hold for what is sent upstream.

Security (docs/design.md, "Security model"): with an API key (``--api-key``, ``--api-key-file`` or
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
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, List, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atroposlib.envs.server_handling._common import load_tokenizer
from atroposlib.envs.server_handling._proxy_delivery import (
    STORED,
    ClientGone,
    ClientWatch,
    RecordingManagedServer,
    Stored,
)
from atroposlib.envs.server_handling._proxy_state import (
    SessionLimits,
    SessionState,
    SessionStore,
    UpstreamPolicy,
)
from atroposlib.envs.server_handling._proxy_stream import (
    chat_chunks,
    completion_chunks,
    sse_answer,
    stream_options,
)
from atroposlib.envs.server_handling._proxy_upstream import (
    UPSTREAM_REACHED,
    UPSTREAM_USAGE,
    UpstreamTap,
    json_answer,
    proxy_error_for,
    strict_tool_arguments,
)
from atroposlib.envs.server_handling.managed_server import resolve_tokenizer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, config_value
from atroposlib.envs.server_handling.server_manager import ServerManager, supports_tokens
from atroposlib.http.answers import openai_error_bytes
from atroposlib.http.client import DEFAULT_MAX_ANSWER_BYTES
from atroposlib.http.openai_protocol import (
    ChatMessage,
    OpenAIError,
    PassThroughChatRequest,
    PassThroughCompletionRequest,
    error_response,
    install_error_handlers,
    model_list,
    passthrough,
    validation_error,
)
from atroposlib.http.security import is_loopback_host, json_value_problem, load_api_key
from atroposlib.http.server import ServerOptions, build_server

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/", "/health")
"""Paths reachable without the API key (health probes)."""

DEFAULT_TOOL_PARSER = "hermes"
"""The tool-call parser of a session that names none (the proxy's ``--tool-parser`` wins)."""

__all__ = [
    "ChatCompletionProxyRequest",
    "ChatMessage",
    "RenderResponse",
    "SessionCreateRequest",
    "SessionCreateResponse",
    "SessionLimits",
    "SessionState",
    "UpstreamPolicy",
    "create_app",
    "main",
    "openai_error",
]


def openai_error(
    status_code: int,
    message: str,
    error_type: str = "invalid_request_error",
    param: str | None = None,
) -> JSONResponse:
    """A JSON response in OpenAI's error format:
    ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the status."""
    return error_response(OpenAIError(message, param=param, status=status_code, type=error_type))


class SetupRequest(BaseModel):
    """Body of ``POST /setup``: the servers (and tokenizer) the proxy should use."""

    servers: list[APIServerConfig] = Field(..., min_length=1, description="Inference servers.")
    tokenizer: str | None = Field(None, description="Tokenizer name or path for every session.")
    tool_parser: str | None = Field(None, description="Tool-call parser, e.g. 'hermes'.")


class SessionCreateRequest(BaseModel):
    """Body of ``POST /sessions/create`` (all optional).

    ``tool_parser`` defaults to "hermes" (or the proxy's ``--tool-parser``); null turns
    tool-call parsing off for the session.
    """

    model_config = ConfigDict(extra="forbid")
    tool_parser: str | None = Field(
        DEFAULT_TOOL_PARSER, description="Tool-call parser of the session (null: none)."
    )
    track_tree: bool = Field(False, description="Keep every node keyed by its text (tree mode).")
    base_url: str | None = Field(None, description="Pin the session to this server.")
    preserve_think_blocks: bool = Field(False, description="Do not shield <think> blocks.")


CreateSessionRequest = SessionCreateRequest
"""Older name of :class:`SessionCreateRequest`."""


class SessionCreateResponse(BaseModel):
    """Answer of ``POST /sessions/create``: ``base_url`` is the session's OpenAI base URL
    (give it to any OpenAI client), ``server`` the inference server it is pinned to."""

    uuid: str
    model_name: str
    tool_parser: str | None
    base_url: str | None = None
    created_at: float
    server: str | None = None


class RenderResponse(BaseModel):
    """Answer of ``POST /{uuid}/v1/chat/completions/render``: the prompt the session would
    send and its token ids."""

    prompt_text: str
    token_ids: List[int]
    num_tokens: int


class ChatCompletionProxyRequest(PassThroughChatRequest):
    """An OpenAI chat request to a session: the fields the proxy checks (with the
    original's defaults: ``max_tokens`` 1024, ``temperature`` 1.0); others pass through."""

    max_tokens: int | None = Field(1024, ge=1)
    temperature: float | None = Field(1.0, ge=0, le=100)

    def upstream_kwargs(self) -> dict[str, Any]:
        """The sampling fields to send: ``max_tokens`` is left out when the client gave only
        ``max_completion_tokens`` (its default must not override the client's bound)."""
        kwargs = passthrough(self)
        if "max_tokens" not in self.model_fields_set and self.max_completion_tokens is not None:
            kwargs.pop("max_tokens", None)
        return kwargs


ChatRequest = ChatCompletionProxyRequest
"""Older name of :class:`ChatCompletionProxyRequest`."""


class CompletionRequest(PassThroughCompletionRequest):
    """An OpenAI completion request to a session: one prompt text."""

    prompt: str = Field(..., min_length=1)


class ProxyState:
    """The proxy's state: the server pool, tokenizers and sessions."""

    def __init__(
        self,
        manager: ServerManager | None = None,
        tokenizer: Any = None,
        tool_parser: str | None = None,
        model_name: str = "unknown",
        limits: SessionLimits | None = None,
    ):
        self.manager = manager
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.model_name = model_name
        self.sessions = SessionStore(limits)
        self._tokenizers: dict[str, Any] = {}

    def require_manager(self) -> ServerManager:
        if self.manager is None:
            raise OpenAIError(
                "the proxy has no servers yet; POST /setup first", status=409, type="invalid_state"
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
        return resolve_tokenizer(
            server,
            self._load_tokenizer,
            lambda: OpenAIError(
                "no tokenizer configured for this server: start the proxy with --tokenizer or "
                "POST /setup with 'tokenizer'",
                param="tokenizer",
                status=409,
                type="invalid_state",
            ),
            lambda name: OpenAIError(
                f"could not load tokenizer {name!r} named by the server's config: POST /setup "
                "with a loadable 'tokenizer'",
                param="tokenizer",
                status=409,
                type="invalid_state",
            ),
        )

    def _load_tokenizer(self, name: str) -> Any:
        """``load_tokenizer(name)``, once per name (a failure, None, is remembered too)."""
        if name not in self._tokenizers:
            self._tokenizers[name] = load_tokenizer(name)
        return self._tokenizers[name]

    def session(self, session_id: str) -> SessionState:
        """The session (404 when unknown, deleted or evicted)."""
        return self.sessions.get(session_id)


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
    state = ProxyState(server_manager, tokenizer, tool_parser, model_name, limits)
    upstreams = UpstreamPolicy(allow_upstream)
    max_answer = (
        DEFAULT_MAX_ANSWER_BYTES if max_upstream_mb is None else int(max_upstream_mb * 1024**2)
    )

    def _bound_transports(manager: ServerManager | None, check_peers: bool) -> None:
        """Bound the answers the manager's servers read; with ``check_peers`` (servers set up
        through ``/setup``) connect only to addresses the upstream policy allows."""
        for server in manager.servers if manager is not None else ():
            make = getattr(server, "transport", None)
            if not callable(make):
                continue
            transport = make()
            transport.max_answer_bytes = max_answer
            if check_peers:
                transport.peer_check = upstreams.peer_allowed

    _bound_transports(server_manager, check_peers=False)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if state.manager is not None:
            await state.manager.close()

    app = FastAPI(title="atroposlib managed-server proxy", lifespan=lifespan)
    app.state.proxy = state
    install_error_handlers(app)
    build_server(
        app,
        ServerOptions(
            bind_host=bind_host,
            api_key=api_key,
            allowed_origins=tuple(allowed_origins),
            open_paths=OPEN_PATHS,
            max_body_bytes=int(max_request_mb * 1024 * 1024),
            body_hints={"timeout": "ATROPOS_BODY_TIMEOUT"},
            shape=openai_error_bytes,
        ),
    )

    async def _body(
        request: Request,
        model: type[BaseModel],
        allow_empty: bool = False,
        merge_extra_body: bool = False,
    ) -> Any:
        raw = await request.body()  # bounded in size and time by the body layer
        request.state.body_size = len(raw)  # bounds a prompt's tokens (see SessionStore.admit)
        if not raw and allow_empty:
            data: Any = {}
        else:
            try:
                data = json.loads(raw)
            except RecursionError as e:
                raise OpenAIError("body is not valid JSON: nested too deeply", status=400) from e
            except ValueError as e:  # bad JSON or UTF-8, a number of thousands of digits
                raise OpenAIError(f"body is not valid JSON: {e}", status=400) from e
        if not isinstance(data, dict):
            raise OpenAIError("body must be a JSON object", status=400)
        if merge_extra_body and "extra_body" in data:
            # The backends merge extra_body over the request when they send it: merge it
            # first, so every bound is checked on what the inference server receives.
            extra = data.pop("extra_body")
            if extra is not None and not isinstance(extra, dict):
                raise OpenAIError(
                    "extra_body must be a JSON object", param="extra_body", status=400
                )
            data.update(extra or {})
        problem = json_value_problem(data)  # what the upstream client could not send on
        if problem is not None:
            raise OpenAIError(f"'{problem[0]}' {problem[1]}", param=problem[0], status=400)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from e

    async def _run(coro: Any) -> Any:
        """Await a ManagedServer call, its failure mapped to its status class (see
        :func:`proxy_error_for`): before the inference server was called the fault is the
        client's input, from then on the inference server's."""
        reached = [False]
        token = UPSTREAM_REACHED.set(reached)
        try:
            return await coro
        except OpenAIError:
            raise
        except Exception as e:  # never a bare 500
            raise proxy_error_for(e, reached[0]) from e
        finally:
            UPSTREAM_REACHED.reset(token)

    def _models_payload() -> dict[str, Any]:
        return model_list(state.model_names(), int(time.time()), "atropos")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        servers = list(state.manager.servers) if state.manager is not None else []
        state.sessions.expire()
        return {
            "status": "ok",
            "model": state.model_name,
            "sessions": len(state.sessions),
            "servers": len(servers),
            "healthy_servers": sum(bool(getattr(s, "server_healthy", True)) for s in servers),
            **state.sessions.counters(),
        }

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
            raise OpenAIError(
                "POST /setup is disabled: it points the proxy at new inference servers, so it "
                "needs the proxy to run with an API key (--api-key-file, ATROPOS_API_KEY)",
                status=403,
                type="permission_error",
            )
        body: SetupRequest = await _body(request, SetupRequest)
        for i, server in enumerate(body.servers):
            # Resolving a name blocks (and may take seconds): off the event loop.
            problem = await asyncio.to_thread(upstreams.setup_problem, server.base_url)
            if problem is not None:
                raise OpenAIError(
                    f"upstream {server.base_url!r} is not allowed: {problem}",
                    param=f"servers.{i}.base_url",
                    status=403,
                    type="permission_error",
                )
        tok = None
        if body.tokenizer:
            tok = await asyncio.to_thread(load_tokenizer, body.tokenizer)
            if tok is None:
                raise OpenAIError(
                    f"could not load tokenizer {body.tokenizer!r}", param="tokenizer", status=400
                )
        if state.manager is not None:
            await state.manager.close()
        state.manager = ServerManager(body.servers)
        _bound_transports(state.manager, check_peers=True)
        if tok is not None:
            state.tokenizer = tok
        if body.tool_parser is not None:
            state.tool_parser = body.tool_parser
        return {"status": "ok", "servers": len(body.servers), "model_name": state.model_names()[0]}

    @app.post("/sessions/create")
    async def create_session(request: Request) -> dict[str, Any]:
        body: SessionCreateRequest = await _body(request, SessionCreateRequest, allow_empty=True)
        manager = state.require_manager()
        state.sessions.check_room()  # 429 before loading a tokenizer for nothing
        try:
            server = manager._server_for_managed(body.base_url)
        except ValueError as e:
            raise OpenAIError(str(e), param="base_url", status=404, type="not_found_error") from e
        if not supports_tokens(server):
            raise OpenAIError(
                f"server {server.name} cannot return tokens/logprobs (use vllm or sglang)",
                param="base_url",
                status=400,
            )
        # Loading a tokenizer named by a config can take a minute (hub retries): off the loop.
        tokenizer = await asyncio.to_thread(state.tokenizer_for, server)
        if "tool_parser" in body.model_fields_set:
            tool_parser = body.tool_parser or None
        else:
            tool_parser = state.tool_parser or DEFAULT_TOOL_PARSER
        try:
            managed = RecordingManagedServer(
                UpstreamTap(server),
                tokenizer,
                track_tree=body.track_tree,
                tool_parser=tool_parser,
                preserve_think_blocks=body.preserve_think_blocks,
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_parser", status=400) from e
        sid = str(uuid.uuid4())
        session = SessionState(
            uuid=sid,
            managed_server=managed,
            translator=getattr(managed, "translator", None),
            model_name=_server_model(server),
            base_url=str(getattr(server, "name", "")) or None,
        )
        state.sessions.add(session)
        return SessionCreateResponse(
            uuid=sid,
            model_name=session.model_name,
            tool_parser=tool_parser,
            base_url=f"{str(request.base_url).rstrip('/')}/{sid}/v1",
            created_at=session.created_at,
            server=session.base_url,
        ).model_dump()

    def _server_model(server: Any) -> str:
        if state.model_name != "unknown":
            return state.model_name
        return str(config_value(getattr(server, "config", None), "model_name"))

    @app.get("/sessions")
    async def list_sessions() -> dict[str, Any]:
        state.sessions.expire()
        out = [
            {
                "uuid": s.uuid,
                "server": s.base_url,
                "model_name": s.model_name,
                "created_at": s.created_at,
                "last_accessed": s.last_accessed,
                "requests": s.requests,
                "num_nodes": s.num_nodes,
                "stored_tokens": s.stored_tokens,
            }
            for s in state.sessions.values()
        ]
        return {"sessions": out}

    async def _generate(
        session: SessionState, call: Any, body: Any, raw_size: int, watch: ClientWatch
    ) -> Any:
        """Run one generation of ``session`` within the bounds (cancelled when the client
        disconnects, see ``watch``); nodes are recounted after."""
        max_new = body.max_tokens or body.max_completion_tokens or 0
        try:
            reserved = state.sessions.admit(session, body.n, max_new, raw_size)
        except OpenAIError:
            call.close()  # never awaited: close it so it is not reported as forgotten
            raise
        session.requests += 1
        session.in_flight += 1
        try:
            return await watch.run(_run(call))
        finally:
            session.in_flight -= 1
            state.sessions.release(session, body.n, reserved)

    async def _generate_counted(
        session: SessionState,
        call: Any,
        body: Any,
        request: Request,
        count: bool,
        watch: ClientWatch,
    ) -> tuple[Any, list[int] | None]:
        """:func:`_generate`, and with ``count`` the request's ``[prompt_tokens,
        completion_tokens]`` as the inference server was asked and answered (else None)."""
        size = request.state.body_size
        if not count:
            return await _generate(session, call, body, size, watch), None
        usage = [0, 0]
        token = UPSTREAM_USAGE.set(usage)
        try:
            return await _generate(session, call, body, size, watch), usage
        finally:
            UPSTREAM_USAGE.reset(token)

    def _undelivered(session: SessionState, stored: Stored, when: str) -> None:
        """The client left ``when``: take back what its request stored, and count it."""
        withdrawn = session.managed_server.withdraw(stored) if stored else 0
        state.sessions.account(session)
        state.sessions.abandoned_requests += 1
        state.sessions.withdrawn_nodes += withdrawn
        logger.info("session %s: %s (%d node(s) not kept)", session.uuid, when, withdrawn)

    async def _answer(
        session: SessionState,
        call: Any,
        body: Any,
        request: Request,
        count: bool,
        build: Any,
    ) -> Response:
        """Generate (see :func:`_generate_counted`) and answer ``build(completion,
        usage)``, keeping the request's nodes only when the answer is delivered: a client
        that disconnects cancels the generation, and one gone before the answer's end (or
        an answer that fails after the generation) takes back its nodes."""
        stored: Stored = []
        token = STORED.set(stored)
        watch = ClientWatch(request.receive)
        try:
            completion, usage = await _generate_counted(session, call, body, request, count, watch)
            response = build(completion, usage)
        except ClientGone:
            _undelivered(session, stored, "the client left before its answer was ready")
            return Response(status_code=499)  # nobody reads it
        except BaseException:
            watch.stop()
            if stored:
                _undelivered(session, stored, "its answer failed after the generation")
            raise
        finally:
            STORED.reset(token)
        return watch.deliver(
            response,
            lambda: _undelivered(session, stored, "the client left before its answer was sent"),
        )

    @app.get("/{session_id}/v1/models")
    async def session_models(session_id: str) -> dict[str, Any]:
        state.session(session_id)
        return _models_payload()

    @app.post("/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Response:
        session = state.session(session_id)
        body: ChatCompletionProxyRequest = await _body(
            request, ChatCompletionProxyRequest, merge_extra_body=True
        )
        stream, include_usage = stream_options(body.model_extra)
        kwargs = body.upstream_kwargs()
        kwargs["messages"] = body.message_dicts()
        call = session.managed_server.chat_completion(**kwargs)

        def build(completion: Any, usage: list[int] | None) -> Response:
            if state.model_name != "unknown":
                completion.model = state.model_name
            payload = completion.model_dump(exclude_none=True)
            strict_tool_arguments(payload)
            if stream:
                return sse_answer(chat_chunks(payload, usage))
            return json_answer(payload)

        return await _answer(session, call, body, request, include_usage, build)

    @app.post("/{session_id}/v1/chat/completions/render")
    async def render_prompt(session_id: str, request: Request) -> dict[str, Any]:
        session = state.session(session_id)
        body: ChatCompletionProxyRequest = await _body(
            request, ChatCompletionProxyRequest, merge_extra_body=True
        )
        managed = session.managed_server
        prompt = await _run(managed._arender(body.message_dicts(), body.tools))
        token_ids = await _run(managed._aencode(prompt))
        return RenderResponse(
            prompt_text=prompt, token_ids=token_ids, num_tokens=len(token_ids)
        ).model_dump()

    @app.post("/{session_id}/v1/completions")
    async def completions(session_id: str, request: Request) -> Response:
        session = state.session(session_id)
        body: CompletionRequest = await _body(request, CompletionRequest, merge_extra_body=True)
        stream, include_usage = stream_options(body.model_extra)
        call = session.managed_server.completion(**passthrough(body))

        def build(completion: Any, usage: list[int] | None) -> Response:
            if state.model_name != "unknown":
                completion.model = state.model_name
            payload = completion.model_dump(exclude_none=True)
            if stream:
                return sse_answer(completion_chunks(payload, usage))
            return json_answer(payload)

        return await _answer(session, call, body, request, include_usage, build)

    @app.get("/{session_id}/nodes")
    async def get_nodes(session_id: str) -> dict[str, Any]:
        session = state.session(session_id)
        st = session.managed_server.get_state()
        if "nodes" in st:
            return {"uuid": session_id, "nodes": [n.model_dump() for n in st["nodes"]]}
        return {
            "uuid": session_id,
            "sequences": {k: v.model_dump() for k, v in st["sequences"].items()},
            "tree": st["tree"],
        }

    @app.post("/{session_id}/reset")
    async def reset(session_id: str) -> dict[str, Any]:
        session = state.session(session_id)
        session.managed_server.reset()
        state.sessions.account(session)
        return {"status": "reset", "uuid": session_id}

    @app.delete("/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        state.sessions.remove(session_id)
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
    for limit in dataclasses.fields(SessionLimits):
        parser.add_argument(
            "--" + limit.name.replace("_", "-"),
            type=type(limit.default),
            default=limit.default,
            help=limit.metadata["help"],
        )
    parser.add_argument(
        "--max-upstream-mb",
        type=float,
        default=64.0,
        help="Largest inference server answer read (a larger one is a 502).",
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
        limits=SessionLimits(
            **{limit.name: getattr(args, limit.name) for limit in dataclasses.fields(SessionLimits)}
        ),
        max_upstream_mb=args.max_upstream_mb,
    )
    from atroposlib.http.transport import http_protocol

    # The bounded protocol: a client that pipelines requests and never reads the answers
    # is no longer read from, instead of growing the proxy's memory.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=http_protocol())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
