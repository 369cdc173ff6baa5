"""A deterministic fake inference server for tests and benchmarks.

It speaks just enough of the protocols the server layer uses:

- ``GET /health`` and ``GET /v1/models``;
- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI, ``n`` supported);
- ``POST /generate`` in three dialects, chosen by the body's keys:
  vLLM-style (``{"prompt": {"prompt_token_ids": [...]}, "n", "max_tokens", "logprobs": 0}``),
  SGLang-style (``{"input_ids": [...], "sampling_params": {...}}``) and TRL-style
  (``{"prompts": [...]}``, also at ``/generate/``).

Tokens are fake and byte-level: a text's token ids are its UTF-8 bytes (0..255),
and generated tokens are lowercase letters and spaces. Output depends only on the
prompt, the choice index and the seed (the request's ``seed`` or ``--seed``), so
the same request always gets the same answer.

Test hooks: ``POST /fake/config`` changes ``latency_ms``, ``fail_status`` (every
endpoint, ``/health`` included, answers that status while set), ``ignore_n`` and the
reported weight version (``policy_version``, in the body or the header) at run time; ``GET /fake/stats`` reports request counts and peak concurrency.

The settings, request models and fake tokens live in ``fake_model``, the answers in
``fake_payloads``; their names are importable from here too.

Example::

    python -m atroposlib.testing.fake_server --port 9004 --latency-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import Counter
from typing import Any

import orjson
from pydantic import ValidationError

from atroposlib.http.asgi import answer_lifespan
from atroposlib.http.headers import POLICY_VERSION_HEADER, SESSION_ID_HEADER
from atroposlib.http.openai_protocol import model_list
from atroposlib.testing.fake_model import (  # noqa: F401 - the module's earlier names
    ALPHABET,
    MAX_N,
    MAX_TOKENS,
    FakeChatRequest,
    FakeCompletionRequest,
    FakeServerSettings,
    SGLangGenerateRequest,
    TrlGenerateRequest,
    VLLMGenerateRequest,
    VLLMPrompt,
    _Lenient,
    fake_detokenize,
    fake_generate,
    fake_tokenize,
    fake_top_logprobs,
    render_messages,
)
from atroposlib.testing.fake_payloads import (  # noqa: F401 - the module's earlier names
    Reply,
    _BadBody,
    _error,
    _parse_json,
    _validation_error,
    chat_payload,
    completion_payload,
    sglang_check,
    sglang_payload,
    trl_payload,
    vllm_payload,
)

logger = logging.getLogger(__name__)


class FakeBackend:
    """The fake server's behaviour, independent of the HTTP server that carries it.

    ``await backend.handle(method, path, body)`` → ``(status, json_body)``. Counts
    requests per path (and POSTs per ``X-Session-ID``), injects ``fail_status``, adds the configured latency to every
    generation request and tracks peak concurrency.
    """

    def __init__(self, settings: FakeServerSettings | None = None):
        self.state = settings or FakeServerSettings()
        self.counts: Counter[str] = Counter()
        self.session_counts: Counter[str] = Counter()
        self.concurrency = {"in_flight": 0, "max_in_flight": 0}

    async def _simulate(self) -> None:
        c = self.concurrency
        c["in_flight"] += 1
        if c["in_flight"] > c["max_in_flight"]:
            c["max_in_flight"] = c["in_flight"]
        try:
            if self.state.latency_ms > 0:
                await asyncio.sleep(self.state.latency_ms / 1000.0)
        finally:
            c["in_flight"] -= 1

    async def handle(
        self, method: str, path: str, body: bytes, session: str | None = None
    ) -> Reply:
        """Answer one request (``path`` without the query string; ``session``: its
        ``X-Session-ID``)."""
        if not path.startswith("/fake/"):
            self.counts[path] += 1
            if session is not None and method == "POST":
                self.session_counts[session] += 1  # generation requests only, not probes
            if self.state.fail_status is not None:
                return _error(
                    self.state.fail_status, "fake server failure injected", "server_error"
                )
        try:
            return await self._route(method, path, body)
        except _BadBody as e:
            return _error(400, str(e))
        except ValidationError as e:
            return _validation_error(e)

    async def _route(self, method: str, path: str, body: bytes) -> Reply:
        state = self.state
        if method == "GET":
            if path == "/health":
                return 200, {"status": "ok"}
            if path == "/v1/models":
                return 200, model_list([state.model_name], 0, "fake")
            if path == "/fake/stats":
                return 200, {
                    "requests": dict(self.counts),
                    "sessions": dict(self.session_counts),
                    **self.concurrency,
                }
        elif method == "POST":
            if path == "/v1/chat/completions":
                req = FakeChatRequest.model_validate(_parse_json(body))
                await self._simulate()
                return self._with_version((200, chat_payload(req, state)))
            if path == "/v1/completions":
                creq = FakeCompletionRequest.model_validate(_parse_json(body))
                await self._simulate()
                return self._with_version(completion_payload(creq, state))
            if path in ("/generate", "/generate/"):
                return self._with_version(await self._generate(_parse_json(body)))
            if path == "/fake/config":
                return self._configure(_parse_json(body))
        known = {
            "/health",
            "/v1/models",
            "/fake/stats",
            "/v1/chat/completions",
            "/v1/completions",
            "/generate",
            "/generate/",
            "/fake/config",
        }
        if path in known:
            return _error(405, f"method {method} not allowed on {path}")
        return _error(404, f"no route {path}")

    async def _generate(self, body: Any) -> Reply:
        if not isinstance(body, dict):
            return _error(422, "body must be a JSON object")
        if "prompts" in body:
            treq = TrlGenerateRequest.model_validate(body)
            await self._simulate()
            return trl_payload(treq, self.state)
        if "input_ids" in body or "sampling_params" in body or "text" in body:
            sreq = SGLangGenerateRequest.model_validate(body)
            bad = sglang_check(sreq, self.state)
            if bad is not None:
                return bad
            await self._simulate()
            return sglang_payload(sreq, self.state)
        vreq = VLLMGenerateRequest.model_validate(body)
        await self._simulate()
        return vllm_payload(vreq, self.state)

    def _with_version(self, reply: Reply) -> Reply:
        """Add the configured weight version to a successful generation answer's body."""
        status, content = reply
        version = self.state.policy_version
        if version is None or status != 200 or self.state.policy_version_in != "body":
            return reply
        for item in content if isinstance(content, list) else [content]:
            if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
                item["meta_info"]["weight_version"] = str(version)
            elif isinstance(item, dict):
                item["version"] = version
        return reply

    def _configure(self, body: Any) -> Reply:
        if not isinstance(body, dict):
            return _error(422, "body must be a JSON object")
        merged = FakeServerSettings(**{**self.state.model_dump(), **body})
        for key in FakeServerSettings.model_fields:
            setattr(self.state, key, getattr(merged, key))
        return 200, self.state.model_dump()


