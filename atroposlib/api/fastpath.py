"""Raw-ASGI hot path for the endpoints environments and trainers call in a loop.

``POST /scored_data``, ``POST /scored_data_list``, ``GET /batch`` and
``GET /status-env`` are declared once, in :data:`HOT_ENDPOINTS`: their handler
and their OpenAPI entry (:func:`openapi_paths`, merged into the app's schema).
They are answered here without FastAPI's request objects, routing and
dependency machinery, and nowhere else; ``/status-env`` takes ``env_id`` as a
query parameter or, from old clients, as a JSON body, and words its 422s as
FastAPI would. The hot path sits inside the auth, body-limit and gzip
middleware, so those apply unchanged.

With ``--persist``, posts are committed in groups: every post handled in one
turn of the event loop is applied in memory, then one SQLite transaction
commits them all (scheduled with ``call_soon``, so it runs after the other
ready requests), and each is answered only once that transaction is done. A
client is never told ``received`` for a group that is not on disk; a failed
commit answers every post of the group with the storage error.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, Sequence, Tuple
from urllib.parse import parse_qs

from fastapi.openapi.utils import (
    validation_error_definition,
    validation_error_response_definition,
)
from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import URL
from starlette.responses import RedirectResponse

from atroposlib.api import handlers
from atroposlib.api.errors import (
    ApiError,
    BodyValidationError,
    StorageError,
    error_response,
    invalid_body,
)
from atroposlib.api.models import EnvIdentifier, ScoredData
from atroposlib.api.store import RolloutStore
from atroposlib.http.answers import send_response
from atroposlib.http.asgi import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = [
    "HOT_ENDPOINTS",
    "INGEST_ROUTES",
    "SMALL_ANSWER_ROUTES",
    "BypassFor",
    "HotEndpoint",
    "HotPathMiddleware",
    "openapi_paths",
    "openapi_schemas",
]

INGEST_ROUTES = frozenset({("POST", "/scored_data"), ("POST", "/scored_data_list")})
SMALL_ANSWER_ROUTES = INGEST_ROUTES | {("GET", "/status-env")}
"""Routes whose answers are far below the gzip threshold (errors included): gzip can skip them."""

_JSON = "application/json"
_JSON_HEADERS = [(b"content-type", _JSON.encode())]
Handler = Callable[[RolloutStore, bytes, Scope], bytes]
_METHOD_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
_ACK_DESCRIPTION = (
    "batch_id of the last batch received (empty when none): that batch is consumed; any other "
    "unacknowledged batch is served again. Without ack, this call acknowledges the previous batch."
)
_GROUP_SCHEMA = ScoredData.model_json_schema()
_GROUP_LIST_SCHEMA = {"type": "array", "items": _GROUP_SCHEMA, "title": "ScoredDataList"}


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client went away."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_OPTIONAL_INT = TypeAdapter(int | None)
_ENV_ID_DESCRIPTION = "The asking env's id."
_FAST_ENV_ID_DIGITS = 18
"""Longest ``env_id`` read without pydantic (any 18 digits fit in 64 bits)."""


def _query_value(scope: Scope, name: str) -> str | None:
    """The last value of ``name`` in the query string (blanks kept, as Starlette's
    ``QueryParams.get`` gives it); None when the query has none."""
    query = scope.get("query_string", b"")
    if not query:
        return None
    values = parse_qs(query.decode("latin-1"), keep_blank_values=True).get(name)
    return values[-1] if values else None


def _query_env_id(scope: Scope) -> int | None:
    """``env_id`` of ``GET /status-env?env_id=N``; None when the query has none (422 when bad).

    The last value counts, validated as FastAPI validates an ``int | None`` query
    parameter, so old answers and their 422 wording stay the same. ASCII digits, the
    usual case, skip pydantic: ``int`` reads them exactly as it does.
    """
    value = _query_value(scope, "env_id")
    if value is None:
        return None
    # Bounded before ``int``: past 4,300 digits ``int`` raises (Python's max-str-digits
    # limit), and pydantic answers the 422 (``int_parsing_size``) FastAPI would.
    if len(value) <= _FAST_ENV_ID_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    try:
        return _OPTIONAL_INT.validate_python(value)
    except ValidationError as e:
        raise invalid_body(e, ("query", "env_id")) from None


def _query_ack(scope: Scope) -> str | None:
    """``ack`` of ``GET /batch?ack=ID`` (an empty value means "none yet"); None when absent."""
    return _query_value(scope, "ack")


def _scored_data(store: RolloutStore, body: bytes, scope: Scope) -> bytes:
    return handlers.ingest_groups(store, body, many=False, defer=True)


def _scored_data_list(store: RolloutStore, body: bytes, scope: Scope) -> bytes:
    return handlers.ingest_groups(store, body, many=True, defer=True)


def _batch(store: RolloutStore, body: bytes, scope: Scope) -> bytes:
    return handlers.serve_batch(store, _query_ack(scope))


def _status_env(store: RolloutStore, body: bytes, scope: Scope) -> bytes:
    env_id = _query_env_id(scope)
    if env_id is None:
        # The original's clients send ``{"env_id": N}`` as the body of the GET.
        if not body.strip():
            raise BodyValidationError(
                [
                    {
                        "type": "missing",
                        "loc": ["query", "env_id"],
                        "msg": "env_id is required: GET /status-env?env_id=N",
                    }
                ]
            )
        env_id = handlers.parse_body(EnvIdentifier, body).env_id
    return handlers.status_env(store, env_id)


@dataclass(frozen=True)
class HotEndpoint:
    """One endpoint answered by the hot path: its route, handler and OpenAPI entry.

    ``commits``: the handler defers its database change to the group commit, and
    the answer waits for it. ``body`` is the request body's JSON schema,
    ``query`` the OpenAPI parameters of the query string.
    """

    method: str
    path: str
    name: str
    doc: str
    handler: Handler
    commits: bool = False
    body: Dict[str, Any] | None = None
    query: Tuple[Dict[str, Any], ...] = ()

    def operation(self) -> Dict[str, Any]:
        """The OpenAPI operation object, as FastAPI writes it for a route."""
        op: Dict[str, Any] = {
            "summary": self.name.replace("_", " ").title(),
            "description": self.doc,
            # As FastAPI's generate_unique_id: every non-word character of the path becomes "_".
            "operationId": re.sub(r"\W", "_", f"{self.name}{self.path}")
            + f"_{self.method.lower()}",
        }
        if self.query:
            op["parameters"] = list(self.query)
        if self.body is not None:
            op["requestBody"] = {"required": True, "content": {_JSON: {"schema": self.body}}}
        op["responses"] = {
            "200": {
                "description": "Successful Response",
                "content": {_JSON: {"schema": {}}},
            }
        }
        if self.query:
            op["responses"]["422"] = {
                "description": "Validation Error",
                "content": {
                    _JSON: {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}
                },
            }
        return op


def _optional_query(name: str, json_type: str, description: str) -> Dict[str, Any]:
    """The OpenAPI entry of an optional query parameter (``<type> | None``), as FastAPI
    writes it."""
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": {
            "anyOf": [{"type": json_type}, {"type": "null"}],
            "description": description,
            "title": name.replace("_", " ").title(),
        },
        "description": description,
    }


HOT_ENDPOINTS: Tuple[HotEndpoint, ...] = (
    HotEndpoint(
        "POST",
        "/scored_data",
        "scored_data",
        "Accept one scored group (422 on inconsistent fields, 503 + Retry-After when full).",
        _scored_data,
        commits=True,
        body=_GROUP_SCHEMA,
    ),
    HotEndpoint(
        "POST",
        "/scored_data_list",
        "scored_data_list",
        "Accept several groups at once, all or none.",
        _scored_data_list,
        commits=True,
        body=_GROUP_LIST_SCHEMA,
    ),
    HotEndpoint(
        "GET",
        "/batch",
        "batch",
        'Serve the oldest full batch (one per call) and count a step; ``{"batch": null}`` '
        "when short.\n\nThe answer carries ``batch_id`` and ``step``; the batch stays "
        'recoverable\nuntil acknowledged (see the API README, "Delivery").',
        _batch,
        query=(_optional_query("ack", "string", _ACK_DESCRIPTION),),
    ),
    HotEndpoint(
        "GET",
        "/status-env",
        "status_env",
        "An env's throttling signal; ``env_id`` as query parameter or (old clients) JSON body.",
        _status_env,
        query=(_optional_query("env_id", "integer", _ENV_ID_DESCRIPTION),),
    ),
)
"""The endpoints the hot path answers: each declared here once, handler and schema."""


def openapi_paths(endpoints: Sequence[HotEndpoint] = HOT_ENDPOINTS) -> Dict[str, Any]:
    """The OpenAPI ``paths`` entries of ``endpoints`` (for the app's schema)."""
    paths: Dict[str, Any] = {}
    for e in endpoints:
        paths.setdefault(e.path, {})[e.method.lower()] = e.operation()
    return paths


def openapi_schemas(endpoints: Sequence[HotEndpoint] = HOT_ENDPOINTS) -> Dict[str, Any]:
    """The ``components.schemas`` entries that the operations of ``endpoints`` refer to:
    FastAPI's validation-error schemas, as it adds them for a route with parameters."""
    if not any(e.query for e in endpoints):
        return {}
    return {
        "HTTPValidationError": validation_error_response_definition,
        "ValidationError": validation_error_definition,
    }


class BypassFor:
    """Send the requests of ``routes`` (method, path) straight to ``direct``, the rest to ``app``."""

    def __init__(self, app: ASGIApp, direct: ASGIApp, routes: frozenset) -> None:
        self.app = app
        self.direct = direct
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["method"], scope["path"]) in self.routes:
            await self.direct(scope, receive, send)
        else:
            await self.app(scope, receive, send)


