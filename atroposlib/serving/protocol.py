"""Request bodies of the OpenAI-compatible and vLLM-style endpoints.

Unknown fields are accepted (OpenAI clients add new ones often) but logged as
ignored, so nothing is dropped without a trace. Parameters whose values this
server does not implement are rejected with a 400 naming them.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from atroposlib.serving.errors import InvalidRequest
from atroposlib.serving.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


class _Sampling(BaseModel):
    """Sampling fields shared by all generation endpoints (vLLM names and ranges)."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(1, ge=1, description="Completions per prompt.")
    max_tokens: int | None = Field(None, ge=1, description="Most new tokens per completion.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 or 0: all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    seed: int | None = Field(None, description="Per-request sampling seed.")
    stop: str | list[str] | None = Field(None, description="Stop strings (not in the output).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end a completion.")
    ignore_eos: bool = Field(False, description="Keep generating past the eos token.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string in text.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from text.")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtract this from tokens already generated."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtract this times each token's count so far."
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="Divide logits of seen tokens by this (>1 discourages repeats).",
    )
    best_of: int | None = Field(None, description="Must equal n when given.")
    stream: bool = Field(False, description="Stream server-sent events (OpenAI endpoints).")
    stream_options: dict[str, Any] | None = Field(
        None, description="{'include_usage': true} adds a final usage chunk."
    )
    user: str | None = Field(None, description="Accepted and ignored (OpenAI field).")
    return_tokens_as_token_ids: bool = Field(
        False, description="vLLM extension: logprob tokens as 'token_id:N' strings."
    )

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("'best_of' must equal 'n'", param="best_of")
        if self.model_extra:
            logger.warning("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self

    def sampling_params(
        self, max_n: int, logprobs: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """Convert to engine params; ``n`` above ``max_n`` is a 400 naming ``n``."""
        if self.n > max_n:
            raise InvalidRequest(f"'n'={self.n} exceeds this server's limit of {max_n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    model: str | None = Field(None, description="Served model name.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text, texts, token ids or lists of token ids."
    )
    max_tokens: int | None = Field(16, ge=1, description="Most new tokens (OpenAI default 16).")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Return logprobs plus this many alternatives."
    )
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")
    suffix: str | None = Field(None, description="Not implemented: must be empty.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="vLLM extension: logprobs of the prompt."
    )

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @model_validator(mode="after")
    def _no_suffix(self) -> CompletionRequest:
        if self.suffix:
            raise InvalidRequest("'suffix' is not supported", param="suffix")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    """One chat message; content may be a string or OpenAI content parts."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only content parts of type 'text' are supported")
        return self


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    model: str | None = Field(None, description="Served model name.")
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens.")
    logprobs: bool = Field(False, description="Return logprobs of the generated tokens.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per position (needs logprobs)."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Tools given to the template.")
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="Not enforced; 'none' turns off parsing <tool_call> blocks into "
        "tool_calls (done when tools are given).",
    )
    add_generation_prompt: bool = Field(
        True, description="End the prompt with the assistant header."
    )
    continue_final_message: bool = Field(
        False, description="Continue the last assistant message instead of a new one."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template."
    )
    response_format: dict[str, Any] | None = Field(
        None, description="Only {'type': 'text'} is supported."
    )

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequest(
                "only response_format type 'text' is supported", param="response_format"
            )
        if self.continue_final_message and self.add_generation_prompt:
            # vLLM's rule: the two are exclusive; the client must turn one off.
            raise InvalidRequest(
                "'continue_final_message' needs 'add_generation_prompt': false",
                param="continue_final_message",
            )
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class GenerateRequest(_Sampling):
    """vLLM-style ``POST /generate`` (the protocol ``VLLMServer`` speaks).

    ``prompt`` is ``{"prompt_token_ids": [...]}`` or a string; ``logprobs`` is the
    number of alternatives per generated token (0 = only the sampled token).
    """

    prompt: str | dict[str, Any] = Field(..., description="Text or {'prompt_token_ids': ids}.")
    model: str | None = Field(None, description="Ignored when absent; checked when given.")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per generated token."
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="Alternatives per prompt token."
    )
    max_tokens: int | None = Field(16, ge=1, description="Most new tokens (vLLM default 16).")

    @model_validator(mode="after")
    def _no_stream(self) -> GenerateRequest:
        if self.stream:
            raise InvalidRequest("/generate does not stream; use /v1/completions", param="stream")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(v, dict):
            ids = v.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in ids
            ):
                raise ValueError("prompt must be a string or {'prompt_token_ids': [int, ...]}")
        return v


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights``."""

    path: str = Field(..., min_length=1, description="Checkpoint directory (same architecture).")
