"""The OpenAI protocol every server we ship speaks: request models and the error envelope.

serve-model, the managed-server proxy and the fake inference server import their request
models from here, the way every ``serving_*`` module of vLLM imports one ``protocol.py``:

* the **strict** models (:class:`StrictCompletionRequest`, :class:`StrictChatRequest`,
  :class:`StrictGenerateRequest`, :class:`UpdateWeightsRequest`) are for a server that generates
  itself: every field it cannot honour is a 400 naming it;
* the **pass-through** models (:class:`PassThroughChatRequest`,
  :class:`PassThroughCompletionRequest`) check what every OpenAI-compatible server agrees
  on and keep every other field as given, for a server that forwards requests (the proxy)
  or imitates one (the fake server).

Errors: :class:`OpenAIError` and its subclasses, and :func:`install_error_handlers`, which
puts them in OpenAI's envelope, live in :mod:`atroposlib.http.openai_errors` and are
imported from here.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

# The error envelope lives in its own module; the servers import it from here, with the models.
from atroposlib.http.openai_errors import (  # noqa: F401
    ClientGone,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    OpenAIError,
    error_response,
    install_error_handlers,
    unless_disconnected,
    validation_error,
)
from atroposlib.http.security import json_value_problem

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- models


def model_list(names: Any, created: int, owned_by: str, **extra: Any) -> dict[str, Any]:
    """The ``GET /v1/models`` answer: one model card per name, each with ``extra`` fields."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by, **extra}
            for name in names
        ],
    }


# ----------------------------------------------------------------------------- answers

_ID_PREFIX = {
    "chat.completion": "chatcmpl",
    "chat.completion.chunk": "chatcmpl",
    "text_completion": "cmpl",
}