class HotPathMiddleware:
    """Answer the hot endpoints directly; pass everything else to the FastAPI app."""

    def __init__(
        self,
        app: ASGIApp,
        store: RolloutStore,
        endpoints: Sequence[HotEndpoint] = HOT_ENDPOINTS,
    ) -> None:
        self.app = app
        self.store = store
        self._routes: Dict[Tuple[str, str], HotEndpoint] = {
            (e.method, e.path): e for e in endpoints
        }
        self._allow: Dict[str, bytes] = {}
        for e in endpoints:
            methods = self._allow.get(e.path, b"")
            self._allow[e.path] = (
                methods + b", " + e.method.encode() if methods else e.method.encode()
            )
        self._commit: asyncio.Future | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        endpoint = self._routes.get((method, path))
        if endpoint is None:
            allow = self._allow.get(path)
            if allow is not None:  # the path is declared here only: answer as a router would
                await send_response(
                    send, 405, _METHOD_NOT_ALLOWED, [*_JSON_HEADERS, (b"allow", allow)]
                )
                return
            if path.endswith("/") and path.rstrip("/") in self._allow:
                # As FastAPI's router answers a declared path with a trailing slash.
                target = URL(scope={**scope, "path": path.rstrip("/")})
                await RedirectResponse(str(target))(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return
        handler, store = endpoint.handler, self.store
        await self._answer(
            send,
            lambda: handler(store, body, scope),
            self._committed if endpoint.commits else None,
        )

    async def _committed(self) -> None:
        """Wait for the group commit of the deferred ingest changes (see the module doc)."""
        ticket = self.store.pending_ticket
        if ticket is None:
            return
        if self._commit is None:
            loop = asyncio.get_running_loop()
            self._commit = loop.create_future()
            loop.call_soon(self._group_commit)
        await asyncio.shield(self._commit)
        if ticket.error is not None:
            raise ticket.error

    def _group_commit(self) -> None:
        done, self._commit = self._commit, None
        try:
            self.store.flush()
        except StorageError:
            pass  # the tickets carry it to every waiting post
        except Exception:  # also carried by the tickets; logged here, as nobody else sees it
            logger.exception("group commit failed")
        finally:
            if done is not None and not done.done():
                done.set_result(None)

    async def _answer(
        self,
        send: Send,
        produce: Callable[[], Any],
        settle: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        try:
            status, headers, payload = 200, _JSON_HEADERS, produce()
            if settle is not None:
                await settle()
        except ApiError as e:
            status, headers, payload = error_response(e)
        except Exception as e:  # the hot path runs outside FastAPI's error middleware
            logger.exception("unhandled error in the hot path")
            self.store.count("internal_errors")
            status, headers, payload = (
                500,
                _JSON_HEADERS,
                f'{{"detail":"internal error: {type(e).__name__}"}}'.encode(),
            )
        await send_response(send, status, payload, headers)
