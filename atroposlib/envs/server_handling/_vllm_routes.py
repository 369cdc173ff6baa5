"""Which routes a vLLM-type server has, and the requests and answers of vLLM's own routes.

A ``server_type: vllm`` server is one of two kinds: a server with the original's ``POST
/generate`` (``atropos-serve-model``, ``example_trainer.vllm_api_server``), or vLLM's own
OpenAI server, which has no ``/generate`` but serves tokens and logprobs from
``/v1/completions`` with a token-id prompt (``return_token_ids``, ``logprobs``,
``prompt_logprobs``) and, started with ``VLLM_SERVER_DEV_MODE=1``, names its weights at
``GET /weight_info`` (``{"weight_version": "7"}``, set by ``POST /update_weight_version``).
:func:`probe_routes` asks the server once which it is (two GETs, no generation), so that no
rollout is spent finding out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from atroposlib.envs.server_handling._transport import JsonTransport
from atroposlib.envs.server_handling.errors import status_error


@dataclass(frozen=True)
class VLLMRoutes:
    """What one server answers."""

    generate: bool
    """The original's ``POST {root}/generate`` (else ``/v1/completions`` with token ids)."""
    weight_info: bool
    """vLLM's ``GET {root}/weight_info`` (its dev-mode RL routes)."""

    def describe(self) -> str:
        """One line for the log: where tokens and versions come from."""
        tokens = "/generate" if self.generate else "/v1/completions (token-id prompts)"
        if self.generate:
            version = "its answers"
        elif self.weight_info:
            version = "/weight_info"
        else:
            version = "the trainer's updates only (no /weight_info: VLLM_SERVER_DEV_MODE unset)"
        return f"tokens and logprobs via {tokens}; weight version from {version}"


async def probe_routes(transport: JsonTransport, root: str, timeout: float) -> VLLMRoutes:
    """Ask the server at ``root`` which routes it has.

    ``GET /generate`` answers 405 (or a 4xx for the missing body) where the route exists and
    404 where it does not; ``GET /weight_info`` answers 200 where vLLM's dev routes are on.
    Connection errors and 5xx answers raise as a request's would (``openai`` errors, see
    :mod:`.errors`), and nothing is remembered: the next request probes again.
    """
    url = f"{root}/generate"
    status, headers, raw = await transport.request("GET", url, timeout=timeout, raise_status=False)
    if status >= 500:
        raise status_error("GET", url, status, headers, raw)
    if status != 404:  # its answers carry the version; /weight_info is not needed
        return VLLMRoutes(generate=True, weight_info=False)
    info = await read_weight_version(transport, root, timeout)
    return VLLMRoutes(generate=False, weight_info=info is not _MISSING)


_MISSING = object()


async def read_weight_version(transport: JsonTransport, root: str, timeout: float) -> Any:
    """The ``weight_version`` of ``GET {root}/weight_info`` (a string such as ``"7"``, or
    ``"default"`` before any update), or a private marker when the route is absent."""
    status, _, raw = await transport.request(
        "GET", f"{root}/weight_info", timeout=timeout, raise_status=False
    )
    if status != 200:
        return _MISSING
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _MISSING
    return data.get("weight_version") if isinstance(data, dict) else _MISSING


def version_body(weight_version: Any) -> dict[str, Any]:
    """A body for :meth:`~.policy_version.VersionTracking.resolve_version` naming the weight
    version read from ``/weight_info`` (nothing when it was absent)."""
    if weight_version is _MISSING or weight_version is None:
        return {}
    return {"weight_version": weight_version}


def completion_choices(data: Any) -> list[dict[str, Any]]:
    """The choices of a ``/v1/completions`` answer in ``index`` order."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"the completions answer has no choices: {str(data)[:300]}")
    return sorted(choices, key=lambda c: int(c.get("index", 0)))


def tokens_from_choices(
    choices: list[dict[str, Any]],
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """Each choice's sampled token ids (``return_token_ids``), their logprobs (``logprobs:
    0``'s ``token_logprobs``) and finish reason."""
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    finish: list[str] = []
    for choice in choices:
        ids = choice.get("token_ids")
        if ids is None:
            raise ValueError(
                "the completions answer has no token_ids: the server does not support "
                "return_token_ids (vLLM >= 0.10 does)"
            )
        lp_block = choice.get("logprobs") or {}
        lps = lp_block.get("token_logprobs") or []
        if len(lps) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(lps)} logprobs in a choice")
        tokens.append([int(i) for i in ids])
        logprobs.append([float(lp) for lp in lps])
        finish.append(choice.get("finish_reason") or "stop")
    return tokens, logprobs, finish


def prompt_logprobs_of(data: Any) -> list[Any]:
    """The ``prompt_logprobs`` of a one-choice ``/v1/completions`` answer (per position: None
    for the first token, then ``{id: {"logprob": lp, ...}}``)."""
    choice = completion_choices(data)[0]
    found = choice.get("prompt_logprobs")
    if found is None and isinstance(data, dict):
        found = data.get("prompt_logprobs")
    if found is None:
        raise ValueError("the completions answer has no prompt_logprobs")
    return found
