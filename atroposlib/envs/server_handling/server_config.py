"""The settings of an inference server (``ServerBaseline``, ``APIServerConfig``) and of the
reasoning parameters injected into its chat requests (``ReasoningConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

ServerType = Literal["openai", "trl", "sglang", "vllm"]

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
VALID_REASONING_EFFORTS = set(REASONING_EFFORTS)
"""The accepted reasoning efforts, as a set (the original's name)."""
EFFORT_TO_MAX_TOKENS: dict[str, int] = {
    "none": 1024,
    "minimal": 3200,
    "low": 6400,
    "medium": 16000,
    "high": 25600,
    "xhigh": 30400,
}


def invalid_effort_message(value: Any) -> str:
    """The error for a reasoning effort outside :data:`REASONING_EFFORTS` (value and choices)."""
    return f"Invalid reasoning_effort {value!r}. Must be one of: {', '.join(REASONING_EFFORTS)}"


class ServerBaseline(BaseModel):
    """Settings shared by every inference server (and the template for discovered servers)."""

    timeout: int = Field(1200, description="Seconds before a request to the server times out.")
    num_max_requests_at_once: int = Field(
        512,
        ge=1,
        description="Maximum concurrent training requests to the server "
        "(divide by n when you request n completions at once).",
    )
    num_requests_for_eval: int = Field(
        64, ge=1, description="Maximum concurrent evaluation requests to the server."
    )
    model_name: str = Field("default", description="Model name sent with every request.")
    rolling_buffer_length: int = Field(
        1000, ge=1, description="Number of recent requests kept for timing metrics."
    )
    server_type: ServerType = Field(
        "openai", description="Backend type: openai, trl, sglang or vllm."
    )
    tokenizer_name: str = Field(
        "none", description="Tokenizer to load for this server ('none' means use model_name)."
    )


class APIServerConfig(ServerBaseline):
    """Connection settings for one OpenAI-compatible inference server."""

    api_key: str | None = Field("", description="API key sent to the server.")
    base_url: str | None = Field(
        "", description="Base URL of the server, e.g. http://localhost:9001/v1."
    )
    n_kwarg_is_ignored: bool = Field(
        False,
        description="The server ignores the n argument; send n separate requests instead.",
    )
    health_check: bool = Field(
        True, description="Probe the server in the background and route around it when down."
    )


OpenaiConfig = APIServerConfig
"""Older name of :class:`APIServerConfig`, kept for environments that import it."""

_CONFIG_DEFAULTS: dict[str, Any] = {
    name: field.default for name, field in APIServerConfig.model_fields.items()
}


def config_value(config: Any, name: str) -> Any:
    """``config.<name>``, or the ``APIServerConfig`` default when ``config`` lacks it.

    Servers built by users' tests often carry a minimal config object (say, a class with
    only ``model_name``); the request path reads every optional setting through here so
    that such a server works with the defaults.
    """
    return getattr(config, name, _CONFIG_DEFAULTS[name])


class ReasoningConfig(BaseModel):
    """Reasoning ("thinking") settings injected into chat completion requests.

    Setting ``effort`` or ``max_tokens`` enables reasoning.

    Example::

        ReasoningConfig(effort="high").build_extra_body("https://openrouter.ai/api/v1")
        # {"reasoning": {"enabled": True, "effort": "high"}}
    """

    enabled: bool | None = Field(False, description="Ask the server for reasoning output.")
    effort: str | None = Field(
        None, description="Reasoning effort: none, minimal, low, medium, high or xhigh."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Token budget for reasoning (used when effort is not set)."
    )

    EFFORT_TO_MAX_TOKENS: ClassVar[dict[str, int]] = EFFORT_TO_MAX_TOKENS
    """Token budget per effort, used by ``build_extra_body(use_max_tokens=True)``."""

    @model_validator(mode="after")
    def _auto_enable(self) -> ReasoningConfig:
        if self.effort is not None and self.effort not in REASONING_EFFORTS:
            raise ValueError(invalid_effort_message(self.effort))
        self.enabled = bool(self.enabled)
        if self.effort is not None or self.max_tokens is not None:
            self.enabled = True
        return self

    @classmethod
    def from_env_config(cls, env_config: Any) -> ReasoningConfig:
        """The reasoning settings of an env config (``thinking_mode``, ``reasoning_effort``,
        ``max_reasoning_tokens``); fields the config lacks count as unset."""
        return cls(
            enabled=bool(getattr(env_config, "thinking_mode", False)),
            effort=getattr(env_config, "reasoning_effort", None),
            max_tokens=getattr(env_config, "max_reasoning_tokens", None),
        )

    def is_reasoning_kwargs_active(self) -> bool:
        """Whether chat requests get reasoning parameters injected (``build_extra_body`` is
        not None): reasoning is enabled, or an effort or token budget is set."""
        return bool(self.enabled) or self.effort is not None or self.max_tokens is not None

    def build_extra_body(
        self, base_url: str | None = None, use_max_tokens: bool = False
    ) -> dict[str, Any] | None:
        """The ``extra_body`` that asks ``base_url`` for reasoning, or None when disabled.

        ``use_max_tokens`` converts an effort into a token budget with
        :data:`EFFORT_TO_MAX_TOKENS` (for providers that only take budgets).
        """
        if not self.is_reasoning_kwargs_active():
            return None
        if is_official_openai(base_url):
            return {"reasoning_effort": self.effort or "medium"}
        reasoning: dict[str, Any] = {"enabled": True}
        if self.effort is not None and use_max_tokens:
            reasoning["max_tokens"] = self.EFFORT_TO_MAX_TOKENS[self.effort]
        elif self.effort is not None:
            reasoning["effort"] = self.effort
        elif self.max_tokens is not None:
            reasoning["max_tokens"] = self.max_tokens
        return {"reasoning": reasoning}


def is_official_openai(base_url: str | None) -> bool:
    """True when ``base_url`` points at api.openai.com."""
    return bool(base_url) and "api.openai.com" in str(base_url)
