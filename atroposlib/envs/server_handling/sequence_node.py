"""``SequenceNode``: one tracked sequence of a ``ManagedServer`` (prompt plus completion),
with the trainer's masks and logprobs, and the constants that fill its prompt positions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, PrivateAttr

PROMPT_MASK = -100
PROMPT_LOGPROB = 1.0


class SequenceNode(BaseModel):
    """One tracked sequence: prompt plus completion."""

    full_text: str = Field(..., description="Prompt text followed by the decoded completion.")
    tokens: list[int] = Field(..., description="Prompt and completion token ids.")
    masked_tokens: list[int] = Field(..., description="tokens with -100 on prompt positions.")
    logprobs: list[float] = Field(..., description="Logprobs, 1.0 on prompt positions.")
    metadata: dict[str, Any] | None = Field(None, description="finish_reason and extras.")
    policy_version: int | None = Field(
        None,
        description="Oldest weight version that generated any of this sequence's tokens "
        "(None when the server reports none).",
    )
    policy_version_max: int | None = Field(
        None,
        description="Newest weight version that generated any of its tokens; differs from "
        "policy_version when a multi-turn sequence spans a weight swap.",
    )
    _continuations: tuple[str, ...] = PrivateAttr(default=())
    """Texts besides ``full_text`` that a prompt continuing this sequence may start with: its
    prompt followed by the completion as the caller was shown it (see the module
    ``server_handling._continuations``)."""


def fit_logprobs(logprobs: list[float], length: int) -> list[float]:
    """Pad ``logprobs`` with 1.0 or truncate it to ``length`` entries."""
    if len(logprobs) >= length:
        return list(logprobs[:length])
    return list(logprobs) + [PROMPT_LOGPROB] * (length - len(logprobs))
