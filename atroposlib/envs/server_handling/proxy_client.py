"""Client side of the managed-server proxy: ``ProxyManagedServer``.

``ServerManager.managed_server()`` yields one when a proxy URL is configured
(``proxy_url=`` or ``ATROPOS_PROXY_URL``); it behaves like a ``ManagedServer`` whose
requests and nodes live in the proxy. It sends ``Authorization: Bearer KEY`` with
``api_key=`` or, by default, ``ATROPOS_API_KEY`` (the key a proxy started with ``--api-key``
or that variable requires).

Example::

    proxy = await ProxyManagedServer.create("http://127.0.0.1:9100")
    await proxy.chat_completion(messages=[{"role": "user", "content": "hi"}], n=2)
    nodes = (await proxy.aget_state())["nodes"]
    await proxy.close()
"""

from __future__ import annotations

import os
from typing import Any

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion

from atroposlib.envs.server_handling.managed_server import SequenceNode

DEFAULT_TIMEOUT = 1200.0


class ProxyError(RuntimeError):
    """The proxy answered with an error (its OpenAI-format message is kept)."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"proxy error {status}: {message}")


def _auth(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("ATROPOS_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ProxyError(response.status_code, message)
    return response.json()


class ProxyManagedServer:
    """A ``ManagedServer`` session held by a remote proxy."""

    def __init__(
        self,
        proxy_url: str,
        session_id: str,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
    ):
        self.proxy_url = proxy_url.rstrip("/")
        self.session_id = session_id
        self.timeout = timeout
        self._headers = _auth(api_key)
        self._client = httpx.AsyncClient(timeout=timeout, headers=self._headers)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of this session (give it to any OpenAI client)."""
        return f"{self.proxy_url}/{self.session_id}/v1"

    @classmethod
    async def create(
        cls,
        proxy_url: str,
        base_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        **options: Any,
    ) -> ProxyManagedServer:
        """Open a new session (``options``: tool_parser, preserve_think_blocks, track_tree)."""
        body = {"base_url": base_url, **options} if base_url else dict(options)
        async with httpx.AsyncClient(timeout=min(timeout, 30.0), headers=_auth(api_key)) as client:
            data = _check(await client.post(f"{proxy_url.rstrip('/')}/sessions/create", json=body))
        return cls(proxy_url, data["uuid"], timeout=timeout, api_key=api_key)

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion recorded by the proxy session."""
        kwargs.pop("split", None)
        data = _check(await self._client.post(f"{self.base_url}/chat/completions", json=kwargs))
        return ChatCompletion.model_validate(data)

    async def completion(self, **kwargs: Any) -> Completion:
        """Text completion recorded by the proxy session."""
        kwargs.pop("split", None)
        data = _check(await self._client.post(f"{self.base_url}/completions", json=kwargs))
        return Completion.model_validate(data)

    async def render(self, messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
        """The prompt text and token ids the session would send for ``messages``."""
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        return _check(
            await self._client.post(f"{self.base_url}/chat/completions/render", json=body)
        )

    async def aget_state(self) -> dict[str, Any]:
        """``{"nodes": [SequenceNode, ...]}`` (or the tree-mode state) from the proxy."""
        data = _check(await self._client.get(f"{self.proxy_url}/{self.session_id}/nodes"))
        if "nodes" in data:
            return {"nodes": [SequenceNode.model_validate(n) for n in data["nodes"]]}
        return {
            "sequences": {k: SequenceNode.model_validate(v) for k, v in data["sequences"].items()},
            "tree": data["tree"],
        }

    def get_state(self) -> dict[str, Any]:
        """Blocking version of :meth:`aget_state` (for code written against ManagedServer)."""
        response = httpx.get(
            f"{self.proxy_url}/{self.session_id}/nodes",
            timeout=min(self.timeout, 30.0),
            headers=self._headers,
        )
        data = _check(response)
        if "nodes" in data:
            return {"nodes": [SequenceNode.model_validate(n) for n in data["nodes"]]}
        return data

    def reset(self) -> None:
        """Forget the session's nodes (blocking call, like :meth:`get_state`)."""
        _check(
            httpx.post(
                f"{self.proxy_url}/{self.session_id}/reset",
                timeout=min(self.timeout, 30.0),
                headers=self._headers,
            )
        )

    async def close(self) -> None:
        """Delete the session and close the HTTP client."""
        try:
            response = await self._client.delete(f"{self.proxy_url}/{self.session_id}")
            if response.status_code not in (200, 404):
                _check(response)
        finally:
            await self._client.aclose()
