"""The proxy's request and answer models, and how a request body becomes one.

Chat and text requests are the pass-through models of :mod:`atroposlib.http.openai_protocol`
with the fields the proxy checks; every refusal is a 400 in OpenAI's error format naming
the field.
"""

from __future__ import annotations

import json
from typing import Any, List, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.http.openai_protocol import (
    OpenAIError,
    PassThroughChatRequest,
    PassThroughCompletionRequest,
    error_response,
    passthrough,
    validation_error,
)
from atroposlib.http.security import json_value_problem

M = TypeVar("M", bound=BaseModel)

DEFAULT_TOOL_PARSER = "hermes"
"""The tool-call parser of a session that names none (the proxy's ``--tool-parser`` wins)."""


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


class CompletionProxyRequest(PassThroughCompletionRequest):
    """An OpenAI text completion request to a session: one prompt text."""

    prompt: str = Field(..., min_length=1)


def _json_object(raw: bytes, allow_empty: bool) -> dict[str, Any]:
    if not raw and allow_empty:
        return {}
    try:
        data = json.loads(raw)
    except RecursionError as e:
        raise OpenAIError("body is not valid JSON: nested too deeply", status=400) from e
    except ValueError as e:  # bad JSON or UTF-8, a number of thousands of digits
        raise OpenAIError(f"body is not valid JSON: {e}", status=400) from e
    if not isinstance(data, dict):
        raise OpenAIError("body must be a JSON object", status=400)
    return data


async def parse_body(
    request: Request,
    model: type[M],
    allow_empty: bool = False,
    merge_extra_body: bool = False,
) -> M:
    """The request's body as ``model`` (400 naming the field when it is not one).

    With ``merge_extra_body`` an ``extra_body`` object is merged over the request first:
    the backends merge it when they send, so every bound is checked on what the inference
    server receives. The body's size is kept in ``request.state.body_size``: it bounds the
    prompt's tokens (see :meth:`~atroposlib.proxy.state.SessionStore.admit`).
    """
    raw = await request.body()  # bounded in size and time by the body layer
    request.state.body_size = len(raw)
    data = _json_object(raw, allow_empty)
    if merge_extra_body and "extra_body" in data:
        extra = data.pop("extra_body")
        if extra is not None and not isinstance(extra, dict):
            raise OpenAIError("extra_body must be a JSON object", param="extra_body", status=400)
        data.update(extra or {})
    problem = json_value_problem(data)  # what the upstream client could not send on
    if problem is not None:
        raise OpenAIError(f"'{problem[0]}' {problem[1]}", param=problem[0], status=400)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e
