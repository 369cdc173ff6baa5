"""Domain errors of the inference server and their OpenAI-format HTTP mapping."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ServingError(Exception):
    """A client-visible error: HTTP ``status`` with an OpenAI-style error body."""

    status: int = 400
    type: str = "invalid_request_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status


class InvalidRequest(ServingError):
    """Bad parameters, too-long prompts, malformed messages (400)."""


class ModelNotFound(ServingError):
    """The ``model`` field names a model this server does not serve (404)."""

    status = 404
    type = "NotFoundError"


class Unauthorized(ServingError):
    """Missing or wrong API key (401)."""

    status = 401
    type = "authentication_error"


class Forbidden(ServingError):
    """The request is understood but not allowed (e.g. weights outside ``--weights-root``)."""

    status = 403
    type = "permission_error"


class ClientGone(ServingError):
    """The client disconnected before the answer was ready (nobody reads this reply)."""

    status = 499
    type = "client_closed_request"

    def __init__(self) -> None:
        super().__init__("client closed the request")


def error_body(message: str, type_: str, param: str | None, code: str | int | None) -> dict:
    """The OpenAI error envelope ``{"error": {...}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query")]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Map domain and validation errors to OpenAI-format JSON (never a bare 500)."""

    @app.exception_handler(ServingError)
    async def _serving(_: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.message, exc.type, exc.param, exc.code or exc.status),
            status_code=exc.status,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
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
        return JSONResponse(
            error_body(message, "invalid_request_error", param, 400), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error", None, exc.status_code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return JSONResponse(
            error_body(f"internal error: {exc}", "internal_error", None, 500), status_code=500
        )


_GUARD_TYPES = {401: "authentication_error", 403: "permission_error", 415: "invalid_request_error"}


class OpenAIErrorEnvelope:
    """Re-shape the shared security layer's refusals (``{"detail": ...}``) as OpenAI errors.

    :mod:`atroposlib.utils.http_security` answers 401/403/415 with FastAPI's ``detail`` shape,
    which every other server we ship uses; OpenAI clients of this one expect
    ``{"error": {...}}``. Only small JSON bodies with those statuses are buffered; everything
    else (streams included) passes through untouched.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}

        async def reshape(message: Any) -> None:
            if message["type"] == "http.response.start" and message["status"] in _GUARD_TYPES:
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                await send(message)
                return
            start = held.pop("start")
            body = message.get("body", b"")
            try:
                detail = json.loads(body)["detail"] if not message.get("more_body") else None
            except (ValueError, KeyError, TypeError):
                detail = None
            if not isinstance(detail, str):
                await send(start)
                await send(message)
                return
            status = start["status"]
            new = json.dumps(error_body(detail, _GUARD_TYPES[status], None, status)).encode()
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, reshape)
