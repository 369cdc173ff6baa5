"""The OpenAI error envelope every server we ship answers in: :class:`OpenAIError` and its
subclasses carry a status and OpenAI's error fields (the type of each status from the one
table, :func:`~atroposlib.http.answers.openai_error_type`);
:func:`~atroposlib.http.answers.error_body` writes ``{"error": {"message", "type", "param",
"code"}}`` and :func:`install_error_handlers` maps them (and validation and HTTP errors) onto
it, so a FastAPI app never answers a bare 500. Re-exported by
:mod:`atroposlib.http.openai_protocol`, where the servers import them from.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from atroposlib.http.answers import error_body, openai_error_type

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """A client-visible error: HTTP ``status`` with OpenAI's error fields.

    Subclasses fix ``status`` and ``type``; either can be given per instance.
    """

    status: int = 400
    type: str = "invalid_request_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,  # noqa: A002 (OpenAI's field name)
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, Any]:
        """The error envelope of this error (``code`` defaults to the status)."""
        return error_body(self.message, self.type, self.param, self.code or self.status)


class InvalidRequest(OpenAIError):
    """Bad parameters, too-long prompts, malformed messages (400)."""


class ModelNotFound(OpenAIError):
    """The ``model`` field names a model this server does not serve (404)."""

    status = 404
    type = openai_error_type(404)


class Forbidden(OpenAIError):
    """The request is understood but not allowed (e.g. weights outside ``--weights-root``)."""

    status = 403
    type = openai_error_type(403)


class ClientGone(OpenAIError):
    """The client disconnected before the answer was ready (nobody reads this reply)."""

    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("client closed the request")


_T = TypeVar("_T")


async def unless_disconnected(request: Request, work: Awaitable[_T], poll_s: float = 0.5) -> _T:
    """Await ``work``, cancelling it if the client goes away first (:class:`ClientGone`).

    Clients with timeouts (environments retrying a slow request) would otherwise leave the
    engine generating answers nobody reads; cancelling frees the engine's rows (vLLM aborts
    the request).
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                logger.info("client disconnected; cancelling its generation")
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


def error_response(exc: OpenAIError) -> JSONResponse:
    """``exc`` as a JSON answer with its status."""
    return JSONResponse(exc.body(), status_code=exc.status)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query")]
    return ".".join(parts) or None


def validation_error(exc: ValidationError | RequestValidationError) -> InvalidRequest:
    """A 400 naming the first field pydantic refused (``param`` is its dotted path)."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        param, message = None, f"request body is not valid JSON: {msg}"
    elif param is None and first.get("type") == "model_attributes_type":
        message = "request body must be a JSON object (Content-Type: application/json)"
    else:
        message = f"invalid value for '{param}': {msg}" if param else msg
    return InvalidRequest(message, param=param, code=400)


def install_error_handlers(app: FastAPI) -> None:
    """Map :class:`OpenAIError`, validation and HTTP errors to OpenAI-format JSON; anything
    else is a logged 500 in the same format (never a bare one)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), openai_error_type(exc.status_code), None, exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return JSONResponse(
            error_body(f"internal error: {exc}", "internal_error", None, 500), status_code=500
        )
