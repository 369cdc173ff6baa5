"""Session affinity: the requests of one trajectory go to one inference server.

A ``ManagedServer`` owns a session id (made when it is created) and runs each of its
upstream requests with :data:`CURRENT_SESSION` set to it. Two readers use it:

* the JSON transport sends it as the ``X-Session-ID`` header, so any router in front of
  the servers can pin the session as well;
* ``ServerManager`` pins the session to the server that first answered it, keeps it there
  while that server is healthy, and moves it (re-pinning) when that server fails.

A context variable is used rather than a keyword argument so that every backend and the
proxy's sessions carry the id without a change to their call signatures; reading it costs
one lookup per request.
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import Any, Awaitable, Callable, TypeVar

__all__ = [
    "CURRENT_SESSION",
    "MAX_PINNED_SESSIONS",
    "SessionRoute",
    "in_session",
    "new_session_id",
]

T = TypeVar("T")

CURRENT_SESSION: ContextVar[str | None] = ContextVar("atropos_session_id", default=None)
"""The session id of the request being made (None outside a session)."""

MAX_PINNED_SESSIONS = 65536
"""Pins a ``ServerManager`` keeps; past this the oldest is dropped (a session whose
``managed_server()`` block ended is unpinned at once, so this bounds only sessions opened
some other way)."""


def new_session_id() -> str:
    """A fresh session id (32 hex digits)."""
    return uuid.uuid4().hex


async def in_session(session_id: str, call: Callable[..., Awaitable[T]], **kwargs: Any) -> T:
    """``await call(**kwargs)`` with :data:`CURRENT_SESSION` set to ``session_id``."""
    token = CURRENT_SESSION.set(session_id)
    try:
        return await call(**kwargs)
    finally:
        CURRENT_SESSION.reset(token)


class SessionRoute:
    """Stands in for a session's server inside a ``ManagedServer``: its requests go
    through ``manager`` (which keeps them on the session's pinned server and moves them
    when that server fails); everything else (``config``, tokenizer, ...) is the server's."""

    def __init__(self, manager: Any, server: Any):
        self._manager = manager
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> Any:
        """Tokens and logprobs through the manager."""
        return await self._manager.tokens_and_logprobs_completion(**kwargs)

    async def chat_completion(self, **kwargs: Any) -> Any:
        """A chat completion through the manager."""
        return await self._manager.chat_completion(**kwargs)

    async def completion(self, **kwargs: Any) -> Any:
        """A completion through the manager."""
        return await self._manager.completion(**kwargs)

    async def get_logprobs(self, **kwargs: Any) -> Any:
        """Prompt logprobs through the manager."""
        return await self._manager.get_logprobs(**kwargs)
