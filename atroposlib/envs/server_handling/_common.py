"""Helpers shared by the HTTP backends: URLs, a lazily built HTTP client, tokenizers."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from atroposlib.envs.server_handling._transport import HttpStatus, JsonTransport

logger = logging.getLogger(__name__)


def root_url(base_url: str | None) -> str:
    """``http://host:port/v1`` → ``http://host:port`` (the server root for /health, /generate)."""
    url = (base_url or "").rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


OPENAI_ONLY_KEYS = (
    "model",
    "stream",
    "stream_options",
    "user",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "extra_headers",
    "extra_query",
    "timeout",
)


def generate_sampling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """OpenAI-style request kwargs → sampling parameters for a native ``/generate``.

    OpenAI-only keys are dropped and ``extra_body`` is merged in (it carries backend
    sampling parameters such as ``top_k`` or ``min_p``).
    """
    out = {k: v for k, v in kwargs.items() if k not in OPENAI_ONLY_KEYS}
    extra = out.pop("extra_body", None)
    if isinstance(extra, dict):
        out.update(extra)
    return out


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without the keys whose value is None."""
    return {k: v for k, v in d.items() if v is not None}


class HttpClientMixin:
    """Owns the backend's HTTP clients: a lean :class:`JsonTransport` (aiohttp) used on
    the request path, and an ``httpx.AsyncClient`` kept for compatibility; both per event
    loop, created on first use."""

    _http: httpx.AsyncClient | None = None
    _http_loop: Any = None
    _transport: JsonTransport | None = None

    def api_headers(self) -> dict[str, str]:
        """``Authorization: Bearer <api_key>`` when the config has a key, else nothing."""
        api_key = getattr(getattr(self, "config", None), "api_key", "") or ""
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def transport(self) -> JsonTransport:
        """The lean JSON transport (timeout: the config's ``timeout``)."""
        if self._transport is None:
            timeout = float(getattr(getattr(self, "config", None), "timeout", 1200) or 1200)
            self._transport = JsonTransport(self.api_headers(), timeout=timeout)
        return self._transport

    async def fast_post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON over the lean transport; HTTP errors raise
        ``httpx.HTTPStatusError`` (as the httpx client did)."""
        try:
            return await self.transport().post_json(url, body)
        except HttpStatus as e:
            raise e.to_httpx() from None

    async def probe_status(self, url: str, timeout: float) -> int:
        """Status code of ``GET url`` over the lean transport (for health probes)."""
        return await self.transport().get_status(url, timeout=timeout)

    def http_client(self, timeout: float) -> httpx.AsyncClient:
        """The shared client (recreated if the event loop changed)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop or self._http.is_closed:
            # Raw-HTTP backends (/generate, /health) carry the same key as the OpenAI client does.
            api_key = getattr(getattr(self, "config", None), "api_key", "") or ""
            self._http = httpx.AsyncClient(
                headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
            self._http_loop = loop
        return self._http

    async def close_http(self) -> None:
        """Close the clients if this loop owns them."""
        if self._transport is not None:
            await self._transport.close()
        if self._http is not None and not self._http.is_closed:
            try:
                await self._http.aclose()
            except RuntimeError:  # created on a loop that is gone
                pass
        self._http = None


async def post_json(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Any:
    """POST ``body`` as JSON and return the decoded answer; HTTP errors raise."""
    response = await client.post(url, json=body)
    response.raise_for_status()
    return response.json()


def load_tokenizer(name: str) -> Any:
    """``AutoTokenizer.from_pretrained(name)``, or None (logged) when it cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, ImportError) as e:
        logger.warning("could not load tokenizer %r: %s", name, e)
        return None
