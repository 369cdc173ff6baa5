"""The fake inference server's answers: one function per protocol (OpenAI chat and
completions, vLLM-, SGLang- and TRL-style ``/generate``) from a validated request and the
settings, plus the error answers."""

from __future__ import annotations

import random
from typing import Any

import orjson
from pydantic import ValidationError

from atroposlib.http.answers import error_body
from atroposlib.http.openai_protocol import completion_body, usage_body
from atroposlib.testing.fake_model import (
    MAX_N,
    MAX_TOKENS,
    FakeChatRequest,
    FakeCompletionRequest,
    FakeServerSettings,
    SGLangGenerateRequest,
    TrlGenerateRequest,
    VLLMGenerateRequest,
    fake_detokenize,
    fake_generate,
    fake_tokenize,
    fake_top_logprobs,
    render_messages,
)

Reply = tuple[int, Any]
"""An answer: HTTP status and a JSON-serialisable body."""


def _error(status: int, message: str, err_type: str = "invalid_request_error") -> Reply:
    # The OpenAI envelope, plus FastAPI's "detail" for clients that read that shape.
    return status, {**error_body(message, err_type, None, status), "detail": message}


def _validation_error(exc: ValidationError) -> Reply:
    detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    fields = ", ".join(".".join(str(p) for p in d["loc"]) or "body" for d in detail)
    return 422, {
        "detail": detail,
        "error": {"message": f"invalid fields: {fields}", "type": "invalid_request_error"},
    }


class _BadBody(Exception):
    """The request body could not be parsed."""


def _parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body) if body else None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _BadBody(f"body is not valid JSON: {e}") from e


def chat_payload(req: FakeChatRequest, state: FakeServerSettings) -> dict[str, Any]:
    """The ``/v1/chat/completions`` answer for a validated request."""
    prompt_ids = fake_tokenize(render_messages(req.message_dicts()))
    max_tokens = req.max_completion_tokens or req.max_tokens or 16
    seed = state.seed if req.seed is None else req.seed
    n = 1 if state.ignore_n else req.n
    choices, completion_tokens = [], 0
    for i in range(n):
        ids, lps, finish = fake_generate(prompt_ids, i, seed, max_tokens)
        completion_tokens += len(ids)
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": fake_detokenize(ids)},
            "finish_reason": finish,
            "logprobs": None,
        }
        if req.logprobs:
            k = req.top_logprobs or 0
            choice["logprobs"] = {
                "content": [
                    {
                        "token": chr(t),
                        "logprob": lp,
                        "bytes": [t],
                        "top_logprobs": [
                            {"token": chr(a), "logprob": v, "bytes": [a]}
                            for a, v in fake_top_logprobs(t, lp, k).items()
                        ][:k],
                    }
                    for t, lp in zip(ids, lps, strict=False)
                ]
            }
        choices.append(choice)
    return completion_body(
        "chat.completion",
        req.model or state.model_name,
        choices,
        usage=usage_body(len(prompt_ids), completion_tokens),
    )


