"""``TrlVllmServer``: TRL's ``vllm-serve`` (``POST {base_url}/generate/`` → ``completion_ids``).

It returns token ids only, so chat/completion answers are decoded with the tokenizer and
``finish_reason`` is ``"stop"`` when EOS is among the ids, else ``"length"``.

``aiohttp`` and ``AutoTokenizer`` are module attributes looked up at call time, as in the
original, so tests can replace them (``monkeypatch.setattr(trl_vllm_server, "aiohttp", fake)``);
that is why TRL requests open an ``aiohttp.ClientSession`` instead of using the layer's
transport. Their failures are mapped by the same :func:`~.errors.mapped_errors`.
``AutoTokenizer`` is imported from transformers on first access only, which keeps importing
this module cheap.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import aiohttp  # noqa: F401 - a module attribute the original exposes; used via _module()
from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from atroposlib.envs.server_handling._common import config_tokenizer_name
from atroposlib.envs.server_handling.errors import mapped_errors, status_error
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    config_value,
)
from atroposlib.http.openai_protocol import completion_body


def __getattr__(name: str) -> Any:
    if name == "AutoTokenizer":
        value = importlib.import_module("transformers").AutoTokenizer
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _module() -> Any:
    return sys.modules[__name__]


TRL_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "max_tokens": 1024,
}


class TrlVllmServer(APIServer):
    """A TRL ``vllm-serve`` server. Always considered healthy; no tokens/logprobs.

    The tokenizer (chat template, decoding) is ``AutoTokenizer.from_pretrained`` of the
    config's ``tokenizer_name`` (``model_name`` when that is ``"none"``), loaded on first use.
    """

    transport_has_timeout = True  # the aiohttp session enforces config.timeout

    def __init__(self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None):
        super().__init__(config, reasoning_config)
        self._tokenizer_name = config_tokenizer_name(config)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer used for chat templates and decoding (loaded on first use)."""
        if self._tokenizer is None:
            if not self._tokenizer_name:
                raise ValueError("TrlVllmServer needs a tokenizer_name or model_name in its config")
            try:
                self._tokenizer = _module().AutoTokenizer.from_pretrained(self._tokenizer_name)
            except (OSError, ValueError, ImportError) as e:
                raise ValueError(
                    f"TrlVllmServer needs a tokenizer; {self._tokenizer_name!r} failed to load: {e}"
                ) from e
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    def _health_check_enabled(self) -> bool:
        return False

    async def _post_generate(self, url: str, body: dict[str, Any]) -> Any:
        """POST ``body`` with a fresh ``aiohttp`` session (the module attribute, so it can be
        replaced); errors are those of every backend (see :mod:`.errors`)."""
        http = _module().aiohttp
        timeout = http.ClientTimeout(total=float(config_value(self.config, "timeout")))
        api_key = config_value(self.config, "api_key")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        with mapped_errors("POST", url):
            async with http.ClientSession(timeout=timeout) as session:
                async with session.post(url, json=body, headers=headers) as response:
                    status = getattr(response, "status", 200)
                    if isinstance(status, int) and status >= 400:
                        raw = await response.read()
                        raise status_error("POST", url, status, dict(response.headers), raw)
                    return await response.json()

    async def _generate(self, prompt: str, kwargs: dict[str, Any]) -> list[list[int]]:
        body = dict(TRL_DEFAULTS)
        for key in TRL_DEFAULTS:
            if kwargs.get(key) is not None:
                body[key] = kwargs[key]
        if kwargs.get("max_completion_tokens") is not None:
            body["max_tokens"] = kwargs["max_completion_tokens"]
        body["prompts"] = [prompt]
        url = f"{str(self.config.base_url).rstrip('/')}/generate/"
        data = await self._post_generate(url, body)
        return data["completion_ids"]

    def _finish(self, ids: list[int]) -> str:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return "stop" if eos is not None and eos in ids else "length"

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        prompt = self.tokenizer.apply_chat_template(
            kwargs["messages"], tokenize=False, add_generation_prompt=True
        )
        completions = await self._generate(prompt, kwargs)
        choices = [
            Choice(
                index=i,
                finish_reason=self._finish(ids),
                message=ChatCompletionMessage(
                    role="assistant", content=self.tokenizer.decode(ids, skip_special_tokens=True)
                ),
            )
            for i, ids in enumerate(completions)
        ]
        return ChatCompletion(**completion_body("chat.completion", self.config.model_name, choices))

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        completions = await self._generate(kwargs["prompt"], kwargs)
        choices = [
            CompletionChoice(
                index=i,
                finish_reason=self._finish(ids),
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
            )
            for i, ids in enumerate(completions)
        ]
        return Completion(**completion_body("text_completion", self.config.model_name, choices))
