"""The parts of ``example_trainer.vllm_api_server`` that need no vLLM.

The server itself (routes over vLLM's ``AsyncLLM``) lives in
:mod:`example_trainer.vllm_api_server`; what can be decided without an engine is here, so it
is tested without vLLM and read in one place:

- the original's bridge models (:class:`BridgeState`, :class:`BridgeInfoResponse`,
  :class:`LoraLoadRequest`, :class:`LoraStatusResponse`);
- :func:`parse_generate`: a ``POST /generate`` body -> the prompt and sampling keywords for
  vLLM, every bound checked first (a 400 naming the field, never a 500);
- :func:`generate_answer`: vLLM's outputs -> the original's answer
  ``{"text", "prompt", "finish_reasons"[, "logprobs", "prompt_token_ids", "token_ids"]}``;
- :func:`shared_weights_requested` / :func:`shared_weights_problem`: the single-copy mode
  (``VLLM_ENABLE_SHARED_WEIGHTS=1``) and the one line it fails with where it cannot run;
- :func:`available_adapters`: the adapters ``/lora/status`` lists.

Example::

    call = parse_generate({"prompt": "Hi", "max_tokens": 4, "logprobs": 0}, {"min_tokens"})
    call.sampling["max_tokens"]  # 4
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Sequence

from pydantic import BaseModel, Field, ValidationError

from atroposlib.http.openai_protocol import (
    MIN_TEMPERATURE,
    InvalidRequest,
    StrictGenerateRequest,
    validation_error,
)

__all__ = [
    "BridgeInfoResponse",
    "BridgeState",
    "GenerateCall",
    "LOGPROB_FLOOR",
    "LoraLoadRequest",
    "LoraStatusResponse",
    "available_adapters",
    "generate_answer",
    "parse_generate",
    "shared_weights_problem",
    "shared_weights_requested",
]

LOGPROB_FLOOR = -9999.0
"""Reported logprobs are floored here (vLLM's convention): ``-inf`` is not JSON."""

MAX_N = 256
"""Most completions one ``/generate`` asks for (``n``); more is a 400 naming ``n``."""

# Fields StrictGenerateRequest checks and hands to vLLM under the same name. ``top_k`` -1 (ours and
# the original's "all") is vLLM's 0.
_CHECKED = (
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
)
# Accepted by StrictGenerateRequest but meaningless to vLLM's SamplingParams.
_NOT_SAMPLING = {"model", "prompt", "stream", "stream_options", "user", "best_of"}
# SamplingParams fields a client must not set: how outputs come back is the server's choice.
_SERVER_OWNED = {"output_kind", "detokenize", "flat_logprobs", "skip_clone", "extra_args"}


@dataclass
class BridgeState:
    """What the bridge routes remember: weight updates and the active LoRA adapter."""

    update_count: int = 0
    last_update_time: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    active_lora_path: str | None = None
    active_lora_name: str | None = None
    active_lora_id: int = 0
    lora_load_count: int = 0


class BridgeInfoResponse(BaseModel):
    """``GET /bridge/info``."""

    enabled: bool
    update_count: int
    last_update_time: float
    model_name: str
    device: str


class LoraLoadRequest(BaseModel):
    """``POST /lora/load``: a PEFT adapter directory, and the name to serve it under."""

    adapter_path: str = Field(..., min_length=1, description="PEFT adapter directory.")
    adapter_name: str | None = Field(None, description="Default: adapter_<load count>.")


class LoraStatusResponse(BaseModel):
    """``GET /lora/status``."""

    lora_available: bool
    active_adapter_path: str | None
    active_adapter_name: str | None
    active_adapter_id: int | None
    load_count: int
    available_adapters: List[str]


@dataclass(frozen=True)
class GenerateCall:
    """A checked ``/generate`` body: the prompt for vLLM and its sampling keywords."""

    prompt: dict[str, Any]
    """``{"prompt_token_ids": [...]}`` or ``{"prompt": text}`` (vLLM's token/text prompt)."""
    prompt_text: str | None
    sampling: dict[str, Any]
    want_logprobs: bool
    want_prompt_logprobs: bool


def parse_generate(body: Any, sampling_fields: Iterable[str]) -> GenerateCall:
    """Check a ``/generate`` body and turn it into vLLM's prompt and sampling keywords.

    Every field the original passed to ``SamplingParams`` is accepted; the common ones are
    checked against their bounds here (:class:`~atroposlib.http.openai_protocol.StrictGenerateRequest`:
    ``temperature`` 0-100, ``top_p`` in (0, 1], ``logprobs`` 0-20, ...), the others
    (``sampling_fields``: the names vLLM's ``SamplingParams`` has, e.g. ``min_tokens``) go
    through for vLLM to check. Anything else is a 400 naming it (:class:`InvalidRequest`).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required", param="prompt")
    known = StrictGenerateRequest.model_fields
    extras = {k: v for k, v in body.items() if k not in known}
    try:
        req = StrictGenerateRequest.model_validate({k: v for k, v in body.items() if k in known})
    except ValidationError as e:
        raise validation_error(e) from None
    except InvalidRequest:
        raise
    if req.n > MAX_N:
        raise InvalidRequest(f"'n'={req.n} exceeds this server's limit of {MAX_N}", param="n")
    allowed = set(sampling_fields) - _SERVER_OWNED
    sampling: dict[str, Any] = {}
    for name, value in extras.items():
        if name not in allowed:
            raise InvalidRequest(f"unknown sampling parameter '{name}'", param=name)
        sampling[name] = value
    for name in _CHECKED:
        value = getattr(req, name)
        if value is not None:
            sampling[name] = value
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0
    temperature = sampling.get("temperature", 1.0)
    if 0.0 < temperature < MIN_TEMPERATURE:
        sampling["temperature"] = MIN_TEMPERATURE
    entries = req.stop if isinstance(req.stop, list) else ([] if req.stop is None else [req.stop])
    stop = [s for s in entries if isinstance(s, str)]
    stop_ids = [t for t in entries if isinstance(t, int)]
    if stop:
        sampling["stop"] = stop
    if stop_ids:
        sampling["stop_token_ids"] = list(sampling.get("stop_token_ids") or []) + stop_ids
    if isinstance(req.prompt, str):
        prompt: dict[str, Any] = {"prompt": req.prompt}
        text: str | None = req.prompt
    else:
        ids = list(req.prompt["prompt_token_ids"])
        if not ids:
            raise InvalidRequest("'prompt.prompt_token_ids' is empty", param="prompt")
        prompt, text = {"prompt_token_ids": ids}, None
    return GenerateCall(
        prompt=prompt,
        prompt_text=text,
        sampling=sampling,
        want_logprobs=req.logprobs is not None,
        want_prompt_logprobs=req.prompt_logprobs is not None,
    )


def _finite(value: float) -> float:
    return value if math.isfinite(value) else (LOGPROB_FLOOR if value < 0 else 0.0)


def _position(entry: Mapping[int, Any] | None) -> dict[int, float] | None:
    """One position's ``{token_id: logprob}`` (vLLM's ``Logprob`` objects or floats)."""
    if entry is None:
        return None
    return {int(tid): _finite(float(getattr(lp, "logprob", lp))) for tid, lp in entry.items()}


@dataclass(frozen=True)
class OutputView:
    """What :func:`generate_answer` reads of one vLLM ``CompletionOutput``."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[Mapping[int, Any]] | None
    finish_reason: str | None


