"""Server-sent-event streaming of chat and text completions (``"stream": true``).

Tokens are forwarded as the engine samples them. Text deltas are produced by
re-decoding the sequence so far; an incomplete UTF-8 tail and the last
``max(len(stop)) - 1`` characters are held back, so that the concatenated deltas
equal the non-streamed text exactly (stop strings never leak). Logprobs of held-back
tokens ride on the next emitted chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from atroposlib.http.answers import error_body
from atroposlib.http.openai_protocol import OpenAIError, completion_body
from atroposlib.serving.engine import Engine, GenerationResult, SequenceOutput, TokenEvent
from atroposlib.serving.protocol import ChatCompletionRequest, CompletionRequest
from atroposlib.serving.responses import chat_logprobs, completion_logprobs, usage
from atroposlib.serving.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _ChoiceState:
    tokens: list[int] = field(default_factory=list)
    pending: list[TokenEvent] = field(default_factory=list)
    emitted: str = ""
    finished: bool = False


class TextDeltas:
    """Turns a growing token list into safe text deltas (pure apart from the tokenizer)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.hold = max((len(s) for s in params.stop), default=1) - 1

    def partial(self, state: _ChoiceState) -> str:
        """Delta for an unfinished choice (may be empty)."""
        text = self.tokenizer.decode(
            state.tokens, skip_special_tokens=self.params.skip_special_tokens
        )
        text = text.rstrip("\ufffd")
        if self.hold:
            text = text[: max(0, len(text) - self.hold)]
        if not text.startswith(state.emitted) or len(text) <= len(state.emitted):
            return ""
        delta = text[len(state.emitted) :]
        state.emitted = text
        return delta

    @staticmethod
    def final(state: _ChoiceState, final_text: str) -> str:
        """Remaining delta once the exact final text is known."""
        if final_text.startswith(state.emitted):
            delta = final_text[len(state.emitted) :]
        else:  # cannot happen with prefix-stable decoding; never emit twice
            logger.warning("streamed text diverged from the final text")
            delta = ""
        state.emitted = final_text
        return delta


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n"


