"""Async client for the rollout API, as used by an environment.

One ``httpx.AsyncClient`` per environment, every call with a timeout, the
``Authorization: Bearer $ATROPOS_API_KEY`` header when that variable is set, and
request bodies gzipped when that makes them smaller (docs/design.md, "Environment lifecycle").
Requests travel over :class:`~atroposlib.http.httpx_transport.AiohttpTransport`: the
``aiohttp`` stack every call to an inference server uses (proxies from the environment,
``SSL_CERT_FILE``, answers bounded), at a fraction of ``httpx``'s own pool's CPU per call.
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass
from typing import Any, Dict

import httpx
import orjson

from atroposlib.envs.validation import is_plain_json
from atroposlib.http.httpx_transport import AiohttpTransport
from atroposlib.utils.io import auth_headers

logger = logging.getLogger(__name__)

GZIP_MIN_BYTES = 1024
DEFAULT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 8
MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""Largest answer read from run-api, once inflated: its answers to an env are a few hundred
bytes, so a bound far below the inference transport's keeps a bad answer cheap."""


def _encode_json(payload: Any) -> bytes:
    """``payload`` as compact JSON: by ``orjson`` when that writes the same JSON value as
    ``json.dumps`` (plain data, finite floats: :func:`~.validation.is_plain_json`), several
    times faster on token lists; else by ``json.dumps``, whose rules (``NaN`` written as
    such, non-``str`` keys turned into strings, errors for what it cannot encode) stay."""
    if is_plain_json(payload):
        try:
            return orjson.dumps(payload)
        except orjson.JSONEncodeError:  # an int beyond 64 bits, a lone surrogate
            pass
    return json.dumps(payload, separators=(",", ":")).encode()


def encode_body(payload: Any, minimum_size: int = GZIP_MIN_BYTES) -> tuple[bytes, Dict[str, str]]:
    """Serialize ``payload`` to JSON; gzip it when >= ``minimum_size`` bytes (1 KiB) and
    compression helps.

    Returns the body and the headers that describe it.
    """
    raw = _encode_json(payload)
    headers = {"Content-Type": "application/json"}
    if len(raw) >= minimum_size:
        packed = gzip.compress(raw, compresslevel=1)
        if len(packed) < len(raw):
            headers["Content-Encoding"] = "gzip"
            return packed, headers
    return raw, headers


PREVIEW_BYTES = 200
"""How much of an answer a :class:`BadAnswer` quotes."""


class BadAnswer(ValueError):
    """The rollout API answered a call with a success status but a body that is not the
    route's JSON (not JSON at all, or not an object); ``preview`` is its first bytes."""

    def __init__(self, path: str, status: int, body: bytes, why: str) -> None:
        self.path, self.status, self.preview = path, status, body[:PREVIEW_BYTES]
        more = "..." if len(body) > PREVIEW_BYTES else ""
        super().__init__(
            f"{path} answered {status} with {why} ({len(body)} bytes): {self.preview!r}{more}"
        )


@dataclass(frozen=True)
class PostResult:
    """Outcome of one POST of scored data.

    ``status`` is the HTTP status, or 0 when the request never got an answer
    (connection refused, timeout). ``retry_after`` is the server's ``Retry-After``
    in seconds, when it sent one.
    """

    status: int
    detail: str = ""
    retry_after: float | None = None

    @property
    def ok(self) -> bool:
        """True when the API acknowledged the data."""
        return 200 <= self.status < 300

    @property
    def rejected(self) -> bool:
        """True for a client error that re-sending cannot fix (4xx other than 408/429)."""
        return 400 <= self.status < 500 and self.status not in (408, 429)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _json_object(path: str, response: httpx.Response) -> Dict[str, Any]:
    body = response.content
    try:
        data = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        raise BadAnswer(path, response.status_code, body, "a body that is not JSON") from None
    if not isinstance(data, dict):
        why = f"a JSON {type(data).__name__} where an object was expected"
        raise BadAnswer(path, response.status_code, body, why)
    return data


class RolloutAPIClient:
    """Talks to ``run-api`` on behalf of one environment.

    Example::

        client = RolloutAPIClient("http://127.0.0.1:8000")
        info = await client.info()
        await client.aclose()
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if transport is None:
            transport = AiohttpTransport(
                max_connections=MAX_CONNECTIONS, max_answer_bytes=MAX_ANSWER_BYTES
            )
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
            ),
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def _get_json(self, path: str, **params: Any) -> Any:
        """The JSON object a ``GET`` answers; :class:`BadAnswer` when the body is not one."""
        response = await self._client.get(path, params=params or None, headers=auth_headers())
        response.raise_for_status()
        return _json_object(path, response)

    async def wandb_info(self) -> Dict[str, Any]:
        """``GET /wandb_info`` → ``{"group", "project"}``."""
        return await self._get_json("/wandb_info")

    async def info(self) -> Dict[str, Any]:
        """``GET /info`` → ``{"batch_size", "max_token_len"}``."""
        return await self._get_json("/info")

    async def status_env(self, env_id: int) -> Dict[str, Any]:
        """``GET /status-env?env_id=N`` (query parameter; docs/design.md, "Rollout API routes")."""
        return await self._get_json("/status-env", env_id=env_id)

    async def register_env(self, payload: Dict[str, Any]) -> Dict[str, Any]:
        """``POST /register-env``; raises on an HTTP error status."""
        response = await self._client.post("/register-env", json=payload, headers=auth_headers())
        response.raise_for_status()
        return _json_object("/register-env", response)

    async def disconnect_env(self, env_id: int) -> None:
        """``POST /disconnect-env``; failures are logged, not raised (used on shutdown)."""
        try:
            response = await self._client.post(
                "/disconnect-env", json={"env_id": env_id}, headers=auth_headers()
            )
            response.raise_for_status()
        except httpx.HTTPError as err:
            logger.warning("disconnect-env failed: %s", err)

    async def post_scored(self, payload: Any) -> PostResult:
        """POST one group (a dict) to ``/scored_data`` or several (a list) to ``/scored_data_list``.

        Never raises for HTTP or connection errors; the result says what happened.
        """
        path = "/scored_data_list" if isinstance(payload, list) else "/scored_data"
        body, headers = encode_body(payload)
        headers.update(auth_headers())
        try:
            response = await self._client.post(path, content=body, headers=headers)
        except httpx.HTTPError as err:
            return PostResult(status=0, detail=f"{type(err).__name__}: {err}")
        if response.status_code < 300:
            return PostResult(status=response.status_code)
        return PostResult(
            status=response.status_code,
            detail=response.text[:500],
            retry_after=_retry_after(response),
        )
