"""``OpenAIServer``: any OpenAI-compatible endpoint (OpenAI, OpenRouter, vLLM, SGLang...).

Requests go over the layer's one HTTP client (:class:`~._transport.JsonTransport`); the
request body is what the ``openai`` client would send for the same keyword arguments, the
answer is built into the same ``ChatCompletion`` / ``Completion`` objects, and errors are the
``openai`` exceptions (see :mod:`.errors`), so callers written against the ``openai``
client see no difference, at a fraction of its CPU cost per request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Union
from urllib.parse import urlencode

import httpx
import openai
import orjson
import pydantic
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from atroposlib.envs.server_handling._common import HttpClientMixin
from atroposlib.envs.server_handling._transport import encode_json
from atroposlib.envs.server_handling.policy_version import VersionTracking
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)

logger = logging.getLogger(__name__)

_OPENAI_API = "https://api.openai.com/v1"


_OMITTED_TYPES = (openai.NotGiven, getattr(openai, "Omit", openai.NotGiven))


def _omitted(value: Any) -> bool:
    return isinstance(value, _OMITTED_TYPES)


def _timeout_seconds(value: Any) -> float | None:
    """A per-call ``timeout``: seconds, or an ``httpx.Timeout`` (its longest phase)."""
    if value is None or _omitted(value):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    names = ("connect", "read", "write", "pool")
    if not all(hasattr(value, name) for name in names):
        raise TypeError(f"timeout must be a number of seconds, got {type(value).__name__}")
    given = [float(p) for p in (getattr(value, n) for n in names) if isinstance(p, (int, float))]
    return max(given) if given else None  # httpx.Timeout(None): the server's own timeout


class OpenAIRequest:
    """One OpenAI-protocol request built from ``create(**kwargs)``-style arguments, as the
    ``openai`` client builds it: omitted values (``openai.NOT_GIVEN``) dropped, ``extra_body``
    merged into the body, ``extra_headers`` / ``extra_query`` / ``timeout`` applied to the
    HTTP request.

    >>> r = OpenAIRequest({"model": "m", "n": 2, "extra_body": {"top_k": 5}, "timeout": 3})
    >>> r.body, r.timeout
    ({'model': 'm', 'n': 2, 'top_k': 5}, 3.0)
    """

    __slots__ = ("body", "headers", "query", "timeout", "stream")

    def __init__(self, kwargs: dict[str, Any]):
        body = {k: v for k, v in kwargs.items() if not isinstance(v, _OMITTED_TYPES)}
        extra_headers = body.pop("extra_headers", None)
        query = body.pop("extra_query", None)
        self.timeout = _timeout_seconds(body.pop("timeout", None))
        extra = body.pop("extra_body", None)
        if isinstance(extra, dict):
            body.update(extra)
        elif extra is not None:
            raise TypeError(f"extra_body must be a dict, got {type(extra).__name__}")
        self.body = body
        self.headers = (
            {str(k): str(v) for k, v in extra_headers.items() if v is not None and not _omitted(v)}
            if extra_headers
            else None
        )
        self.query = dict(query) if query else None
        self.stream = body.get("stream") is True

    def url(self, base: str) -> str:
        """``base`` with ``extra_query`` appended."""
        if not self.query:
            return base
        return f"{base}{'&' if '?' in base else '?'}{urlencode(self.query, doseq=True)}"


def build_response(cls: Any, data: Any) -> Any:
    """``cls`` (``ChatCompletion`` / ``Completion``) from a decoded answer.

    Validation is the fast path; an answer that does not validate (a server leaving out
    a field) is built leniently, as the ``openai`` client does.
    """
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError:
        if not isinstance(data, dict):
            raise
        return cls.construct(**data)


class BufferedStream:
    """What a ``stream=True`` request returns: the answer's chunks (``ChatCompletionChunk``
    for chat, ``Completion`` for text), iterated with ``async for`` as the ``openai``
    client's stream is. The answer is read whole before the first chunk is yielded."""

    def __init__(self, chunks: list[Any]):
        self.chunks = chunks

    def __aiter__(self) -> Any:
        return self._iterate()

    async def _iterate(self) -> Any:
        for chunk in self.chunks:
            yield chunk

    async def __aenter__(self) -> BufferedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def close(self) -> None:
        """Nothing to release: the answer was read whole."""


