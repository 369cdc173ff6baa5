"""Helpers shared by the HTTP backends: URLs, their HTTP client, tokenizers."""

from __future__ import annotations

import logging
from typing import Any

from atroposlib.envs.server_handling._transport import JsonTransport

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
    """Owns the backend's :class:`JsonTransport` (its one HTTP client), created on first use."""

    _transport: JsonTransport | None = None

    def api_headers(self) -> dict[str, str]:
        """``Authorization: Bearer <api_key>`` when the config has a key, else nothing."""
        api_key = getattr(getattr(self, "config", None), "api_key", "") or ""
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def transport(self) -> JsonTransport:
        """The backend's JSON transport (timeout: the config's ``timeout``)."""
        if self._transport is None:
            timeout = float(getattr(getattr(self, "config", None), "timeout", 1200) or 1200)
            self._transport = JsonTransport(self.api_headers(), timeout=timeout)
        return self._transport

    async def fast_post_json(self, url: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON; the decoded answer (errors: see :mod:`.errors`)."""
        return await self.transport().post_json(url, body)

    async def fast_post_json_with_headers(
        self, url: str, body: dict[str, Any]
    ) -> tuple[Any, dict[str, str]]:
        """As :meth:`fast_post_json`, plus the answer's headers (lower-cased names)."""
        return await self.transport().post_json_with_headers(url, body)

    async def probe_status(self, url: str, timeout: float) -> int:
        """Status code of ``GET url`` (for health probes)."""
        return await self.transport().get_status(url, timeout=timeout)

    async def close_http(self) -> None:
        """Close the transport's connections."""
        if self._transport is not None:
            await self._transport.close()


def load_tokenizer(name: str | None) -> Any:
    """``AutoTokenizer.from_pretrained(name)``, or None (logged) when it cannot be loaded."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, ImportError) as e:
        logger.warning("could not load tokenizer %r: %s", name, e)
        return None


def config_tokenizer_name(config: Any) -> str | None:
    """The tokenizer a server config names: ``tokenizer_name``, or ``model_name`` when that is
    unset (``"none"``, empty or absent), as the original resolves it; None when neither is set."""
    name = getattr(config, "tokenizer_name", None)
    if not name or name == "none":
        name = getattr(config, "model_name", None)
    return str(name) if name else None


class LazyTokenizerMixin:
    """A backend's tokenizer, loaded once on first use from ``self.config`` (None, logged,
    when it cannot be loaded), and the prompt-or-ids argument handling built on it."""

    _tokenizer: Any = None
    _tokenizer_failed: bool = False

    @property
    def tokenizer(self) -> Any:
        """The server's tokenizer, loaded on first use (None if it cannot be loaded)."""
        if self._tokenizer is None and not self._tokenizer_failed:
            self._tokenizer = load_tokenizer(config_tokenizer_name(self.config))
            self._tokenizer_failed = self._tokenizer is None
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    def pop_prompt_ids(self, kwargs: dict[str, Any]) -> list[int]:
        """Pop ``input_ids`` (or ``prompt``, tokenized) from ``kwargs``; non-empty ints."""
        input_ids = kwargs.pop("input_ids", None)
        prompt = kwargs.pop("prompt", None)
        if input_ids is None:
            if prompt is None:
                raise ValueError("tokens_and_logprobs_completion needs prompt or input_ids")
            if self.tokenizer is None:
                raise ValueError(
                    f"no tokenizer for {config_tokenizer_name(self.config)!r}; "
                    "pass input_ids instead of prompt"
                )
            input_ids = self.tokenizer.encode(prompt)
        ids = [int(i) for i in input_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids


class GenerateEndpointMixin(LazyTokenizerMixin):
    """What the backends with a native ``POST {root}/generate`` (vLLM, SGLang) share: the
    URL, the request that returns the policy version, and the ``top_k`` argument.

    For :class:`~atroposlib.envs.server_handling.openai_server.OpenAIServer` subclasses
    (it uses their transport and ``resolve_version``)."""

    def generate_url(self) -> str:
        """``{root}/generate`` of the configured server."""
        return f"{root_url(self.config.base_url)}/generate"

    async def post_generate(self, body: dict[str, Any]) -> tuple[Any, Any]:
        """POST ``body`` to ``/generate``: the decoded answer and the policy version it
        carries (header or body, see :mod:`.policy_version`)."""
        data, headers = await self.fast_post_json_with_headers(self.generate_url(), body)
        return data, self.resolve_version(data, headers)

    @staticmethod
    def pop_top_k(kwargs: dict[str, Any]) -> int:
        """Pop ``top_k`` (else ``top_logprobs``; both go) from ``kwargs``: the logprobs
        wanted per prompt position, at least 1."""
        top_k = int(kwargs.pop("top_k", None) or kwargs.pop("top_logprobs", None) or 1)
        kwargs.pop("top_logprobs", None)
        return top_k
