"""Pure builders of OpenAI / vLLM response payloads from engine results."""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

from atroposlib.http.openai_protocol import completion_body, usage_body
from atroposlib.serving.engine import GenerationResult, SequenceOutput

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

MIN_LOGPROB = -9999.0
"""Floor of reported logprobs (vLLM's): JSON has no -inf or NaN, and a -inf (a token the
model masks out) or NaN (numerical overflow) must not turn an answer into invalid JSON or a 500."""


def finite_logprob(value: float) -> float:
    """``value`` clamped to ``[MIN_LOGPROB, 0]``; NaN becomes ``MIN_LOGPROB``."""
    if math.isnan(value):
        return MIN_LOGPROB
    return min(max(value, MIN_LOGPROB), 0.0)


def usage(results: list[GenerationResult]) -> dict[str, int]:
    """OpenAI ``usage``: prompt tokens once per prompt, completion tokens of every choice."""
    prompt = sum(len(r.prompt_ids) for r in results)
    completion = sum(len(o.token_ids) for r in results for o in r.outputs)
    return usage_body(prompt, completion)


def token_text(tokenizer: Any, token_id: int, as_ids: bool = False) -> str:
    """Text of one token as OpenAI logprobs show it (``token_id:N`` when ``as_ids``)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any, out: SequenceOutput, offset: int = 0, as_ids: bool = False
) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, offsets)."""
    tokens = [token_text(tokenizer, t, as_ids) for t in out.token_ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    tops = [
        {token_text(tokenizer, tid, as_ids): finite_logprob(lp) for tid, lp in top}
        for top in out.top_logprobs
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [finite_logprob(lp) for lp in out.logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, out: SequenceOutput, as_ids: bool = False) -> dict[str, Any]:
    """Chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tid, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        text = token_text(tokenizer, tid, as_ids)
        alts = [(token_text(tokenizer, t, as_ids), finite_logprob(v)) for t, v in top]
        content.append(
            {
                "token": text,
                "logprob": finite_logprob(lp),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))} for a, v in alts
                ],
            }
        )
    return {"content": content}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split ``<tool_call>{json}</tool_call>`` blocks out of ``text``.

    Returns the remaining content (``None`` when empty) and OpenAI-shaped tool
    calls. Blocks that are not a JSON object with a ``name`` stay in the content.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def chat_response(
    model: str,
    tokenizer: Any,
    result: GenerationResult,
    want_logprobs: bool,
    parse_tools: bool,
    as_ids: bool = False,
) -> dict[str, Any]:
    """Build a ``chat.completion`` payload."""
    choices = []
    for out in result.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        finish = out.finish_reason
        if parse_tools:
            content, calls = parse_tool_calls(out.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choices.append(
            {
                "index": out.index,
                "message": message,
                "logprobs": chat_logprobs(tokenizer, out, as_ids) if want_logprobs else None,
                "finish_reason": finish,
            }
        )
    return completion_body(
        "chat.completion", model, choices, usage=usage([result]), version=result.version
    )


def completion_response(
    model: str,
    tokenizer: Any,
    results: list[GenerationResult],
    prompt_texts: list[str],
    want_logprobs: bool,
    echo: bool,
    as_ids: bool = False,
) -> dict[str, Any]:
    """Build a ``text_completion`` payload (choices ordered prompt-major, then n)."""
    choices = []
    for p_idx, (result, prompt_text) in enumerate(zip(results, prompt_texts, strict=True)):
        n = len(result.outputs)
        for out in result.outputs:
            prefix = prompt_text if echo else ""
            choices.append(
                {
                    "index": p_idx * n + out.index,
                    "text": prefix + out.text,
                    "logprobs": completion_logprobs(tokenizer, out, len(prefix), as_ids)
                    if want_logprobs
                    else None,
                    "finish_reason": out.finish_reason,
                }
            )
    return completion_body(
        "text_completion",
        model,
        choices,
        usage=usage(results),
        version=results[0].version if results else 0,
    )


def generate_response(
    result: GenerationResult, prompt_text: str | None, want_logprobs: bool
) -> dict[str, Any]:
    """vLLM-style ``/generate`` payload.

    ``logprobs[seq][pos]`` is a list of one-entry ``{token_id: logprob}`` dicts:
    the sampled token first, then the requested alternatives.
    """
    body: dict[str, Any] = {
        "text": [o.text for o in result.outputs],
        "prompt": prompt_text,
        "finish_reasons": [o.finish_reason for o in result.outputs],
        "token_ids": [o.token_ids for o in result.outputs],
        "prompt_token_ids": result.prompt_ids,
        "version": result.version,
    }
    if want_logprobs:
        body["logprobs"] = [
            [
                [{tid: finite_logprob(lp)}] + [{t: finite_logprob(v)} for t, v in top if t != tid]
                for tid, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs, strict=True)
            ]
            for o in result.outputs
        ]
    if result.prompt_logprobs is not None:
        body["prompt_logprobs"] = [
            None if pos is None else {t: finite_logprob(v) for t, v in pos.items()}
            for pos in result.prompt_logprobs
        ]
    return body
