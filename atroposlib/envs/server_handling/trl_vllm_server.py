"""``TrlVllmServer``: TRL's ``vllm-serve`` (``POST {base_url}/generate/`` → ``completion_ids``).

It returns token ids only, so chat/completion answers are decoded with the tokenizer and
``finish_reason`` is ``"stop"`` when EOS is among the ids, else ``"length"``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from atroposlib.envs.server_handling._common import (
    HttpClientMixin,
    config_tokenizer_name,
    load_tokenizer,
)
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
)

TRL_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "max_tokens": 1024,
}


class TrlVllmServer(HttpClientMixin, APIServer):
    """A TRL ``vllm-serve`` server. Always considered healthy; no tokens/logprobs."""

    transport_has_timeout = True  # the HTTP client enforces config.timeout

    def __init__(self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None):
        super().__init__(config, reasoning_config)
        self._tokenizer_name = config_tokenizer_name(config)
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer used for chat templates and decoding (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self._tokenizer_name)
            if self._tokenizer is None:
                raise ValueError(
                    f"TrlVllmServer needs a tokenizer; {self._tokenizer_name!r} failed to load"
                )
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    def _health_check_enabled(self) -> bool:
        return False

    async def _generate(self, prompt: str, kwargs: dict[str, Any]) -> list[list[int]]:
        body = dict(TRL_DEFAULTS)
        for key in TRL_DEFAULTS:
            if kwargs.get(key) is not None:
                body[key] = kwargs[key]
        if kwargs.get("max_completion_tokens") is not None:
            body["max_tokens"] = kwargs["max_completion_tokens"]
        body["prompts"] = [prompt]
        url = f"{str(self.config.base_url).rstrip('/')}/generate/"
        data = await self.fast_post_json(url, body)
        return data["completion_ids"]

    def _finish(self, ids: list[int]) -> str:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return "stop" if eos is not None and eos in ids else "length"

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        prompt = self.tokenizer.apply_chat_template(
            kwargs["messages"], tokenize=False, add_generation_prompt=True
        )
        completions = await self._generate(prompt, kwargs)
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            object="chat.completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                Choice(
                    index=i,
                    finish_reason=self._finish(ids),
                    message=ChatCompletionMessage(
                        role="assistant",
                        content=self.tokenizer.decode(ids, skip_special_tokens=True),
                    ),
                )
                for i, ids in enumerate(completions)
            ],
        )

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        completions = await self._generate(kwargs["prompt"], kwargs)
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    finish_reason=self._finish(ids),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                )
                for i, ids in enumerate(completions)
            ],
        )

    async def close(self) -> None:
        """Close the HTTP client."""
        await super().close()
        await self.close_http()
