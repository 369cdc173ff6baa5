"""Delivery for the proxy: a session keeps only the nodes of answers it
delivered.

A client that gives up on a request (its timeout, a retry, a closed stream) leaves the
proxy holding a generation it will never read, and an environment that trains on a
session's nodes (the longest one, say) would train on an answer nobody saw. So every
generation request is watched for the client's disconnect (ASGI ``http.disconnect``):

- while the generation runs, a disconnect cancels it: the upstream request is dropped
  (its connection closed, so the inference server can stop) and its slot on the proxy's
  server freed at once;
- a node stored for the request is withdrawn when the client is gone before the last
  bytes of the answer are handed to the connection (nodes are recorded per request by
  :class:`RecordingManagedServer`).

Both are counted (``requests_abandoned``, ``nodes_withdrawn`` in ``/health``) and logged.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Awaitable, Callable, TypeVar

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.http.openai_protocol import ClientGone
from atroposlib.utils.aio import cancel_and_wait

logger = logging.getLogger(__name__)

T = TypeVar("T")

Stored = list[tuple[Any, list[Any], dict[str, tuple[Any, Any]]]]
"""What one request stored: per store, the node it replaced (or None), its nodes, and in
tree mode the entries its nodes displaced."""

STORED: contextvars.ContextVar[Stored | None] = contextvars.ContextVar(
    "proxy_stored_nodes", default=None
)
"""Per request: where :class:`RecordingManagedServer` notes what the request stored."""


class RecordingManagedServer(ManagedServer):
    """A ``ManagedServer`` that notes what each proxy request stored (in :data:`STORED`),
    so that :meth:`withdraw` can take it back when the answer is not delivered."""

    def _store(self, extending: Any, parent: Any, nodes: list[Any], ticket: int) -> None:
        record = STORED.get()
        if record is not None:
            replaced = None
            displaced: dict[str, tuple[Any, Any]] = {}
            if self.track_tree:
                for node in nodes:
                    key = node.full_text
                    if key in self.sequences:
                        displaced[key] = (self.sequences[key], self._parents.get(key))
            elif extending is not None and any(n is extending for n in self.current_nodes):
                replaced = extending
            record.append((replaced, list(nodes), displaced))
        super()._store(extending, parent, nodes, ticket)

    def withdraw(self, stored: Stored) -> int:
        """Take back what a request stored (a continued node gets its place back); the
        number of nodes withdrawn."""
        count = 0
        for replaced, nodes, displaced in reversed(stored):
            if self.track_tree:
                for node in nodes:
                    key = node.full_text
                    if self.sequences.get(key) is node:
                        count += 1
                        if key in displaced:
                            self.sequences[key], self._parents[key] = displaced[key]
                        else:
                            del self.sequences[key]
                            self._parents.pop(key, None)
                continue
            places = [
                i for i, node in enumerate(self.current_nodes) if any(node is m for m in nodes)
            ]
            if not places:
                continue
            first = places[0]
            ticket, owner = self._tickets[first], self._owners[first]
            for i in reversed(places):
                del self.current_nodes[i], self._tickets[i], self._owners[i]
            count += len(places)
            if replaced is not None and not any(n is replaced for n in self.current_nodes):
                self.current_nodes.insert(first, replaced)
                self._tickets.insert(first, ticket)
                self._owners.insert(first, owner)
        return count


class ClientWatch:
    """Watches one request's connection for the client's disconnect.

    :meth:`run` races a generation against the disconnect (:class:`ClientGone`, the
    generation cancelled); :meth:`deliver` sends the answer and calls ``on_gone`` when the
    client left before its last bytes; :meth:`stop` ends the watch.
    """

    def __init__(self, receive: Callable[[], Awaitable[Message]]):
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Callable[[], Awaitable[Message]]) -> None:
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.gone.set()
                    return
        except Exception as err:  # a connection that cannot be read is one that is gone
            logger.info("reading a proxy request's connection failed: %s", err)
            self.gone.set()

    async def run(self, work: Awaitable[T]) -> T:
        """``await work``, or cancel it and raise :class:`ClientGone` when the client
        disconnects first."""
        task = asyncio.ensure_future(work)
        try:
            # The watch task ends only when the client is gone (or stop() was called).
            await asyncio.wait({task, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request itself was cancelled: so is its generation
            await cancel_and_wait(task)
            raise
        if not task.done():
            await cancel_and_wait(task)
            raise ClientGone()
        return task.result()

    def stop(self) -> None:
        """Stop watching (the answer's end makes the server report a disconnect too)."""
        self._task.cancel()

    def deliver(self, response: Response, on_gone: Callable[[], None]) -> Response:
        """``response``, sent so that ``on_gone()`` is called when the client was gone
        before the answer's last message (which is then not sent) or the answer ended
        before it."""
        return _Delivered(response, self, on_gone)


class _Delivered(Response):
    """An answer that reports whether its last message was handed to the connection."""

    def __init__(self, inner: Response, watch: ClientWatch, on_gone: Callable[[], None]):
        # Not Response.__init__: the inner response has its body and headers already.
        self.inner, self.watch, self.on_gone = inner, watch, on_gone
        self.status_code = inner.status_code
        self.background = inner.background
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        delivered = False

        async def checked(message: Message) -> None:
            nonlocal delivered
            if message["type"] == "http.response.body" and not message.get("more_body"):
                await asyncio.sleep(0)  # a disconnect already read is seen first
                self.watch.stop()  # the answer's end reads as a disconnect too
                if self.watch.gone.is_set():
                    return
                await send(message)
                delivered = True
                return
            await send(message)

        try:
            await self.inner(scope, receive, checked)
        finally:
            self.watch.stop()
            if not delivered:
                self.on_gone()