def encode_json(content: Any) -> bytes:
    """Compact JSON bytes."""
    return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


_VERSION_HEADER = POLICY_VERSION_HEADER.lower().encode()
_SESSION_HEADER = SESSION_ID_HEADER.lower().encode()


class FakeASGIApp:
    """A minimal ASGI app around :class:`FakeBackend` (for uvicorn or an in-thread server)."""

    def __init__(self, backend: FakeBackend):
        self.backend = backend

    @property
    def settings(self) -> FakeServerSettings:
        """The live settings (changed by ``POST /fake/config``)."""
        return self.backend.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        session = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k == _SESSION_HEADER), None
        )
        status, content = await self.backend.handle(
            scope["method"], scope["path"], b"".join(chunks), session
        )
        payload = encode_json(content)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        state = self.backend.state
        if state.policy_version is not None and state.policy_version_in == "header":
            headers.append((_VERSION_HEADER, str(state.policy_version).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def create_app(settings: FakeServerSettings | None = None) -> FakeASGIApp:
    """The fake server as an ASGI app with the given settings."""
    return FakeASGIApp(FakeBackend(settings))


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: ``python -m atroposlib.testing.fake_server``."""
    parser = argparse.ArgumentParser(description="Deterministic fake OpenAI/vLLM inference server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9004)
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--model-name", default="fake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-n", action="store_true", help="Answer one choice whatever n is.")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="Serve over a minimal asyncio HTTP/1.1 keep-alive server instead of uvicorn "
        "(same answers; far less CPU per request, for benchmarks).",
    )
    args = parser.parse_args(argv)
    settings = FakeServerSettings(
        latency_ms=args.latency_ms,
        model_name=args.model_name,
        seed=args.seed,
        ignore_n=args.ignore_n,
    )
    if args.lean:
        from atroposlib.testing.lean_http import serve_forever

        asyncio.run(serve_forever(FakeBackend(settings).handle, args.host, args.port))
        return
    import uvicorn

    from atroposlib.http.transport import http_protocol

    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        http=http_protocol(),
    )


if __name__ == "__main__":
    main()
