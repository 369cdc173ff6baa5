"""``VLLMServer``: vLLM's own OpenAI server, or a server with the original's ``/generate``.

Chat and text completions go through the OpenAI-compatible ``/v1`` API. Tokens and logprobs
come from whichever the server has, found out once per server (:mod:`._vllm_routes`, said
in the log):

- the original's ``POST {root}/generate`` (``atropos-serve-model``,
  ``example_trainer.vllm_api_server``)::

    {"prompt": {"prompt_token_ids": [...]}, "logprobs": 0, "n": 2, "max_tokens": 64, ...}
    -> {"text": [...], "token_ids": [[...]], "logprobs": [[[{"id": lp}], ...]], "finish_reasons": [...]}

- vLLM's own ``POST /v1/completions`` with a token-id prompt, ``return_token_ids`` and
  ``logprobs: 0`` (``prompt_logprobs: k`` for :meth:`get_logprobs`).

The weight version of an answer comes from the ``X-Atropos-Policy-Version`` header or the
body's ``version`` (see :mod:`.policy_version`); against vLLM's own server, from its
``GET /weight_info`` read before the request (the oldest weights that can have contributed).
It rides on the returned tuple.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from atroposlib.envs.server_handling._common import (
    GenerateEndpointMixin,
    drop_none,
    generate_sampling_kwargs,
    root_url,
)
from atroposlib.envs.server_handling._vllm_routes import (
    VLLMRoutes,
    completion_choices,
    probe_routes,
    prompt_logprobs_of,
    read_weight_version,
    tokens_from_choices,
    version_body,
)
from atroposlib.envs.server_handling.openai_server import (  # noqa: F401 - original import path
    OpenAIServer,
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.policy_version import TokensResult

logger = logging.getLogger(__name__)

_RENAMED = ("max_new_tokens", "max_completion_tokens")


def _entry_items(entry: Any) -> list[tuple[int, float]]:
    """``[{id: lp}, ...]`` or ``{id: lp, ...}`` (ids as str or int) → ``[(id, lp), ...]``."""
    if entry is None:
        return []
    if isinstance(entry, dict):
        dicts = [entry]
    else:
        dicts = [d for d in entry if isinstance(d, dict)]
    items: list[tuple[int, float]] = []
    for d in dicts:
        for k, v in d.items():
            lp = v.get("logprob") if isinstance(v, dict) else v
            items.append((int(k), float(lp)))
    return items


def parse_generate_logprobs(
    token_ids: list[int] | None, position_entries: list[Any]
) -> tuple[list[int], list[float]]:
    """The sampled tokens and their logprobs from one sequence's ``logprobs`` entries."""
    ids: list[int] = []
    lps: list[float] = []
    for pos, entry in enumerate(position_entries):
        items = _entry_items(entry)
        wanted = token_ids[pos] if token_ids is not None and pos < len(token_ids) else None
        chosen = next((it for it in items if it[0] == wanted), None) if wanted is not None else None
        if chosen is None:
            chosen = items[0] if items else (wanted if wanted is not None else 0, 0.0)
        ids.append(wanted if wanted is not None else chosen[0])
        lps.append(chosen[1])
    return ids, lps