def parse_event_stream(raw: bytes, cls: Any, method: str, url: str) -> BufferedStream:
    """The chunks of a server-sent-events answer (``data: {json}`` lines up to
    ``data: [DONE]``); an ``error`` event raises ``openai.APIError`` as the client does."""
    chunks = []
    for line in raw.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        data = orjson.loads(payload)
        if isinstance(data, dict) and data.get("error"):
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else None
            raise openai.APIError(
                message or "an error occurred during streaming",
                request=httpx.Request(method, url),
                body=error,
            )
        chunks.append(build_response(cls, data))
    return BufferedStream(chunks)


def merge_choices(responses: list[Any]) -> Any:
    """Append the choices of ``responses[1:]`` to ``responses[0]`` and renumber them 0..N-1."""
    first = responses[0]
    choices = list(first.choices)
    for extra in responses[1:]:
        choices.extend(extra.choices)
    for i, choice in enumerate(choices):
        choice.index = i
    first.choices = choices
    return first


class OpenAIServer(VersionTracking, HttpClientMixin, APIServer):
    """An OpenAI-compatible server (OpenAI, OpenRouter, vLLM or SGLang's /v1 API...).

    ``n`` handling: with ``n_kwarg_is_ignored`` the server gets ``n`` single requests;
    otherwise one request with ``n``, and if exactly one choice comes back the flag is
    set (with a warning) and the missing ``n - 1`` are requested separately.
    The health probe is ``GET {base_url}/models`` (cheap; any answer below 500 is up).
    The key sent is the config's ``api_key``, else ``OPENAI_API_KEY``, else ``EMPTY``.
    """

    transport_has_timeout = True  # the HTTP client enforces config.timeout

    def __init__(self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None):
        super().__init__(config, reasoning_config)
        self._api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self._auth = {"Authorization": f"Bearer {self._api_key}"}
        self._sdk: openai.AsyncClient | None = None

    @property
    def openai(self) -> openai.AsyncClient:
        """An ``openai.AsyncClient`` for this server (its key, base URL and timeout), made
        on first use, for code that calls the SDK itself; the server does not use it."""
        if self._sdk is None:
            self._sdk = openai.AsyncClient(
                api_key=self._api_key,
                base_url=self.config.base_url or None,
                timeout=self.config.timeout,
                max_retries=0,  # retries and failover are the server layer's
            )
        return self._sdk

    def _base_url(self) -> str:
        # As the openai client: the config's URL, else OPENAI_BASE_URL, else OpenAI's API.
        base = self.config.base_url or os.environ.get("OPENAI_BASE_URL") or _OPENAI_API
        return str(base).rstrip("/")

    async def _probe_health(self) -> bool:
        status = await self.probe_status(
            f"{self._base_url()}/models", min(5.0, float(self.config.timeout))
        )
        return status < 500

    async def _n_requests(self, create: Any, kwargs: dict[str, Any]) -> Any:
        n = int(kwargs.get("n") or 1)
        if n <= 1 or kwargs.get("stream") is True:
            return await create(**kwargs)
        single = {k: v for k, v in kwargs.items() if k != "n"}
        if self.config.n_kwarg_is_ignored:
            return merge_choices(list(await asyncio.gather(*(create(**single) for _ in range(n)))))
        response = await create(**kwargs)
        got = len(response.choices)
        if got == n:
            return response
        if got == 1:
            logger.warning(
                "server %s ignored n=%d and returned one choice; sending separate requests from now on",
                self.name,
                n,
            )
            self.config.n_kwarg_is_ignored = True
            more = await asyncio.gather(*(create(**single) for _ in range(n - 1)))
            return merge_choices([response, *more])
        raise ValueError(f"server {self.name} returned {got} choices for n={n}")

    async def _create(self, path: str, cls: Any, chunk_cls: Any, **kwargs: Any) -> Any:
        """POST ``{base_url}/{path}``; the answer as ``cls`` (``chunk_cls`` chunks for
        ``stream=True``). The answer's policy version (header or body) is recorded."""
        request = OpenAIRequest(kwargs)
        url = request.url(f"{self._base_url()}/{path}")
        headers = {**self._auth, **request.headers} if request.headers else self._auth
        payload = encode_json(request.body)
        _, resp_headers, raw = await self.transport().request(
            "POST", url, payload, headers, request.timeout
        )
        if request.stream:
            self.resolve_version({}, resp_headers)
            return parse_event_stream(raw, chunk_cls, "POST", url)
        data = orjson.loads(raw)
        self.resolve_version(data, resp_headers)
        return build_response(cls, data)

    async def _chat_create(self, **kwargs: Any) -> Any:
        return await self._create("chat/completions", ChatCompletion, ChatCompletionChunk, **kwargs)

    async def _completion_create(self, **kwargs: Any) -> Any:
        return await self._create("completions", Completion, Completion, **kwargs)

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        return await self._n_requests(self._chat_create, kwargs)

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        return await self._n_requests(self._completion_create, kwargs)

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "OpenAIServer cannot return tokens and logprobs; use server_type='vllm' or 'sglang'"
        )

    async def close(self) -> None:
        """Stop the health loop and close the HTTP connections."""
        await super().close()
        await self.close_http()
        sdk, self._sdk = self._sdk, None
        if sdk is not None:
            try:
                await sdk.close()
            except RuntimeError:  # its loop is gone
                pass