async def stream_choices(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    tokenizer: Any,
    chunk: Callable[[int, str, list[TokenEvent], str | None], dict[str, Any]],
    first: Callable[[int], dict[str, Any]] | None,
    usage_chunk: Callable[[list[GenerationResult]], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """Run ``prompts`` through ``engine`` and yield SSE chunks built by ``chunk``.

    ``chunk(choice_index, delta_text, events, finish_reason)`` builds one payload;
    ``first(choice_index)`` (chat) the opening role chunk; ``usage_chunk`` the final
    usage payload when the client asked for it.
    """
    queue: asyncio.Queue[
        tuple[int, TokenEvent] | tuple[int, GenerationResult] | tuple[int, BaseException]
    ] = asyncio.Queue()
    n = params.n
    deltas = TextDeltas(tokenizer, params)
    states = {p * n + i: _ChoiceState() for p in range(len(prompts)) for i in range(n)}

    async def run(p_idx: int, ids: list[int]) -> None:
        try:
            result = await engine.generate(
                ids, params, listener=lambda ev: queue.put_nowait((p_idx, ev))
            )
            queue.put_nowait((p_idx, result))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the client as an error event
            queue.put_nowait((p_idx, exc))

    tasks = [asyncio.create_task(run(p, ids)) for p, ids in enumerate(prompts)]
    results: dict[int, GenerationResult] = {}
    try:
        if first is not None:
            for idx in states:
                yield sse(first(idx))
        while len(results) < len(prompts):
            p_idx, item = await queue.get()
            if isinstance(item, BaseException):
                exc = item
                if isinstance(exc, OpenAIError):
                    body = exc.body()
                else:
                    logger.error("streamed generation failed: %s", exc)
                    body = error_body(f"internal error: {exc}", "internal_error", None, 500)
                yield sse(body)
                break
            if isinstance(item, GenerationResult):
                results[p_idx] = item
                for out in item.outputs:
                    idx = p_idx * n + out.index
                    state = states[idx]
                    delta = deltas.final(state, out.text)
                    yield sse(chunk(idx, delta, state.pending, out.finish_reason))
                    state.pending = []
                continue
            idx = p_idx * n + item.index
            state = states[idx]
            state.tokens.append(item.token_id)
            state.pending.append(item)
            if item.finish_reason is not None:
                continue  # the final text (with stop handling) comes with the result
            delta = deltas.partial(state)
            if delta:
                yield sse(chunk(idx, delta, state.pending, None))
                state.pending = []
        else:
            if usage_chunk is not None:
                yield sse(usage_chunk([results[p] for p in sorted(results)]))
        yield sse("[DONE]")
    finally:
        for task in tasks:
            task.cancel()


def _events_output(events: list[TokenEvent]) -> SequenceOutput:
    return SequenceOutput(
        0,
        [e.token_id for e in events],
        "",
        [e.logprob for e in events],
        [e.top_logprobs for e in events],
        "",
    )


def _usage_requested(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _chunk_envelope(object_name: str, name: str) -> Callable[..., dict[str, Any]]:
    """``wrap(choices, **extra)``: one stream's chunks, all with the same id and time."""
    head = completion_body(object_name, name, [])

    def wrap(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": choices, **extra}

    return wrap


def _sse(
    engine: Engine,
    tokenizer: Any,
    body: ChatCompletionRequest | CompletionRequest,
    params: SamplingParams,
    prompts: list[list[int]],
    wrap: Callable[..., dict[str, Any]],
    chunk: Callable[[int, str, list[TokenEvent], str | None], dict[str, Any]],
    first: Callable[[int], dict[str, Any]] | None,
) -> StreamingResponse:
    """The SSE answer streaming ``prompts``, with a usage chunk when the client asked."""

    def usage_chunk(results: list) -> dict[str, Any]:
        return wrap([], usage=usage(results))

    gen = stream_choices(
        engine,
        prompts,
        params,
        tokenizer,
        chunk,
        first,
        usage_chunk if _usage_requested(body) else None,
    )
    return StreamingResponse(gen, media_type="text/event-stream")


def stream_chat(
    engine: Engine,
    tokenizer: Any,
    name: str,
    body: ChatCompletionRequest,
    params: SamplingParams,
    ids: list[int],
) -> StreamingResponse:
    """SSE ``chat.completion.chunk`` stream for one conversation."""
    as_ids = body.return_tokens_as_token_ids
    wrap = _chunk_envelope("chat.completion.chunk", name)

    def first(idx: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return wrap([{"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}])

    def chunk(idx: int, delta: str, events: list[TokenEvent], finish: str | None) -> dict:
        lps = chat_logprobs(tokenizer, _events_output(events), as_ids) if body.logprobs else None
        choice = {
            "index": idx,
            "delta": {"content": delta} if delta else {},
            "logprobs": lps,
            "finish_reason": finish,
        }
        return wrap([choice])

    return _sse(engine, tokenizer, body, params, [ids], wrap, chunk, first)


def stream_completions(
    engine: Engine,
    tokenizer: Any,
    name: str,
    body: CompletionRequest,
    params: SamplingParams,
    ids_list: list[list[int]],
    texts: list[str],
) -> StreamingResponse:
    """SSE ``text_completion`` stream; choice index = prompt index * n + i."""
    as_ids = body.return_tokens_as_token_ids
    wrap = _chunk_envelope("text_completion", name)
    echoed: set[int] = set()

    def chunk(idx: int, delta: str, events: list[TokenEvent], finish: str | None) -> dict:
        if body.echo and idx not in echoed:
            echoed.add(idx)
            delta = texts[idx // params.n] + delta
        lps = (
            completion_logprobs(tokenizer, _events_output(events), 0, as_ids)
            if body.logprobs is not None
            else None
        )
        return wrap([{"index": idx, "text": delta, "logprobs": lps, "finish_reason": finish}])

    return _sse(engine, tokenizer, body, params, ids_list, wrap, chunk, None)