def topk_from_prompt_logprobs(
    prompt_tokens: list[int], prompt_logprobs: list[Any], top_k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Shape ``[pos][k]`` id and logprob lists, best first.

    A position without data (vLLM gives None for the first token) gets the prompt token
    itself with logprob 0.0 repeated; short rows are padded with their last entry.
    """
    ids_out: list[list[int]] = []
    lps_out: list[list[float]] = []
    for pos, tok in enumerate(prompt_tokens):
        entry = prompt_logprobs[pos] if pos < len(prompt_logprobs) else None
        items = sorted(_entry_items(entry), key=lambda it: -it[1])[:top_k]
        if not items:
            items = [(tok, 0.0)]
        while len(items) < top_k:
            items.append(items[-1])
        ids_out.append([i for i, _ in items])
        lps_out.append([lp for _, lp in items])
    return ids_out, lps_out


class VLLMServer(GenerateEndpointMixin, OpenAIServer):
    """A vLLM server that also serves the custom ``/generate`` endpoint.

    The tokenizer (``tokenizer_name``, or ``model_name`` when that is "none") is loaded
    only when needed: to tokenize a text ``prompt`` and to drop a duplicated leading BOS.
    Against vLLM's own server (no ``/generate``) the same calls go to ``/v1/completions``.
    """

    _routes: VLLMRoutes | None = None
    _routes_lock: asyncio.Lock | None = None

    async def routes(self) -> VLLMRoutes:
        """The routes this server has: probed on first use, then remembered (and logged)."""
        if self._routes is not None:
            return self._routes
        if self._routes_lock is None:
            self._routes_lock = asyncio.Lock()
        async with self._routes_lock:
            if self._routes is None:
                root = root_url(self.config.base_url)
                timeout = min(30.0, float(self.config.timeout))
                found = await probe_routes(self.transport(), root, timeout)
                logger.info("vLLM-type server %s: %s", root, found.describe())
                self._routes = found
        return self._routes

    @staticmethod
    def _normalize_topk_entry(token_logprobs_entry: Any) -> tuple[list[int], list[float]]:
        """One position of vLLM's prompt or sample logprobs (``{id: lp}``, ``{id: {"logprob":
        lp}}``, or a list of such dicts; ids as str or int) as ``(ids, logprobs)``, best
        first; ``([], [])`` for None."""
        items = sorted(_entry_items(token_logprobs_entry), key=lambda it: -it[1])
        return [i for i, _ in items], [lp for _, lp in items]

    async def _probe_health(self) -> bool:
        status = await self.probe_status(
            f"{root_url(self.config.base_url)}/health", min(5.0, float(self.config.timeout))
        )
        return status == 200

    def _prompt_ids(self, kwargs: dict[str, Any]) -> list[int]:
        ids = self.pop_prompt_ids(kwargs)
        bos = getattr(self._tokenizer, "bos_token_id", None) if self._tokenizer else None
        if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    @staticmethod
    def _sampling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        out = generate_sampling_kwargs(kwargs)
        for key in _RENAMED:
            if key in out:
                value = out.pop(key)
                out.setdefault("max_tokens", value)
        return drop_none(out)

    def _completions_url(self) -> str:
        return f"{root_url(self.config.base_url)}/v1/completions"

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        if not (await self.routes()).generate:
            return await self._tokens_via_completions(kwargs)
        prompt_ids = self._prompt_ids(kwargs)
        body = {
            **self._sampling_kwargs(kwargs),
            "prompt": {"prompt_token_ids": prompt_ids},
            "logprobs": 0,
        }
        data, version = await self.post_generate(body)
        token_ids = data.get("token_ids") or [None] * len(data.get("logprobs", []))
        output_tokens, output_logprobs = [], []
        for seq_ids, seq_lps in zip(token_ids, data.get("logprobs", []), strict=False):
            ids, lps = parse_generate_logprobs(seq_ids, seq_lps)
            output_tokens.append(ids)
            output_logprobs.append(lps)
        finish = list(data.get("finish_reasons") or ["stop"] * len(output_tokens))
        return TokensResult((prompt_ids, output_tokens, output_logprobs, finish), version)

    async def _tokens_via_completions(self, kwargs: dict[str, Any]) -> TokensResult:
        """Tokens and logprobs from vLLM's ``/v1/completions`` with a token-id prompt."""
        prompt_ids = self._prompt_ids(kwargs)
        body = {
            **self._sampling_kwargs(kwargs),
            "model": self.config.model_name,
            "prompt": prompt_ids,
            "logprobs": 0,
            "return_token_ids": True,
        }
        body.pop("prompt_logprobs", None)
        weight_version = None
        if self._routes is not None and self._routes.weight_info:
            # Read before generating: an update during the request makes the answer newer, and
            # a sequence is stamped with the oldest weights that can have produced it.
            root = root_url(self.config.base_url)
            weight_version = await read_weight_version(
                self.transport(), root, min(30.0, float(self.config.timeout))
            )
        data, headers = await self.fast_post_json_with_headers(self._completions_url(), body)
        output_tokens, output_logprobs, finish = tokens_from_choices(completion_choices(data))
        version = self.resolve_version(version_body(weight_version), headers)
        return TokensResult((prompt_ids, output_tokens, output_logprobs, finish), version)

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> Any:
        top_k = self.pop_top_k(kwargs)
        prompt_ids = self._prompt_ids(kwargs)
        if not (await self.routes()).generate:
            body = {
                "model": self.config.model_name,
                "prompt": prompt_ids,
                "prompt_logprobs": top_k,
                "n": 1,
                "temperature": 0.0,
                "max_tokens": 1,
            }
            data = await self.fast_post_json(self._completions_url(), body)
            ids, lps = topk_from_prompt_logprobs(prompt_ids, prompt_logprobs_of(data), top_k)
            return {
                "prompt_tokens": prompt_ids,
                "prompt_topk_token_ids": ids,
                "prompt_topk_logprobs": lps,
            }
        body = {
            "prompt": {"prompt_token_ids": prompt_ids},
            "prompt_logprobs": top_k,
            "n": 1,
            "temperature": 0.0,
            "top_p": 1.0,
            "max_tokens": 1,
        }
        data = await self.fast_post_json(self.generate_url(), body)
        prompt_lps = data.get("prompt_logprobs") or []
        if prompt_lps and isinstance(prompt_lps[0], list) and len(prompt_lps) == 1:
            prompt_lps = prompt_lps[0]  # one list per prompt
        ids, lps = topk_from_prompt_logprobs(prompt_ids, prompt_lps, top_k)
        return {
            "prompt_tokens": prompt_ids,
            "prompt_topk_token_ids": ids,
            "prompt_topk_logprobs": lps,
        }