def resolve_openai_configs(
    default_server_configs: Union[ServerBaseline, list[APIServerConfig], APIServerConfig],
    openai_config_dict: dict[str, Any],
    yaml_config: dict[str, Any],
    cli_passed_flags: dict[str, Any],
    logger: logging.Logger | None = None,
    *,
    namespace: str = "openai",
) -> Union[ServerBaseline, list[APIServerConfig]]:
    """Combine the env's default server configs with YAML and ``--openai.*`` CLI values.

    - YAML with a list of two or more servers → one ``APIServerConfig`` per entry
      (CLI ``--openai.*`` overrides are then an error: which server would they change?).
    - Defaults with two or more servers and no YAML/CLI → the defaults.
    - A ``ServerBaseline`` (not an ``APIServerConfig``) with no YAML/CLI → kept as is
      (SLURM or the local default servers).
    - Otherwise one ``APIServerConfig`` built from ``openai_config_dict`` (the merge of
      defaults, YAML and CLI, in that order of increasing precedence).

    ``namespace`` resolves another server namespace the same way (``teacher``: the YAML
    ``teacher:`` key and ``--teacher.*`` flags).
    """
    log = logger or logging.getLogger(__name__)
    prefix = f"{namespace}."
    cli_openai = {k: v for k, v in (cli_passed_flags or {}).items() if k.startswith(prefix)}
    yaml_openai = (yaml_config or {}).get(namespace)
    multi_yaml = isinstance(yaml_openai, list) and len(yaml_openai) >= 2
    multi_default = isinstance(default_server_configs, list) and len(default_server_configs) >= 2
    if (multi_yaml or (multi_default and not yaml_openai)) and cli_openai:
        raise ValueError(
            f"--{namespace}.* overrides are not supported when several servers are "
            "configured; edit the YAML server list instead"
        )
    if multi_yaml:
        log.info("using %d servers from the YAML config", len(yaml_openai))
        return [APIServerConfig(**cfg) for cfg in yaml_openai]
    if multi_default and not yaml_openai:
        return list(default_server_configs)  # type: ignore[arg-type]
    if (
        isinstance(default_server_configs, ServerBaseline)
        and not isinstance(default_server_configs, APIServerConfig)
        and not cli_openai
        and not yaml_openai
    ):
        return default_server_configs
    if isinstance(yaml_openai, list) and len(yaml_openai) == 1:
        openai_config_dict = {**yaml_openai[0], **(openai_config_dict or {})}
    return [APIServerConfig(**(openai_config_dict or {}))]
