"""The proxy's routes: thin handlers that read the :class:`~atroposlib.proxy.state.ProxyState`
from ``request.app.state.proxy``, parse the body, call the session and answer.

Declared once at module level on :data:`router`; :func:`atroposlib.proxy.app.create_app`
includes it and puts the state on the app.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from atroposlib.envs.server_handling.server_baseline import config_value
from atroposlib.envs.server_handling.server_manager import ServerManager, supports_tokens
from atroposlib.http.answers import openai_error_type
from atroposlib.http.openai_protocol import OpenAIError, model_list, passthrough
from atroposlib.proxy.delivery import RecordingManagedServer
from atroposlib.proxy.generation import answer, run_call
from atroposlib.proxy.protocol import (
    DEFAULT_TOOL_PARSER,
    ChatCompletionProxyRequest,
    CompletionProxyRequest,
    RenderResponse,
    SessionCreateRequest,
    SessionCreateResponse,
    SetupRequest,
    parse_body,
)
from atroposlib.proxy.state import ProxyState, SessionState
from atroposlib.proxy.streaming import chat_chunks, completion_chunks, sse_answer, stream_options
from atroposlib.proxy.upstream import UpstreamTap, json_answer, strict_tool_arguments

router = APIRouter()


def proxy_state(request: Request) -> ProxyState:
    """The proxy's state, put on the app by ``create_app``."""
    return request.app.state.proxy


def _models_payload(state: ProxyState) -> dict[str, Any]:
    return model_list(state.model_names(), int(time.time()), "atropos")


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    state = proxy_state(request)
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


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return _models_payload(proxy_state(request))


def _server_row(server: Any) -> dict[str, Any]:
    sem = getattr(server, "sem", None)
    return {
        "base_url": config_value(server.config, "base_url") or None,
        "model_name": config_value(server.config, "model_name"),
        "server_type": config_value(server.config, "server_type"),
        "healthy": bool(getattr(server, "server_healthy", True)),
        "free_slots": sem.free_slots() if hasattr(sem, "free_slots") else None,
        "supports_tokens": supports_tokens(server),
    }


@router.get("/servers")
async def servers(request: Request) -> dict[str, Any]:
    manager = proxy_state(request).manager
    return {"servers": [_server_row(s) for s in (manager.servers if manager else [])]}


