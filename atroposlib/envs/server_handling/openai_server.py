"""``OpenAIServer``: any OpenAI-compatible endpoint, through the official ``openai`` client."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Union

import openai

from atroposlib.envs.server_handling._common import HttpClientMixin
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)

logger = logging.getLogger(__name__)


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


class OpenAIServer(HttpClientMixin, APIServer):
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

    async def _probe_health(self) -> bool:
        client = self.http_client(min(5.0, float(self.config.timeout)))
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        response = await client.get(f"{str(self.config.base_url).rstrip('/')}/models", headers=headers)
        return response.status_code < 500

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

    async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
        return await self._n_requests(self.openai.chat.completions.create, kwargs)

    async def _completion_wrapper(self, **kwargs: Any) -> Any:
        return await self._n_requests(self.openai.completions.create, kwargs)

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
) -> Union[ServerBaseline, list[APIServerConfig]]:
    """Combine the env's default server configs with YAML and ``--openai.*`` CLI values.

    - YAML with a list of two or more servers → one ``APIServerConfig`` per entry
      (CLI ``--openai.*`` overrides are then an error: which server would they change?).
    - Defaults with two or more servers and no YAML/CLI → the defaults.
    - A ``ServerBaseline`` (not an ``APIServerConfig``) with no YAML/CLI → kept as is
      (SLURM or the local default servers).
    - Otherwise one ``APIServerConfig`` built from ``openai_config_dict`` (the merge of
      defaults, YAML and CLI, in that order of increasing precedence).
    """
    log = logger or logging.getLogger(__name__)
    prefix = "openai."
    cli_openai = {k: v for k, v in (cli_passed_flags or {}).items() if k.startswith(prefix)}
    yaml_openai = (yaml_config or {}).get("openai")
    multi_yaml = isinstance(yaml_openai, list) and len(yaml_openai) >= 2
    multi_default = isinstance(default_server_configs, list) and len(default_server_configs) >= 2
    if (multi_yaml or (multi_default and not yaml_openai)) and cli_openai:
        raise ValueError(
            "--openai.* overrides are not supported when several servers are configured; "
            "edit the YAML server list instead"
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
