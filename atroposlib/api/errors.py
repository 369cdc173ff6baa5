"""Domain errors of the rollout API and their single mapping to HTTP responses."""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

logger = logging.getLogger(__name__)

__all__ = [
    "ApiError",
    "BodyValidationError",
    "GroupInconsistentError",
    "QueueFullError",
    "StorageError",
    "UnknownEnvError",
    "echoed_input",
    "error_response",
    "install_error_handlers",
    "invalid_body",
    "validation_detail",
]


class ApiError(Exception):
    """Base class of the errors the store raises; each knows its HTTP status."""

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def payload(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"detail": self.message}

    def headers(self) -> dict[str, str] | None:
        """Extra response headers, if any."""
        return None


class UnknownEnvError(ApiError):
    """An ``env_id`` that no registered environment has."""

    status_code = 404

    def __init__(self, env_id: Any) -> None:
        super().__init__(
            f"unknown env_id {env_id!r}: register the environment with /register-env first"
        )
        self.env_id = env_id

    def payload(self) -> dict[str, Any]:
        # `status`/`error` keep old clients of /disconnect-env working.
        return {"detail": self.message, "status": "failure", "error": self.message}


class QueueFullError(ApiError):
    """The queue holds more than ``--max-queue-mb``; the sender should retry later."""

    status_code = 503

    def __init__(self, queued_bytes: int, limit_bytes: int, retry_after: int = 1) -> None:
        super().__init__(
            f"rollout queue is full ({queued_bytes} of {limit_bytes} bytes used); retry after {retry_after}s"
        )
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class StorageError(ApiError):
    """The persistence layer failed; nothing was acknowledged."""

    status_code = 503

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class GroupInconsistentError(ApiError):
    """A group whose fields disagree in count or per-sequence length."""

    status_code = 422

    def __init__(self, loc: Sequence[Any], message: str) -> None:
        super().__init__(message)
        self.loc = tuple(loc)

    def payload(self) -> dict[str, Any]:
        return {
            "detail": [{"type": "value_error", "loc": ["body", *self.loc], "msg": self.message}]
        }


class BodyValidationError(ApiError):
    """A request body (or parameter) that fails validation; FastAPI-shaped ``detail`` list."""

    status_code = 422

    def __init__(self, detail: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in detail))
        self.detail = detail

    def payload(self) -> dict[str, Any]:
        return {"detail": self.detail}


def error_response(exc: ApiError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, JSON body)`` of a domain error, for raw-ASGI handlers.

    The body is written compactly, as FastAPI's ``JSONResponse`` writes it, so an error
    reads the same byte for byte whether the hot path or a FastAPI route answered it.
    """
    headers = [(b"content-type", b"application/json")]
    headers += [(k.lower().encode(), v.encode()) for k, v in (exc.headers() or {}).items()]
    return exc.status_code, headers, json.dumps(exc.payload(), separators=(",", ":")).encode()


MAX_ECHOED_INPUT = 1024
"""Longest ``input`` (in JSON characters) a 422 entry echoes; a larger one is described
instead, so a rejected multi-megabyte group is not sent back (docs/design.md, "Bounded inputs")."""


def echoed_input(value: Any) -> Any:
    """The ``input`` of a 422 entry: ``value`` itself when its JSON form is short, else a
    string naming its type and size (also for values JSON cannot carry, such as ``NaN``).
    Raw bytes (a body that is not JSON) are echoed as text."""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return f"<{type(value).__name__}: not echoed>"
    if len(text) <= MAX_ECHOED_INPUT:
        return value
    size = f"{len(value)} items, " if isinstance(value, (list, dict)) else ""
    return f"<{type(value).__name__}: {size}{len(text)} JSON characters, not echoed>"


def validation_detail(
    errors: Sequence[dict[str, Any]], prefix: Sequence[Any] = ("body",)
) -> list[dict]:
    """Turn pydantic errors into FastAPI-style ``detail`` entries, each with the ``input``
    it refused as FastAPI gives it (bounded by :data:`MAX_ECHOED_INPUT`)."""
    out = []
    for e in errors:
        entry = {
            "type": e.get("type", "value_error"),
            "loc": [*prefix, *e.get("loc", ())],
            "msg": e.get("msg", ""),
        }
        if "input" in e:
            entry["input"] = echoed_input(e["input"])
        out.append(entry)
    return out


def invalid_body(e: ValidationError, prefix: Sequence[Any] = ("body",)) -> BodyValidationError:
    """The 422 of a body that pydantic rejected: every error, located, with its input."""
    return BodyValidationError(validation_detail(e.errors(include_url=False), prefix))


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.payload(), status_code=exc.status_code, headers=exc.headers())


async def _request_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": validation_detail(exc.errors(), ())}, status_code=422)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    store = getattr(request.app, "atropos_store", None)
    if store is not None:
        store.count("internal_errors")
    return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    """Map every domain error to its HTTP response, in one place."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(Exception, _unexpected)
