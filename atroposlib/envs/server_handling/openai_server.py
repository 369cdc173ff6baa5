"""``OpenAIServer``: any OpenAI-compatible endpoint, through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Union

import openai
import pydantic
from openai.types import Completion
from openai.types.chat import ChatCompletion

from atroposlib.envs.server_handling._common import HttpClientMixin
from atroposlib.envs.server_handling._transport import HttpStatus
from atroposlib.envs.server_handling.policy_version import VersionTracking
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
    is_official_openai,
)

logger = logging.getLogger(__name__)

_SDK_ONLY_KWARGS = ("stream", "extra_headers", "extra_query", "timeout")
"""Request options only the ``openai`` client handles (streaming, per-call headers...)."""

SDK_ENV_VAR = "ATROPOS_OPENAI_SDK"
"""Set to 1 to send every OpenAI-protocol request through the official ``openai`` client."""


def lean_request_body(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON body the ``openai`` client would send for ``kwargs``, or None when the
    request needs the client itself (streaming, per-call headers, query or timeout).

    Omitted values (``openai.NOT_GIVEN`` / ``omit``) are dropped and ``extra_body`` is
    merged into the top level, as the client does.
    """
    for key in _SDK_ONLY_KWARGS:
        value = kwargs.get(key)
        if value is not None and value is not False and not _omitted(value):
            return None
    body = {k: v for k, v in kwargs.items() if k not in _SDK_ONLY_KWARGS and not _omitted(v)}
    extra = body.pop("extra_body", None)
    if isinstance(extra, dict):
        body.update(extra)
    elif extra is not None and not _omitted(extra):
        return None
    return body


def _omitted(value: Any) -> bool:
    return isinstance(value, (openai.NotGiven, getattr(openai, "Omit", openai.NotGiven)))


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
    """

    transport_has_timeout = True  # the HTTP client enforces config.timeout

    def __init__(self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None):
        super().__init__(config, reasoning_config)
        api_key = config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.openai = openai.AsyncClient(
            api_key=api_key,
            base_url=config.base_url or None,
            timeout=config.timeout,
            max_retries=0,  # retries and failover are ours
        )
        # The lean transport sends the same key the client would (OPENAI_API_KEY / "EMPTY").
        self._sdk_auth = {"Authorization": f"Bearer {api_key}"}

    async def _probe_health(self) -> bool:
        status = await self.probe_status(
            f"{str(self.config.base_url).rstrip('/')}/models", min(5.0, float(self.config.timeout))
        )
        return status < 500

    async def _n_requests(self, create: Any, kwargs: dict[str, Any]) -> Any:
        n = int(kwargs.get("n") or 1)
        if n <= 1:
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

    def _use_lean_transport(self) -> bool:
        # api.openai.com keeps the official client (its headers, retries of 5xx bodies...).
        return not is_official_openai(self.config.base_url) and os.environ.get(
            SDK_ENV_VAR, ""
        ) not in (
            "1",
            "true",
        )

    async def _lean_create(self, path: str, cls: Any, sdk_create: Any, **kwargs: Any) -> Any:
        """POST ``{base_url}/{path}`` over the lean transport; falls back to ``sdk_create``
        for requests it does not cover. HTTP errors raise the ``openai`` exception the
        client would have raised (``openai.BadRequestError``...)."""
        body = lean_request_body(kwargs) if self._use_lean_transport() else None
        if body is None:
            return await sdk_create(**kwargs)
        url = f"{str(self.config.base_url).rstrip('/')}/{path}"
        try:
            data = await self.transport().post_json(url, body, headers=self._sdk_auth)
        except TypeError:  # not JSON-encodable as is (e.g. pydantic objects): let the SDK do it
            return await sdk_create(**kwargs)
        except HttpStatus as e:
            raise self._sdk_status_error(e) from None
        return build_response(cls, data)

    def _sdk_status_error(self, e: HttpStatus) -> Exception:
        """The ``openai.APIStatusError`` subclass the official client raises for ``e``."""
        try:  # recent openai releases ship their own httpx fork
            import httpx2 as httpx_mod  # type: ignore[import-not-found]
        except ImportError:
            import httpx as httpx_mod
        request = httpx_mod.Request(e.method, e.url)
        response = httpx_mod.Response(e.status, headers=e.headers, content=e.body, request=request)
        return self.openai._make_status_error_from_response(response)

    async def _chat_create(self, **kwargs: Any) -> Any:
        return await self._lean_create(
            "chat/completions", ChatCompletion, self.openai.chat.completions.create, **kwargs
        )

    async def _completion_create(self, **kwargs: Any) -> Any:
        return await self._lean_create(
            "completions", Completion, self.openai.completions.create, **kwargs
        )

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        response = await self._n_requests(self._chat_create, kwargs)
        self.resolve_version(response)
        return response

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        response = await self._n_requests(self._completion_create, kwargs)
        self.resolve_version(response)
        return response

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "OpenAIServer cannot return tokens and logprobs; use server_type='vllm' or 'sglang'"
        )

    async def close(self) -> None:
        """Stop the health loop and close the HTTP clients."""
        await super().close()
        await self.close_http()
        try:
            await self.openai.close()
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