def completion_body(
    object_name: str,
    model: str,
    choices: list[Any],
    *,
    id: str | None = None,  # noqa: A002 (OpenAI's field name)
    created: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The envelope of a completion answer or stream chunk: ``id``, ``object``,
    ``created``, ``model``, ``choices``, then ``extra`` (``usage``, ``version`` ...).

    ``object_name`` is ``"chat.completion"``, ``"chat.completion.chunk"`` or
    ``"text_completion"``; a missing ``id`` is a fresh one with OpenAI's prefix for it
    (``chatcmpl-`` or ``cmpl-``), a missing ``created`` is now. Example::

        completion_body("text_completion", "m", [{"index": 0, "text": "hi", ...}], usage=u)
    """
    return {
        "id": f"{_ID_PREFIX[object_name]}-{uuid.uuid4().hex}" if id is None else id,
        "object": object_name,
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
        **extra,
    }


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChatMessage(BaseModel):
    """One chat message: a ``role`` is required (templates cannot render without one);
    other fields (``reasoning_content``, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Any | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class PassThroughSampling(BaseModel):
    """OpenAI sampling fields checked up front, so a bad value is a 400 naming the field
    rather than an inference server's error; other fields are kept as given."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)


class PassThroughChatRequest(PassThroughSampling):
    """An OpenAI chat request whose other fields pass through (see :class:`PassThroughSampling`)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[dict] | None = None
    tool_choice: Any | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the client sent them (no fields added)."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]


class PassThroughCompletionRequest(PassThroughSampling):
    """An OpenAI text completion request whose other fields pass through."""

    prompt: Union[str, list[str], list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None


_PASSTHROUGH_DROP = frozenset(
    {"model", "stream", "stream_options", "user", "logprobs", "top_logprobs", "messages"}
)


def passthrough(body: BaseModel) -> dict[str, Any]:
    """The request's fields to forward: set or defaulted values, and extras as given
    (``model``, streaming, ``user``, logprobs and ``messages`` are the forwarder's own)."""
    extra = body.model_extra or {}
    return {
        k: v
        for k, v in body.model_dump().items()
        if k not in _PASSTHROUGH_DROP and (v is not None or k in extra)
    }


MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
"""Most stop strings (and stop token ids given in ``stop``) per request."""
MAX_STOP_CHARS = 256
"""Longest stop string: every step re-decodes that many characters' worth of tokens per row."""
MAX_STOP_TOKEN_IDS = 256
MAX_INT32 = 2**31 - 1
"""Upper bound of counts and ids (``top_k``, ``max_tokens``, token ids): far above any real
vocabulary or context, far below what overflows a tensor index."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""What ``torch.Generator.manual_seed`` accepts; anything outside is a 400, never an engine error."""
MIN_TEMPERATURE = 1e-2
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are raised to it (as vLLM does): dividing logits by
a smaller number overflows float32 and turns logprobs into NaN/inf."""

MAX_SEQUENCES_PER_REQUEST = 4096
"""Most completions one ``/v1/completions`` request may ask for (prompts times ``n``): the
engine serves requests in order, so one request asking for 250,000 would hold every other
client back for minutes."""

MAX_MESSAGES = 10_000
"""Most messages in one chat request. Each is validated in Python on the event loop before the
template (off the loop) sees it, and 1.5 million one-word messages (48 MB) held every other
request back for over ten seconds."""

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


def _refuse_invalid_unicode(data: Any) -> Any:
    """400 naming the field for text no tokenizer or UTF-8 encoder takes (lone surrogates)."""
    problem = json_value_problem(data, check_ints=False)
    if problem is not None:
        raise InvalidRequest(f"'{problem[0]}' {problem[1]}", param=problem[0])
    return data


class _Body(BaseModel):
    """A request body: refuses lone UTF-16 surrogates anywhere in it, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return _refuse_invalid_unicode(data)


def _finite(default: float, **kwargs: Any) -> Any:
    """A float field that refuses NaN and infinities (JSON from Python clients can carry them)."""
    return Field(default, allow_inf_nan=False, **kwargs)


class StrictSampling(_Body):
    """Sampling fields of a server that generates itself (serve-model): vLLM names and ranges,
    every value it cannot honour refused with a 400 naming the field."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(1, ge=1, le=MAX_INT32, description="Completions per prompt.")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_INT32, description="Most new tokens per completion."
    )
    temperature: float = _finite(
        1.0,
        ge=0.0,
        le=100.0,
        description=f"0 means greedy; values below {MIN_TEMPERATURE} count as {MIN_TEMPERATURE}.",
    )
    top_p: float = _finite(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(
        -1, ge=-1, le=MAX_INT32, description="Keep the k most likely tokens; -1 or 0: all."
    )
    min_p: float = _finite(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    seed: int | None = Field(
        None, ge=SEED_RANGE[0], le=SEED_RANGE[1], description="Per-request sampling seed."
    )
    stop: str | list[str] | None = Field(None, description="Stop strings (not in the output).")
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end a completion."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the eos token.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string in text.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from text.")
    presence_penalty: float = _finite(
        0.0, ge=-2.0, le=2.0, description="Subtract this from tokens already generated."
    )
    frequency_penalty: float = _finite(
        0.0, ge=-2.0, le=2.0, description="Subtract this times each token's count so far."
    )
    repetition_penalty: float = _finite(
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
    def _stop_strings(cls, v: Any) -> Any:
        items = v if isinstance(v, list) else ([] if v is None else [v])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop entries")
        for item in items:
            if isinstance(item, str) and not item:
                raise ValueError("stop strings must be non-empty")
            if isinstance(item, str) and len(item) > MAX_STOP_CHARS:
                raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters")
            if isinstance(item, int) and not 0 <= item <= MAX_INT32:
                raise ValueError(f"stop token ids must be in [0, {MAX_INT32}]")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> StrictSampling:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("'best_of' must equal 'n'", param="best_of")
        if self.model_extra:
            logger.warning("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


class StrictCompletionRequest(StrictSampling):
    """``POST /v1/completions``."""

    model: str | None = Field(None, description="Served model name.")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text, texts, token ids or lists of token ids."
    )
    max_tokens: int | None = Field(
        16, ge=1, le=MAX_INT32, description="Most new tokens (OpenAI default 16)."
    )
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
    def _no_suffix(self) -> StrictCompletionRequest:
        if self.suffix:
            raise InvalidRequest("'suffix' is not supported", param="suffix")
        count = len(self.prompts())
        if count * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise InvalidRequest(
                f"{count} prompts times n={self.n} asks for more than "
                f"{MAX_SEQUENCES_PER_REQUEST} completions in one request; split it",
                param="prompt" if count > 1 else "n",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class StrictChatMessage(ChatMessage):
    """A chat message a chat template can render: a known role, content as a string or
    OpenAI text parts (needed unless an assistant message carries tool calls)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_needed(self) -> StrictChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only content parts of type 'text' are supported")
        return self


class StrictChatRequest(StrictSampling):
    """``POST /v1/chat/completions``."""

    model: str | None = Field(None, description="Served model name.")
    messages: list[StrictChatMessage] = Field(..., min_length=1, description="The conversation.")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=MAX_INT32, description="Alias of max_tokens."
    )
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
        None,
        description="Extra variables for the chat template (e.g. enable_thinking); a "
        "'chat_template' key counts as a client template.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template used instead of the model's; refused unless the "
        "server runs with --allow-client-chat-template.",
    )
    response_format: dict[str, Any] | None = Field(
        None, description="Only {'type': 'text'} is supported."
    )

    @model_validator(mode="before")
    @classmethod
    def _message_count(cls, data: Any) -> Any:
        # Before field validation: pydantic checks a list's max_length only after validating
        # every item, which is the cost to avoid.
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise InvalidRequest(
                f"{len(messages)} messages is more than the {MAX_MESSAGES} one request may hold",
                param="messages",
            )
        return data

    @model_validator(mode="after")
    def _checks(self) -> StrictChatRequest:
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


class StrictGenerateRequest(StrictSampling):
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
    max_tokens: int | None = Field(
        16, ge=1, le=MAX_INT32, description="Most new tokens (vLLM default 16)."
    )
    stop: str | StrictInt | list[str | StrictInt] | None = Field(
        None,
        description="Stop strings and/or stop token ids (as vLLM accepts them on /generate).",
    )

    @model_validator(mode="after")
    def _no_stream(self) -> StrictGenerateRequest:
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


class UpdateWeightsRequest(_Body):
    """``POST /update_weights``."""

    path: str = Field(..., min_length=1, description="Checkpoint directory (same architecture).")
    version: int | None = Field(
        None,
        ge=0,
        description="Version of the new weights (e.g. the trainer step); must exceed the "
        "served one. Default: the served version plus one.",
    )