def generate_answer(
    prompt_text: str,
    prompt_token_ids: Sequence[int],
    outputs: Sequence[Any],
    want_logprobs: bool,
    prompt_logprobs: Sequence[Mapping[int, Any] | None] | None = None,
) -> dict[str, Any]:
    """The original's ``/generate`` answer.

    ``{"text": [...], "prompt": text, "finish_reasons": [...]}``; with logprobs requested also
    ``"logprobs"`` (``[seq][pos] = [{token_id: logprob, ...}]``: one dict per position holding
    the sampled token and the requested alternatives, as vLLM reports them),
    ``"prompt_token_ids"`` and ``"token_ids"``. With ``prompt_logprobs`` requested (an
    addition: the original dropped them) ``"prompt_logprobs"`` is ``[None, {id: lp}, ...]``.
    ``outputs`` are vLLM ``CompletionOutput`` objects or anything with their attributes.
    """
    answer: dict[str, Any] = {
        "text": [o.text for o in outputs],
        "prompt": prompt_text,
        "finish_reasons": [o.finish_reason for o in outputs],
    }
    if want_logprobs:
        answer["logprobs"] = [
            [[_position(entry) or {}] for entry in (o.logprobs or [])] for o in outputs
        ]
        answer["prompt_token_ids"] = list(prompt_token_ids)
        answer["token_ids"] = [list(o.token_ids) for o in outputs]
    if prompt_logprobs is not None:
        answer["prompt_logprobs"] = [_position(entry) for entry in prompt_logprobs]
    return answer


def shared_weights_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the single-copy mode is asked for: ``VLLM_ENABLE_SHARED_WEIGHTS=1`` (what
    ``weight_bridge_mode shared_vllm`` sets) or ``NUM_INFERENCE_NODES`` >= 0, as in the original."""
    env = os.environ if env is None else env
    if env.get("VLLM_ENABLE_SHARED_WEIGHTS", "0") == "1":
        return True
    try:
        return int(env.get("NUM_INFERENCE_NODES", "-1")) >= 0
    except ValueError:
        return False


def shared_weights_problem(cuda_available: bool) -> str | None:
    """The one line the server exits with when single-copy mode cannot run, else None."""
    if cuda_available:
        return None
    return (
        "vllm_api_server: VLLM_ENABLE_SHARED_WEIGHTS=1 (weight_bridge_mode shared_vllm) needs "
        "CUDA: the trainer and vLLM share one copy of the weights through vLLM's IPC weight "
        "transfer, which works on CUDA devices only, and this machine has none; unset it and "
        "use weight_bridge_mode http_reload (or lora_only, lora_restart, none) instead"
    )


def available_adapters(log_dir: str | os.PathLike[str]) -> list[str]:
    """Sub-directories of ``log_dir`` holding an ``adapter_config.json``, sorted."""
    root = Path(log_dir)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.iterdir() if p.is_dir() and (p / "adapter_config.json").is_file()
    )
