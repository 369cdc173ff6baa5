"""serve-model's request bodies: the strict OpenAI and vLLM-style models of
:mod:`atroposlib.http.openai_protocol`, each able to turn itself into engine
:class:`~atroposlib.serving.sampling.SamplingParams`.
"""

from __future__ import annotations

from atroposlib.http import openai_protocol as protocol
from atroposlib.http.openai_protocol import (  # noqa: F401 - the bounds serve-model names
    MAX_INT32,
    MAX_MESSAGES,
    MAX_SEQUENCES_PER_REQUEST,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    SEED_RANGE,
    InvalidRequest,
    UpdateWeightsRequest,
)
from atroposlib.serving.sampling import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateRequest",
    "UpdateWeightsRequest",
]


class _ToEngine:
    """Turns a validated body's sampling fields into the engine's parameters."""

    def sampling_params(
        self: protocol.StrictSampling,
        max_n: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Convert to engine params; ``n`` above ``max_n`` is a 400 naming ``n``."""
        if self.n > max_n:
            raise InvalidRequest(f"'n'={self.n} exceeds this server's limit of {max_n}", param="n")
        entries = self.stop if isinstance(self.stop, list) else [self.stop]
        stop = [s for s in entries if isinstance(s, str)]
        stop_ids = list(self.stop_token_ids or [])
        stop_ids += [t for t in entries if isinstance(t, int) and t not in stop_ids]
        temperature = self.temperature
        if 0.0 < temperature < MIN_TEMPERATURE:
            temperature = MIN_TEMPERATURE
        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=stop_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )


class CompletionRequest(protocol.StrictCompletionRequest, _ToEngine):
    """``POST /v1/completions``."""


class ChatCompletionRequest(protocol.StrictChatRequest, _ToEngine):
    """``POST /v1/chat/completions``."""


class GenerateRequest(protocol.StrictGenerateRequest, _ToEngine):
    """vLLM-style ``POST /generate``."""
