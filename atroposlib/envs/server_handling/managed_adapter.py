"""``ManagedServerAdapter``: an ``openai.AsyncOpenAI`` look-alike over a ``ManagedServer``, for
frameworks (verifiers) that take an OpenAI client, and the context variable that tells the
managed server a call came through it."""

from __future__ import annotations

import contextvars
from typing import Any

_ROLLOUT_ORDER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "managed_rollout_order", default=False
)
"""Set while a ``ManagedServerAdapter`` call runs: its nodes are ordered by when the calling
task (the framework's rollout) finishes, not by when the request was made."""


class ManagedServerAdapter:
    """Duck-types ``openai.AsyncOpenAI`` over a ``ManagedServer``.

    ``adapter.chat.completions.create(...)``, ``adapter.completions.create(...)`` and
    ``adapter.post("/chat/completions", body=..., cast_to=ChatCompletion)`` go through the
    managed server (and are recorded); ``base_url`` is informative.

    Node order: frameworks given this client (verifiers) run each rollout in its own
    asyncio task and return the rollouts in the order the tasks finish, so the nodes a
    task recorded through the adapter take their place in ``get_state()["nodes"]`` when
    that task finishes: rollout ``i`` of the framework's results is node ``i``, whatever
    order the server answered in. (Calls made straight on the managed server keep request
    order.)
    """

    class _ChatNamespace:
        """``adapter.chat``."""

        def __init__(self, managed: Any):
            self.completions = ManagedServerAdapter._CreateNamespace(managed, "chat_completion")

    class _CreateNamespace:
        """``adapter.chat.completions`` and ``adapter.completions``: ``create`` calls the
        managed server's ``method`` (``chat_completion`` or ``completion``)."""

        def __init__(self, managed: Any, method: str):
            self._managed = managed
            self._method = method

        async def create(self, **kwargs: Any) -> Any:
            """A (chat) completion through the managed server."""
            token = _ROLLOUT_ORDER.set(True)
            try:
                return await getattr(self._managed, self._method)(**_openai_kwargs(kwargs))
            finally:
                _ROLLOUT_ORDER.reset(token)

    def __init__(self, managed_server: Any, base_url: str = "http://managed-server/v1"):
        self.managed_server = managed_server
        self.base_url = base_url
        self.chat = self._ChatNamespace(managed_server)
        self.completions = self._CreateNamespace(managed_server, "completion")

    async def post(self, path: str, body: dict[str, Any], cast_to: type) -> Any:
        """``AsyncOpenAI.post`` for the chat and completion routes: ``/chat/completions``
        and ``/completions`` (relative to ``base_url``) go through the managed server and
        the answer is returned as is when it is already a ``cast_to``, else validated as
        one. Any other path is a ValueError naming it."""
        route = "/" + path.strip("/").split("?", 1)[0]
        if route.endswith("/chat/completions"):
            result = await self.chat.completions.create(**dict(body or {}))
        elif route.endswith("/completions"):
            result = await self.completions.create(**dict(body or {}))
        else:
            raise ValueError(
                f"ManagedServerAdapter serves /chat/completions and /completions, not {path!r}"
            )
        if cast_to is None or isinstance(result, cast_to):
            return result
        validate = getattr(cast_to, "model_validate", None)
        data = result.model_dump() if hasattr(result, "model_dump") else result
        return validate(data) if callable(validate) else cast_to(data)

    def copy(self, **kwargs: Any) -> ManagedServerAdapter:
        """A new adapter over the same managed server (``AsyncOpenAI.copy``; only
        ``base_url`` is taken from ``kwargs``, other client options do not apply)."""
        return ManagedServerAdapter(
            self.managed_server, str(kwargs.get("base_url") or self.base_url)
        )

    with_options = copy


def _openai_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """OpenAI client kwargs without the client-only options (headers, timeout, ...), with
    ``extra_body`` merged in as the server would see it."""
    out = {k: v for k, v in kwargs.items() if k not in _CLIENT_ONLY}
    extra = out.pop("extra_body", None)
    if isinstance(extra, dict):
        out = {**extra, **out}
    return out


_CLIENT_ONLY = frozenset({"extra_headers", "extra_query", "timeout"})
