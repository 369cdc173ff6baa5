"""The ASGI types every server module annotates with: Starlette's own, named once here."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send", "answer_lifespan"]


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge a bare ASGI app's lifespan startup and shutdown (it has nothing to set up)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
