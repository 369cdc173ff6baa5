"""Raw-ASGI hot path for the endpoints environments and trainers call in a loop.

``POST /scored_data``, ``POST /scored_data_list``, ``GET /batch`` and
``GET /status-env?env_id=N`` are answered here without FastAPI's request
objects, routing and dependency machinery; the FastAPI routes of the same paths
remain (they serve the OpenAPI schema and the legacy JSON-body
``/status-env``) and call the same :mod:`~atroposlib.api.handlers`. It sits
inside the auth, body-limit and gzip middleware, so those apply unchanged.

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
from typing import Any, Awaitable, Callable, Dict, Tuple
from urllib.parse import parse_qs

from atroposlib.api import handlers
from atroposlib.api.errors import ApiError, StorageError, error_response
from atroposlib.api.middleware import ASGIApp, Receive, Scope, Send
from atroposlib.api.store import RolloutStore
from atroposlib.utils.http_security import send_response

logger = logging.getLogger(__name__)

__all__ = ["INGEST_ROUTES", "SMALL_ANSWER_ROUTES", "BypassFor", "HotPathMiddleware"]

INGEST_ROUTES = frozenset({("POST", "/scored_data"), ("POST", "/scored_data_list")})
SMALL_ANSWER_ROUTES = INGEST_ROUTES | {("GET", "/status-env")}
"""Routes whose answers are far below the gzip threshold (errors included): gzip can skip them."""

_JSON_HEADERS = [(b"content-type", b"application/json")]
Handler = Callable[[bytes], bytes]


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


def _query_env_id(scope: Scope) -> int | None:
    """``env_id`` from the query string when it is a plain int; None leaves the request to FastAPI."""
    query = scope.get("query_string", b"")
    if not query:
        return None
    values = parse_qs(query.decode("latin-1")).get("env_id")
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        return None


def _query_ack(scope: Scope) -> str | None:
    """``ack`` of ``GET /batch?ack=ID`` (an empty value means "none yet"); None when absent."""
    query = scope.get("query_string", b"")
    if not query:
        return None
    values = parse_qs(query.decode("latin-1"), keep_blank_values=True).get("ack")
    return values[-1] if values else None


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

    def __init__(self, app: ASGIApp, store: RolloutStore) -> None:
        self.app = app
        self.store = store
        self._routes: Dict[Tuple[str, str], Handler] = {
            ("POST", "/scored_data"): self._scored_data,
            ("POST", "/scored_data_list"): self._scored_data_list,
            ("GET", "/batch"): self._batch,
        }
        self._commit: asyncio.Future | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        handler = self._routes.get((method, path))
        if handler is None and method == "GET" and path == "/status-env":
            env_id = _query_env_id(scope)
            if env_id is not None:
                await self._answer(send, lambda: handlers.status_env(self.store, env_id))
                return
        if handler is None:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return
        if handler == self._batch:
            await self._answer(send, lambda: self._batch(body, scope))
            return
        await self._answer(send, lambda: handler(body), self._committed)

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
            self.store.counters["internal_errors"] += 1
            status, headers, payload = (
                500,
                _JSON_HEADERS,
                f'{{"detail":"internal error: {type(e).__name__}"}}'.encode(),
            )
        await send_response(send, status, payload, headers)

    def _scored_data(self, body: bytes) -> bytes:
        return handlers.ingest_groups(self.store, body, many=False, defer=True)

    def _scored_data_list(self, body: bytes) -> bytes:
        return handlers.ingest_groups(self.store, body, many=True, defer=True)

    def _batch(self, body: bytes, scope: Scope | None = None) -> bytes:
        return handlers.serve_batch(self.store, _query_ack(scope) if scope else None)
