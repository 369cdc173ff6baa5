"""Small ASGI pieces the HTTP tests build their stand-in apps from."""

from __future__ import annotations

from atroposlib.http.asgi import Receive, Send

__all__ = ["read_body", "send_plain"]


async def read_body(receive: Receive) -> bytes:
    """Every chunk of the request body, joined (what the middleware under test let through)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def send_plain(send: Send, body: bytes, status: int = 200) -> None:
    """Answer ``body`` with ``status`` and no headers."""
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})