def completion_payload(req: FakeCompletionRequest, state: FakeServerSettings) -> Reply:
    """The ``/v1/completions`` answer for a validated request."""
    if isinstance(req.prompt, str):
        prompts = [fake_tokenize(req.prompt)]
    elif req.prompt and isinstance(req.prompt[0], int):
        prompts = [list(req.prompt)]  # type: ignore[arg-type]
    else:
        prompts = [fake_tokenize(p) for p in req.prompt]  # type: ignore[arg-type]
    if not prompts or not prompts[0]:
        return _error(422, "prompt must not be empty")
    seed = state.seed if req.seed is None else req.seed
    n = 1 if state.ignore_n else req.n
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for p_idx, prompt_ids in enumerate(prompts):
        prompt_tokens += len(prompt_ids)
        for i in range(n):
            ids, lps, finish = fake_generate(prompt_ids, i, seed, req.max_tokens or 16)
            completion_tokens += len(ids)
            text = fake_detokenize(ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = {
                    "tokens": [chr(t) for t in ids],
                    "token_logprobs": lps,
                    "top_logprobs": [
                        {chr(a): v for a, v in fake_top_logprobs(t, lp, req.logprobs).items()}
                        for t, lp in zip(ids, lps, strict=False)
                    ],
                    "text_offset": list(range(len(ids))),
                }
            if req.echo:
                text = fake_detokenize(prompt_ids) + text
            choices.append(
                {
                    "index": p_idx * n + i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )
    return 200, completion_body(
        "text_completion",
        req.model or state.model_name,
        choices,
        usage=usage_body(prompt_tokens, completion_tokens),
    )


def vllm_payload(req: VLLMGenerateRequest, state: FakeServerSettings) -> Reply:
    """The vLLM-style ``/generate`` answer for a validated request."""
    if isinstance(req.prompt, str):
        prompt_ids = fake_tokenize(req.prompt)
        if not prompt_ids:
            return _error(422, "prompt must not be empty")
    else:
        prompt_ids = req.prompt.prompt_token_ids
    seed = state.seed if req.seed is None else req.seed
    out: dict[str, Any] = {"text": [], "token_ids": [], "finish_reasons": []}
    if req.logprobs is not None:
        out["logprobs"] = []
    for i in range(req.n):
        ids, lps, finish = fake_generate(prompt_ids, i, seed, req.max_tokens)
        out["text"].append(fake_detokenize(ids))
        out["token_ids"].append(ids)
        out["finish_reasons"].append(finish)
        if req.logprobs is not None:
            out["logprobs"].append(
                [
                    [{str(a): v} for a, v in fake_top_logprobs(t, lp, req.logprobs).items()]
                    for t, lp in zip(ids, lps, strict=False)
                ]
            )
    if req.prompt_logprobs is not None:
        k = max(req.prompt_logprobs, 1)
        rng = random.Random(seed)
        pl: list[dict[str, float] | None] = [None]
        for tok in prompt_ids[1:]:
            lp = -round(rng.random() * 3.0, 6)
            pl.append({str(a): v for a, v in fake_top_logprobs(tok, lp, k).items()})
        out["prompt_logprobs"] = pl
    out["prompt_token_ids"] = prompt_ids
    return 200, out


def sglang_check(req: SGLangGenerateRequest, state: FakeServerSettings) -> Reply | None:
    """An error answer when the SGLang request's prompt or sampling parameters are bad."""
    if not req.input_ids and not req.text:
        return _error(422, "one of input_ids or text is required")
    sp = req.sampling_params
    try:
        max_tokens = int(sp.get("max_new_tokens", sp.get("max_tokens", 16)))
        n = int(sp.get("n", 1))
        int(sp.get("seed", state.seed))
    except (TypeError, ValueError):
        return _error(422, "sampling_params.max_new_tokens, n and seed must be integers")
    if not (1 <= max_tokens <= MAX_TOKENS) or not (1 <= n <= MAX_N):
        return _error(422, "sampling_params.max_new_tokens or sampling_params.n out of range")
    return None


def sglang_payload(req: SGLangGenerateRequest, state: FakeServerSettings) -> Reply:
    """The SGLang-style ``/generate`` answer for a request that passed :func:`sglang_check`."""
    prompt_ids = req.input_ids or fake_tokenize(req.text or "")
    sp = req.sampling_params
    max_tokens = int(sp.get("max_new_tokens", sp.get("max_tokens", 16)))
    n = int(sp.get("n", 1))
    seed = int(sp.get("seed", state.seed))
    results = []
    for i in range(n):
        ids, lps, finish = fake_generate(prompt_ids, i, seed, max_tokens)
        meta: dict[str, Any] = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "finish_reason": {"type": finish}
            if finish == "stop"
            else {"type": "length", "length": max_tokens},
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps, strict=False)]
            if req.logprob_start_len == 0 and req.top_logprobs_num:
                rng = random.Random(seed)
                rows: list[list[list[Any]] | None] = [None]
                for tok in prompt_ids[1:]:
                    lp = -round(rng.random() * 3.0, 6)
                    top = fake_top_logprobs(tok, lp, req.top_logprobs_num)
                    rows.append([[v, a, None] for a, v in top.items()])
                meta["input_top_logprobs"] = rows
        results.append({"text": fake_detokenize(ids), "output_ids": ids, "meta_info": meta})
    return 200, results[0] if n == 1 else results


def trl_payload(req: TrlGenerateRequest, state: FakeServerSettings) -> Reply:
    """The TRL-style ``/generate/`` answer for a validated request."""
    seed = state.seed if req.seed is None else req.seed
    completion_ids = []
    for prompt in req.prompts:
        prompt_ids = fake_tokenize(prompt)
        for i in range(req.n):
            completion_ids.append(fake_generate(prompt_ids, i, seed, req.max_tokens)[0])
    return 200, {"completion_ids": completion_ids}
