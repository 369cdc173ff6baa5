"""Client side of the managed-server proxy: ``ProxyManagedServer`` and ``create_proxy_session``.

``ServerManager.managed_server()`` yields one when a proxy URL is configured
(``proxy_url=`` or ``ATROPOS_PROXY_URL``); it behaves like a ``ManagedServer`` whose
requests and nodes live in the proxy. It sends ``Authorization: Bearer KEY`` with
``api_key=`` or, by default, ``ATROPOS_API_KEY`` (the key a proxy started with ``--api-key``
or that variable requires).

Example::

    proxy = await create_proxy_session("http://127.0.0.1:9100")
    client = openai.AsyncOpenAI(base_url=proxy.get_url(), api_key=...)  # any OpenAI client
    await proxy.chat_completion(messages=[{"role": "user", "content": "hi"}], n=2)
    nodes = (await proxy.fetch_state())["nodes"]
    await proxy.cleanup()
"""

from __future__ import annotations

import os
from typing import Any, Dict

import httpx
from openai.types import Completion
from openai.types.chat import ChatCompletion

from atroposlib.envs.server_handling.managed_server import SequenceNode

DEFAULT_TIMEOUT = 1200.0
"""Seconds a generation request may take (the proxy waits for the inference server)."""


class ProxyError(RuntimeError):
    """The proxy answered with an error (its OpenAI-format message and type are kept)."""

    def __init__(self, status: int, message: str, error_type: str | None = None):
        self.status = status
        self.message = message
        self.error_type = error_type
        super().__init__(f"proxy error {status}: {message}")


