"""Server-sent events for the proxy's ``stream: true`` requests.

The proxy runs the same generation as for a plain request (the session's ``ManagedServer``
records the nodes), then sends the finished answer as OpenAI stream chunks: per choice a
chunk with its role and content, one with its tool calls, one with its finish reason; then,
when ``stream_options.include_usage`` asks for it, a chunk with no choices and the usage;
then ``data: [DONE]``. Every chunk is encoded before the response starts, so any failure is
still a JSON error with its status, never a stream cut short.
"""

from __future__ import annotations

from typing import Any, Iterable

from fastapi.responses import StreamingResponse

from atroposlib.http.openai_protocol import OpenAIError, completion_body, usage_body
from atroposlib.proxy.upstream import upstream_json


def stream_options(extra: dict[str, Any] | None) -> tuple[bool, bool]:
    """``(stream, include_usage)`` from a request's extra fields; 400 naming the field when
    ``stream`` is not a boolean or ``stream_options`` not an object of booleans."""
    extra = extra or {}
    stream = extra.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise OpenAIError("stream must be a boolean", param="stream", status=400)
    options = extra.get("stream_options")
    if not stream or options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options", status=400)
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise OpenAIError(
            "stream_options.include_usage must be a boolean",
            param="stream_options.include_usage",
            status=400,
        )
    return True, bool(include_usage)


def _chunk_base(
    payload: dict[str, Any], object_name: str, usage: list[int] | None
) -> dict[str, Any]:
    """The fields every chunk streaming ``payload`` repeats; when usage is asked for, a
    ``usage`` that is null on every chunk but the last, as OpenAI sends it."""
    extra: dict[str, Any] = {} if usage is None else {"usage": None}
    return completion_body(
        object_name, payload["model"], [], id=payload["id"], created=payload["created"], **extra
    )


def chat_chunks(payload: dict[str, Any], usage: list[int] | None) -> Iterable[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects that stream ``payload`` (a ``chat.completion``);
    ``usage`` (or None: no usage chunk) is ``[prompt_tokens, completion_tokens]``."""
    base = _chunk_base(payload, "chat.completion.chunk", usage)

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice]}

    for choice in payload["choices"]:
        index, message = choice["index"], choice.get("message") or {}
        delta: dict[str, Any] = {"role": "assistant"}
        if message.get("content") is not None:
            delta["content"] = message["content"]
        yield chunk(index, delta)
        calls = message.get("tool_calls") or []
        if calls:
            yield chunk(index, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
        yield chunk(index, {}, choice.get("finish_reason") or "stop")
    if usage is not None:
        yield {**base, "usage": usage_body(*usage)}


def completion_chunks(payload: dict[str, Any], usage: list[int] | None) -> Iterable[dict[str, Any]]:
    """The ``text_completion`` chunks that stream ``payload`` (a text completion): per
    choice one with its text, one with its finish reason; then the usage, when asked."""
    base = _chunk_base(payload, "text_completion", usage)

    def chunk(index: int, text: str, finish: str | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return {**base, "choices": [choice]}

    for choice in payload["choices"]:
        yield chunk(choice["index"], choice.get("text") or "", None)
        yield chunk(choice["index"], "", choice.get("finish_reason") or "stop")
    if usage is not None:
        yield {**base, "usage": usage_body(*usage)}


def sse_answer(chunks: Iterable[dict[str, Any]]) -> StreamingResponse:
    """The chunks as a ``text/event-stream`` response ending in ``data: [DONE]``.

    All are encoded first: output that cannot be sent as JSON is a 502 before anything is
    streamed (as for a plain answer)."""
    events: list[bytes] = []
    for c in chunks:
        events.append(b"data: " + upstream_json(c) + b"\n\n")
    events.append(b"data: [DONE]\n\n")

    async def body() -> Any:
        for event in events:
            yield event

    # no-cache and no proxy buffering: the events reach the client as they are written
    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
