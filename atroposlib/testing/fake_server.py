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

Example::

    python -m atroposlib.testing.fake_server --port 9004 --latency-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import random
from collections import Counter
from typing import Any, Union

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atroposlib.http.answers import error_body
from atroposlib.http.asgi import answer_lifespan
from atroposlib.http.headers import POLICY_VERSION_HEADER, SESSION_ID_HEADER
from atroposlib.http.openai_protocol import (
    PassThroughChatRequest,
    PassThroughCompletionRequest,
    completion_body,
    model_list,
    usage_body,
)

logger = logging.getLogger(__name__)

ALPHABET: bytes = b"abcdefghijklmnopqrstuvwxyz "
"""Byte values the fake model generates (all printable ASCII, one token each)."""

MAX_N = 256
MAX_TOKENS = 65536


class FakeServerSettings(BaseModel):
    """Run-time behaviour of the fake server."""

    latency_ms: float = Field(50.0, ge=0, description="Delay added to every generation request.")
    model_name: str = Field("fake", description="Model id reported by /v1/models and responses.")
    seed: int = Field(0, description="Default seed when a request gives none.")
    ignore_n: bool = Field(
        False, description="Return a single choice whatever n is (like some APIs)."
    )
    fail_status: int | None = Field(
        None, ge=400, le=599, description="When set, every endpoint answers this HTTP status."
    )
    policy_version: int | None = Field(
        None, description="Weight version to report on generation answers (None: report none)."
    )
    policy_version_in: str = Field(
        "body",
        pattern="^(body|header)$",
        description="Where to report it: the JSON body (vLLM/serve-model 'version', SGLang "
        "meta_info.weight_version) or the X-Atropos-Policy-Version header.",
    )


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FakeChatRequest(PassThroughChatRequest):
    """Body of ``POST /v1/chat/completions``: the shared OpenAI model, with the fake's bounds
    (unknown OpenAI fields are accepted and ignored)."""

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class FakeCompletionRequest(PassThroughCompletionRequest):
    """Body of ``POST /v1/completions``: the shared OpenAI model, with the fake's bounds."""

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)


class VLLMPrompt(_Lenient):
    """The ``prompt`` object of the vLLM-style ``/generate``."""

    prompt_token_ids: list[int] = Field(..., min_length=1)


class VLLMGenerateRequest(_Lenient):
    """Body of the vLLM-style ``POST /generate``."""

    prompt: Union[VLLMPrompt, str]
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


class SGLangGenerateRequest(_Lenient):
    """Body of the SGLang-style ``POST /generate``."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(None, ge=0, le=20)


class TrlGenerateRequest(_Lenient):
    """Body of the TRL-style ``POST /generate/``."""

    prompts: list[str] = Field(..., min_length=1)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int = Field(1024, ge=1, le=MAX_TOKENS)
    seed: int | None = None


def fake_tokenize(text: str) -> list[int]:
    """Byte-level fake tokenization: the UTF-8 bytes of ``text``."""
    return list(text.encode("utf-8"))


def fake_detokenize(ids: list[int]) -> str:
    """Inverse of :func:`fake_tokenize` (invalid sequences are replaced)."""
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def render_messages(messages: list[dict[str, Any]]) -> str:
    """Flatten chat messages to the text the fake model 'sees'."""
    parts = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True)
        parts.append(f"{m.get('role', '')}: {content}\n")
    return "".join(parts)


def fake_generate(
    prompt_ids: list[int], index: int, seed: int, max_tokens: int
) -> tuple[list[int], list[float], str]:
    """Generate ``(token_ids, logprobs, finish_reason)`` for one choice, deterministically.

    The length is between half of ``max_tokens`` and ``max_tokens``; a shorter output
    finishes with ``"stop"``, a full-length one with ``"length"``.
    """
    digest = hashlib.sha256(
        f"{seed}|{index}|".encode() + bytes(i % 256 for i in prompt_ids[-4096:])
    ).digest()
    rng = random.Random(digest)
    length = rng.randint(max(1, max_tokens // 2), max_tokens)
    ids = [rng.choice(ALPHABET) for _ in range(length)]
    logprobs = [-round(rng.random() * 3.0, 6) for _ in range(length)]
    return ids, logprobs, "length" if length >= max_tokens else "stop"


def fake_top_logprobs(token: int, logprob: float, k: int) -> dict[int, float]:
    """A top-``k`` map that contains ``token`` with ``logprob`` plus lower-ranked alternatives."""
    out = {token: logprob}
    alt = 0
    while len(out) < max(k, 1):
        if alt != token:
            out[alt] = logprob - 1.0 - len(out)
        alt += 1
    return out


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