@router.post("/setup")
async def setup(request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    if not state.api_key_set:
        raise OpenAIError(
            "POST /setup is disabled: it points the proxy at new inference servers, so it "
            "needs the proxy to run with an API key (--api-key-file, ATROPOS_API_KEY)",
            status=403,
            type="permission_error",
        )
    body = await parse_body(request, SetupRequest)
    for i, server in enumerate(body.servers):
        # Resolving a name blocks (and may take seconds): off the event loop.
        problem = await asyncio.to_thread(state.upstreams.setup_problem, server.base_url)
        if problem is not None:
            raise OpenAIError(
                f"upstream {server.base_url!r} is not allowed: {problem}",
                param=f"servers.{i}.base_url",
                status=403,
                type="permission_error",
            )
    tok = None
    if body.tokenizer:
        tok = await asyncio.to_thread(state.fresh_tokenizer, body.tokenizer)
        if tok is None:
            raise OpenAIError(
                f"could not load tokenizer {body.tokenizer!r}", param="tokenizer", status=400
            )
    if state.manager is not None:
        await state.manager.close()
    state.manager = ServerManager(body.servers)
    state.bound_transports(state.manager, check_peers=True)
    if tok is not None:
        state.tokenizer = tok
    if body.tool_parser is not None:
        state.tool_parser = body.tool_parser
    return {"status": "ok", "servers": len(body.servers), "model_name": state.model_names()[0]}


@router.post("/sessions/create")
async def create_session(request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    body = await parse_body(request, SessionCreateRequest, allow_empty=True)
    manager = state.require_manager()
    state.sessions.check_room()  # 429 before loading a tokenizer for nothing
    try:
        server = manager._server_for_managed(body.base_url)
    except ValueError as e:
        raise OpenAIError(str(e), param="base_url", status=404, type=openai_error_type(404)) from e
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
        model_name=state.server_model(server),
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


def _session_row(s: SessionState) -> dict[str, Any]:
    return {
        "uuid": s.uuid,
        "server": s.base_url,
        "model_name": s.model_name,
        "created_at": s.created_at,
        "last_accessed": s.last_accessed,
        "requests": s.requests,
        "num_nodes": s.num_nodes,
        "stored_tokens": s.stored_tokens,
    }


@router.get("/sessions")
async def list_sessions(request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    state.sessions.expire()
    return {"sessions": [_session_row(s) for s in state.sessions.values()]}


@router.get("/{session_id}/v1/models")
async def session_models(session_id: str, request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    state.session(session_id)
    return _models_payload(state)


def _completion_payload(state: ProxyState, completion: Any) -> dict[str, Any]:
    if state.model_name != "unknown":
        completion.model = state.model_name
    return completion.model_dump(exclude_none=True)


@router.post("/{session_id}/v1/chat/completions")
async def chat_completions(session_id: str, request: Request) -> Response:
    state = proxy_state(request)
    session = state.session(session_id)
    body = await parse_body(request, ChatCompletionProxyRequest, merge_extra_body=True)
    stream, include_usage = stream_options(body.model_extra)
    kwargs = body.upstream_kwargs()
    kwargs["messages"] = body.message_dicts()
    call = session.managed_server.chat_completion(**kwargs)

    def build(completion: Any, usage: list[int] | None) -> Response:
        payload = _completion_payload(state, completion)
        strict_tool_arguments(payload)
        return sse_answer(chat_chunks(payload, usage)) if stream else json_answer(payload)

    return await answer(state, session, call, body, request, include_usage, build)


@router.post("/{session_id}/v1/chat/completions/render")
async def render_prompt(session_id: str, request: Request) -> dict[str, Any]:
    session = proxy_state(request).session(session_id)
    body = await parse_body(request, ChatCompletionProxyRequest, merge_extra_body=True)
    managed = session.managed_server
    prompt = await run_call(managed._arender(body.message_dicts(), body.tools))
    token_ids = await run_call(managed._aencode(prompt))
    return RenderResponse(
        prompt_text=prompt, token_ids=token_ids, num_tokens=len(token_ids)
    ).model_dump()


@router.post("/{session_id}/v1/completions")
async def completions(session_id: str, request: Request) -> Response:
    state = proxy_state(request)
    session = state.session(session_id)
    body = await parse_body(request, CompletionProxyRequest, merge_extra_body=True)
    stream, include_usage = stream_options(body.model_extra)
    call = session.managed_server.completion(**passthrough(body))

    def build(completion: Any, usage: list[int] | None) -> Response:
        payload = _completion_payload(state, completion)
        return sse_answer(completion_chunks(payload, usage)) if stream else json_answer(payload)

    return await answer(state, session, call, body, request, include_usage, build)


@router.get("/{session_id}/nodes")
async def get_nodes(session_id: str, request: Request) -> dict[str, Any]:
    session = proxy_state(request).session(session_id)
    st = session.managed_server.get_state()
    if "nodes" in st:
        return {"uuid": session_id, "nodes": [n.model_dump() for n in st["nodes"]]}
    return {
        "uuid": session_id,
        "sequences": {k: v.model_dump() for k, v in st["sequences"].items()},
        "tree": st["tree"],
    }


@router.post("/{session_id}/reset")
async def reset(session_id: str, request: Request) -> dict[str, Any]:
    state = proxy_state(request)
    session = state.session(session_id)
    session.managed_server.reset()
    state.sessions.account(session)
    return {"status": "reset", "uuid": session_id}


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request) -> dict[str, Any]:
    proxy_state(request).sessions.remove(session_id)
    return {"status": "deleted", "uuid": session_id}
