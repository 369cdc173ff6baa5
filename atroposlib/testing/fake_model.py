"""The fake inference server's model: its settings, the request bodies it accepts (with its
bounds), and its byte-level tokens and deterministic generation."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from atroposlib.http.openai_protocol import PassThroughChatRequest, PassThroughCompletionRequest

ALPHABET: bytes = b"abcdefghijklmnopqrstuvwxyz "
"""Byte values the fake model generates (all printable ASCII, one token each)."""

MAX_N = 256
MAX_TOKENS = 65536


class FakeServerSettings(BaseModel):
    """Run-time behaviour of the fake server."""

    latency_ms: float = Field(50.0, ge=0, description="Delay added to every generation request.")
    model_name: str = Field("fake", description="Model id reported by /v1/models and responses.")
    seed: int = Field(0, description="Default seed when a request gives none.")
    ignore_n: bool = Field(
        False, description="Return a single choice whatever n is (like some APIs)."
    )
    fail_status: int | None = Field(
        None, ge=400, le=599, description="When set, every endpoint answers this HTTP status."
    )
    policy_version: int | None = Field(
        None, description="Weight version to report on generation answers (None: report none)."
    )
    policy_version_in: str = Field(
        "body",
        pattern="^(body|header)$",
        description="Where to report it: the JSON body (vLLM/serve-model 'version', SGLang "
        "meta_info.weight_version) or the X-Atropos-Policy-Version header.",
    )


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FakeChatRequest(PassThroughChatRequest):
    """Body of ``POST /v1/chat/completions``: the shared OpenAI model, with the fake's bounds
    (unknown OpenAI fields are accepted and ignored)."""

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class FakeCompletionRequest(PassThroughCompletionRequest):
    """Body of ``POST /v1/completions``: the shared OpenAI model, with the fake's bounds."""

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)


class VLLMPrompt(_Lenient):
    """The ``prompt`` object of the vLLM-style ``/generate``."""

    prompt_token_ids: list[int] = Field(..., min_length=1)


class VLLMGenerateRequest(_Lenient):
    """Body of the vLLM-style ``POST /generate``."""

    prompt: Union[VLLMPrompt, str]
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


class SGLangGenerateRequest(_Lenient):
    """Body of the SGLang-style ``POST /generate``."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=20)


class TrlGenerateRequest(_Lenient):
    """Body of the TRL-style ``POST /generate/``."""

    prompts: list[str] = Field(..., min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int = Field(1024, ge=1, le=MAX_TOKENS)
    seed: int | None = None


def fake_tokenize(text: str) -> list[int]:
    """Byte-level fake tokenization: the UTF-8 bytes of ``text``."""
    return list(text.encode("utf-8"))


def fake_detokenize(ids: list[int]) -> str:
    """Inverse of :func:`fake_tokenize` (invalid sequences are replaced)."""
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def render_messages(messages: list[dict[str, Any]]) -> str:
    """Flatten chat messages to the text the fake model 'sees'."""
    parts = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True)
        parts.append(f"{m.get('role', '')}: {content}\n")
    return "".join(parts)


def fake_generate(
    prompt_ids: list[int], index: int, seed: int, max_tokens: int
) -> tuple[list[int], list[float], str]:
    """Generate ``(token_ids, logprobs, finish_reason)`` for one choice, deterministically.

    The length is between half of ``max_tokens`` and ``max_tokens``; a shorter output
    finishes with ``"stop"``, a full-length one with ``"length"``.
    """
    digest = hashlib.sha256(
        f"{seed}|{index}|".encode() + bytes(i % 256 for i in prompt_ids[-4096:])
    ).digest()
    rng = random.Random(digest)
    length = rng.randint(max(1, max_tokens // 2), max_tokens)
    ids = [rng.choice(ALPHABET) for _ in range(length)]
    logprobs = [-round(rng.random() * 3.0, 6) for _ in range(length)]
    return ids, logprobs, "length" if length >= max_tokens else "stop"


def fake_top_logprobs(token: int, logprob: float, k: int) -> dict[int, float]:
    """A top-``k`` map that contains ``token`` with ``logprob`` plus lower-ranked alternatives."""
    out = {token: logprob}
    alt = 0
    while len(out) < max(k, 1):
        if alt != token:
            out[alt] = logprob - 1.0 - len(out)
        alt += 1
    return out
