"""How the managed-server proxy tells the client's faults from the inference server's, and
turns the inference server's into answers (see README.md, "Proxy status classes").

A session's ``ManagedServer`` calls its backend through an :class:`UpstreamTap`, which
marks the request as having reached the inference server: a failure before that point is
the client's input (400), from then on the inference server's (502, or its own HTTP class).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
from typing import Any

import orjson
from fastapi.responses import Response

from atroposlib.envs.server_handling.errors import NoHealthyServerError, status_code
from atroposlib.http.openai_protocol import OpenAIError

logger = logging.getLogger(__name__)


def _upstream_status(exc: BaseException) -> tuple[int, str, str | None] | None:
    """The status, message and ``Location`` of an inference server's HTTP error answer (or
    redirect), if ``exc`` is one."""
    status = status_code(exc)
    if status is None:
        return None
    response = getattr(exc, "response", None)  # openai's and httpx's errors carry the answer
    try:
        text = response.text if response is not None else str(exc)
    except Exception:  # noqa: BLE001 - a streamed body cannot be read here; the summary will do
        text = str(exc)
    headers = getattr(response, "headers", None) or getattr(exc, "headers", None) or {}
    return status, text[:1000], headers.get("location")


def upstream_http_error(status: int, text: str, location: str | None) -> OpenAIError:
    """The proxy's answer to an inference server's HTTP error or redirect.

    A 4xx keeps its status (the request was refused) unless it says the proxy itself is
    misconfigured: 401/403/407 (the proxy's credentials) and 404 (its URL or model name)
    are 502s, so an OpenAI client never takes them for the proxy's own auth or routing
    errors. Every one is typed ``upstream_error``.
    """
    if 300 <= status < 400:
        where = f" to {location[:200]!r}" if location else ""
        return OpenAIError(
            f"inference server answered a redirect (HTTP {status}{where}); redirects are not "
            "followed: configure the server's final URL",
            status=502,
            type="upstream_error",
        )
    if status in (401, 403, 407):
        return OpenAIError(
            f"inference server refused the proxy's credentials (HTTP {status}): {text}; check "
            "the api_key of the proxy's server config",
            status=502,
            type="upstream_error",
        )
    if status == 404:
        return OpenAIError(
            f"inference server answered 404 (wrong base_url or model_name in the proxy's "
            f"server config?): {text}",
            status=502,
            type="upstream_error",
        )
    if 400 <= status < 500:
        return OpenAIError(
            f"inference server refused the request: {text}", status=status, type="upstream_error"
        )
    return OpenAIError(
        f"inference server error (HTTP {status}): {text}", status=502, type="upstream_error"
    )


def _client_error_types() -> tuple[type[BaseException], ...]:
    import jinja2

    # RecursionError: a message nested too deeply for the template (the client's input).
    return (ValueError, KeyError, TypeError, RecursionError, jinja2.TemplateError)


UPSTREAM_REACHED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "proxy_upstream_reached", default=None
)
"""Per request: set once the session's backend has been called, so a failure after that
point is the inference server's (its answer could not be used), not the client's."""

UPSTREAM_USAGE: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "proxy_upstream_usage", default=None
)
"""Per request that wants usage (a stream's ``include_usage``): ``[prompt_tokens,
completion_tokens]`` as the inference server was asked and answered."""


class UpstreamTap:
    """Stands in for a backend inside a session's ``ManagedServer`` and marks the request
    as having reached the inference server; everything else is the backend's own."""

    def __init__(self, server: Any):
        object.__setattr__(self, "_server", server)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._server, name, value)

    @staticmethod
    def _mark() -> None:
        reached = UPSTREAM_REACHED.get()
        if reached is not None:
            reached[0] = True

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> Any:
        """The backend's call, marked as reaching the inference server."""
        self._mark()
        result = await self._server.tokens_and_logprobs_completion(**kwargs)
        usage = UPSTREAM_USAGE.get()
        if usage is not None:
            # Prompt tokens count once per request (as OpenAI counts them for n > 1).
            usage[0] = len(kwargs.get("input_ids") or ())
            usage[1] += sum(len(out) for out in result[1])
        return result


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def strict_tool_arguments(payload: dict[str, Any]) -> None:
    """Make every tool call's ``arguments`` strict JSON, in place.

    Python's parser accepts ``NaN`` and ``Infinity`` where the model wrote them; passed on,
    an OpenAI client's ``json.loads`` may accept them but other parsers refuse the call.
    They become ``null``, as ``JSON.stringify`` writes them.
    """
    for choice in payload.get("choices") or ():
        for call in (choice.get("message") or {}).get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if not isinstance(arguments, str) or not any(
                word in arguments for word in ("NaN", "Infinity")
            ):
                continue
            try:
                parsed = json.loads(arguments)
                json.dumps(parsed, allow_nan=False)
                continue  # the words were inside strings
            except (ValueError, RecursionError):
                pass
            try:
                function["arguments"] = json.dumps(_finite(json.loads(arguments)))
            except (ValueError, RecursionError):
                continue  # not JSON at all: the client sees what the parser gave
            logger.warning(
                "tool call %r: non-finite numbers in arguments sent as null", function.get("name")
            )


def upstream_json(value: Any) -> bytes:
    """``value`` (built from an inference server's output) as JSON bytes; output that cannot
    be encoded (a lone surrogate the model spelled out in a tool call) is a 502, not a bare
    500."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError) as e:
        raise OpenAIError(
            f"the inference server's output cannot be sent as JSON: {e}",
            status=502,
            type="upstream_error",
        ) from e


def json_answer(payload: dict[str, Any]) -> Response:
    """``payload`` as a JSON response (see :func:`upstream_json`)."""
    return Response(upstream_json(payload), media_type="application/json")


def proxy_error_for(exc: BaseException, reached_upstream: bool) -> OpenAIError:
    """The proxy's answer to ``exc``, raised by a session's ``ManagedServer`` call;
    ``reached_upstream`` says whether the inference server had been called."""
    if isinstance(exc, NotImplementedError):
        return OpenAIError(str(exc), status=501, type="not_implemented")
    if isinstance(exc, NoHealthyServerError):
        return OpenAIError(str(exc), status=503, type="server_error")
    upstream = _upstream_status(exc)
    if upstream is not None and upstream[0] >= 300:
        return upstream_http_error(*upstream)
    if isinstance(exc, asyncio.TimeoutError):
        return OpenAIError("inference server timed out", status=504, type="upstream_error")
    if not reached_upstream and isinstance(exc, _client_error_types()):
        return OpenAIError(f"{type(exc).__name__}: {exc}", status=400)
    logger.warning("inference server fault: %s: %s", type(exc).__name__, exc)
    return OpenAIError(
        f"inference server error: its answer could not be used: {type(exc).__name__}: {exc}",
        status=502,
        type="upstream_error",
    )
