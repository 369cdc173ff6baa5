"""``SGLangServer``: SGLang's native ``/generate`` for tokens and logprobs.

``POST {root}/generate`` with ``{"input_ids", "sampling_params", "return_logprob": true}``;
the answer's ``meta_info.output_token_logprobs`` holds ``(logprob, token_id, text)``
tuples and ``meta_info.finish_reason`` is a string or ``{"type": ...}``. The weight version
comes from the ``X-Atropos-Policy-Version`` header or ``meta_info.weight_version`` (SGLang's
``--weight-version``), see :mod:`.policy_version`.
"""

from __future__ import annotations

from typing import Any

from atroposlib.envs.server_handling._common import (
    GenerateEndpointMixin,
    drop_none,
    generate_sampling_kwargs,
)
from atroposlib.envs.server_handling.openai_server import (  # noqa: F401 - original import path
    OpenAIServer,
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.policy_version import TokensResult


def parse_sglang_output(item: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """``(token_ids, logprobs, finish_reason)`` of one SGLang ``/generate`` result."""
    meta = item.get("meta_info") or {}
    triples = meta.get("output_token_logprobs") or []
    ids = [int(t[1]) for t in triples]
    lps = [float(t[0]) if t[0] is not None else 0.0 for t in triples]
    if not ids and item.get("output_ids") is not None:
        ids = [int(t) for t in item["output_ids"]]
        lps = [0.0] * len(ids)
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        finish = finish.get("type")
    return ids, lps, str(finish or "stop")


class SGLangServer(GenerateEndpointMixin, OpenAIServer):
    """An SGLang server: OpenAI API for chat/completions, native ``/generate`` for tokens."""

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
        input_ids = self.pop_prompt_ids(kwargs)
        sampling = generate_sampling_kwargs(kwargs)
        for key in ("max_tokens", "max_completion_tokens"):
            if key in sampling:
                sampling.setdefault("max_new_tokens", sampling.pop(key))
        body = {
            "input_ids": input_ids,
            "sampling_params": drop_none(sampling),
            "return_logprob": True,
            "return_text_in_logprobs": False,
        }
        data, version = await self.post_generate(body)
        items = data if isinstance(data, list) else [data]
        tokens, logprobs, finishes = [], [], []
        for item in items:
            ids, lps, finish = parse_sglang_output(item)
            tokens.append(ids)
            logprobs.append(lps)
            finishes.append(finish)
        return TokensResult((input_ids, tokens, logprobs, finishes), version)

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> Any:
        top_k = self.pop_top_k(kwargs)
        input_ids = self.pop_prompt_ids(kwargs)
        body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": top_k,
            "return_text_in_logprobs": False,
        }
        data = await self.fast_post_json(self.generate_url(), body)
        meta = (data[0] if isinstance(data, list) else data).get("meta_info") or {}
        rows = meta.get("input_top_logprobs") or []
        ids_out, lps_out = [], []
        for pos, tok in enumerate(input_ids):
            row = rows[pos] if pos < len(rows) and rows[pos] else [(0.0, tok, None)]
            row = sorted(row, key=lambda t: -(t[0] if t[0] is not None else 0.0))[:top_k]
            while len(row) < top_k:
                row.append(row[-1])
            ids_out.append([int(t[1]) for t in row])
            lps_out.append([float(t[0]) if t[0] is not None else 0.0 for t in row])
        return {
            "prompt_tokens": input_ids,
            "prompt_topk_token_ids": ids_out,
            "prompt_topk_logprobs": lps_out,
        }