def _auth(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("ATROPOS_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        error_type = None
        try:
            error = response.json()["error"]
            message, error_type = error["message"], error.get("type")
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ProxyError(response.status_code, message, error_type)
    return response.json()


def _state(data: dict[str, Any]) -> dict[str, Any]:
    if "nodes" in data:
        return {"nodes": [SequenceNode.model_validate(n) for n in data["nodes"]]}
    return {
        "sequences": {k: SequenceNode.model_validate(v) for k, v in data["sequences"].items()},
        "tree": data["tree"],
    }


class ProxyManagedServer:
    """A ``ManagedServer`` session held by a remote proxy.

    ``session_uuid`` names the session at ``proxy_url``; ``model_name`` is what the proxy
    reported for it and ``base_url`` the inference server it is pinned to (None: the
    proxy chose). :meth:`get_url` is the OpenAI base URL to give agent frameworks.
    """

    def __init__(
        self,
        proxy_url: str,
        session_uuid: str,
        model_name: str = "unknown",
        base_url: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
    ):
        self.proxy_url = proxy_url.rstrip("/")
        self.session_uuid = session_uuid
        self.model_name = model_name
        self.base_url = base_url
        self.timeout = timeout
        self._headers = _auth(api_key)
        self._client = httpx.AsyncClient(timeout=timeout, headers=self._headers)

    @property
    def session_id(self) -> str:
        """Older name of ``session_uuid``."""
        return self.session_uuid

    def get_url(self) -> str:
        """The OpenAI base URL of this session (``{proxy_url}/{uuid}/v1``)."""
        return f"{self.proxy_url}/{self.session_uuid}/v1"

    @classmethod
    async def create(
        cls,
        proxy_url: str,
        base_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        api_key: str | None = None,
        **options: Any,
    ) -> ProxyManagedServer:
        """Open a new session (``options``: tool_parser, preserve_think_blocks, track_tree);
        without ``tool_parser`` the proxy's own default applies."""
        body = {"base_url": base_url, **options} if base_url else dict(options)
        return await _open_session(proxy_url, body, "unknown", base_url, timeout, api_key)

    # ----------------------------------------------------------------- HTTP
    async def _post(self, path: str, json: dict, timeout: int = 300) -> dict:
        """POST ``json`` to ``{proxy_url}{path}``; the decoded answer, or :class:`ProxyError`."""
        return _check(
            await self._client.post(f"{self.proxy_url}{path}", json=json, timeout=timeout)
        )

    async def _get(self, path: str, timeout: int = 30) -> dict:
        """GET ``{proxy_url}{path}``; the decoded answer, or :class:`ProxyError`."""
        return _check(await self._client.get(f"{self.proxy_url}{path}", timeout=timeout))

    async def _delete(self, path: str, timeout: int = 30) -> dict:
        """DELETE ``{proxy_url}{path}``; the decoded answer, or :class:`ProxyError`."""
        return _check(await self._client.delete(f"{self.proxy_url}{path}", timeout=timeout))

    # ----------------------------------------------------------------- ManagedServer API
    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion recorded by the proxy session."""
        kwargs.pop("split", None)
        path = f"/{self.session_uuid}/v1/chat/completions"
        return ChatCompletion.model_validate(await self._post(path, kwargs, self.timeout))

    async def completion(self, **kwargs: Any) -> Completion:
        """Text completion recorded by the proxy session."""
        kwargs.pop("split", None)
        path = f"/{self.session_uuid}/v1/completions"
        return Completion.model_validate(await self._post(path, kwargs, self.timeout))

    async def render(self, messages: list[dict[str, Any]], tools: Any = None) -> dict[str, Any]:
        """``{"prompt_text", "token_ids", "num_tokens"}``: what the session would send."""
        body: dict[str, Any] = {"messages": messages}
        if tools:
            body["tools"] = tools
        return await self._post(f"/{self.session_uuid}/v1/chat/completions/render", body, 30)

    async def fetch_state(self) -> Dict[str, Any]:
        """``{"nodes": [SequenceNode, ...]}`` (or the tree-mode state) from the proxy."""
        return _state(await self._get(f"/{self.session_uuid}/nodes"))

    aget_state = fetch_state
    """Older name of :meth:`fetch_state`."""

    def get_state(self) -> Dict[str, Any]:
        """Blocking version of :meth:`fetch_state` (for code written against ManagedServer)."""
        response = httpx.get(
            f"{self.proxy_url}/{self.session_uuid}/nodes",
            timeout=min(self.timeout, 30.0),
            headers=self._headers,
        )
        return _state(_check(response))

    def reset(self) -> None:
        """Forget the session's nodes (blocking call, like :meth:`get_state`)."""
        _check(
            httpx.post(
                f"{self.proxy_url}/{self.session_uuid}/reset",
                timeout=min(self.timeout, 30.0),
                headers=self._headers,
            )
        )

    async def cleanup(self) -> None:
        """Delete the session at the proxy (already gone is fine) and close the client."""
        try:
            await self._delete(f"/{self.session_uuid}")
        except ProxyError as e:
            if e.status != 404:
                raise
        finally:
            await self._client.aclose()

    close = cleanup
    """Older name of :meth:`cleanup`."""


async def create_proxy_session(
    proxy_url: str,
    base_url: str | None = None,
    tool_parser: str = "hermes",
    track_tree: bool = False,
    model_name: str = "unknown",
    *,
    timeout: float = DEFAULT_TIMEOUT,
    api_key: str | None = None,
    **options: Any,
) -> ProxyManagedServer:
    """Open a session at the proxy and return its client.

    ``base_url`` pins the session to one of the proxy's inference servers; ``tool_parser``
    (None: no tool-call parsing) and ``track_tree`` configure it; ``model_name`` is used
    when the proxy reports none. ``options`` are further session fields
    (``preserve_think_blocks``).
    """
    body: dict[str, Any] = {"tool_parser": tool_parser, "track_tree": track_tree, **options}
    if base_url:
        body["base_url"] = base_url
    return await _open_session(proxy_url, body, model_name, base_url, timeout, api_key)


async def _open_session(
    proxy_url: str,
    body: dict[str, Any],
    model_name: str,
    base_url: str | None,
    timeout: float,
    api_key: str | None,
) -> ProxyManagedServer:
    url = f"{proxy_url.rstrip('/')}/sessions/create"
    async with httpx.AsyncClient(timeout=min(timeout, 30.0), headers=_auth(api_key)) as client:
        data = _check(await client.post(url, json=body))
    return ProxyManagedServer(
        proxy_url,
        data["uuid"],
        data.get("model_name") or model_name,
        data.get("server") or base_url,
        timeout=timeout,
        api_key=api_key,
    )
