"""HTTP response helpers shared by environments and tools."""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Dict

logger = logging.getLogger(__name__)


def auth_headers() -> Dict[str, str]:
    """``Authorization: Bearer $ATROPOS_API_KEY`` when that variable is set, else nothing (docs/design.md, "Security model").

    Every client of ``run-api`` (environments, trainer, tools) sends this header.
    """
    key = os.environ.get("ATROPOS_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def parse_http_response(resp: Any, logger: logging.Logger | None = None) -> Any:
    """Raise on an HTTP error status, otherwise return the decoded JSON body.

    Works with both ``aiohttp.ClientResponse`` (whose ``json()`` is a coroutine) and
    ``httpx.Response``. On an error status the body text is logged before raising, so
    the reason a server gave is never lost.

    Example::

        async with session.get(url) as resp:
            data = await parse_http_response(resp, logger)
    """
    log = logger or globals()["logger"]
    status = getattr(resp, "status", None)
    if status is None:
        status = getattr(resp, "status_code", 0)
    if status >= 400:
        text = resp.text
        body = await text() if inspect.iscoroutinefunction(text) else text
        log.error("HTTP %s from %s: %s", status, getattr(resp, "url", "?"), str(body)[:500])
        resp.raise_for_status()
    data = resp.json()
    if inspect.isawaitable(data):
        data = await data
    return data
