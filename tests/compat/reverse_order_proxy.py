"""An HTTP proxy that answers concurrent generation requests in reverse order.

Run as a process in front of an inference server::

    python reverse_order_proxy.py --upstream http://127.0.0.1:9001 --port 9002 --batch 4

GET requests (health, models) pass straight through. POST requests are held until
``--batch`` of them are waiting (or ``--wait`` seconds passed since the first), then all
are forwarded to the upstream at once and answered last-arrived first, ``--gap`` seconds
apart, so the client sees the answers to its concurrent rollouts out of order.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web


class ReverseBatches:
    """Holds POST requests and answers each full batch in reverse arrival order."""

    def __init__(self, upstream: str, batch: int, wait: float, gap: float):
        self.upstream = upstream.rstrip("/")
        self.batch = batch
        self.wait = wait
        self.gap = gap
        self.pending: list[tuple[str, bytes, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.session: aiohttp.ClientSession | None = None

    async def forward(self, method: str, path: str, body: bytes) -> tuple[int, bytes, str]:
        """Send one request upstream; the status, body and content type it answered."""
        assert self.session is not None
        async with self.session.request(
            method,
            self.upstream + path,
            data=body or None,
            headers={"Content-Type": "application/json"} if body else None,
        ) as resp:
            return resp.status, await resp.read(), resp.content_type

    async def handle(self, request: web.Request) -> web.Response:
        """Pass GETs through; hold POSTs for their batch."""
        path = request.path_qs
        body = await request.read()
        if request.method != "POST":
            status, data, ctype = await self.forward(request.method, path, body)
            return web.Response(status=status, body=data, content_type=ctype)
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.pending.append((path, body, done))
        if len(self.pending) >= self.batch:
            self.release()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.wait, self.release)
        status, data, ctype = await done
        return web.Response(status=status, body=data, content_type=ctype)

    def release(self) -> None:
        """Start answering the held requests (reversed)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        held, self.pending = self.pending, []
        if held:
            asyncio.ensure_future(self.answer_reversed(held))

    async def answer_reversed(self, held: list[tuple[str, bytes, asyncio.Future]]) -> None:
        results = await asyncio.gather(
            *(self.forward("POST", path, body) for path, body, _ in held), return_exceptions=True
        )
        for (_, _, done), result in reversed(list(zip(held, results, strict=True))):
            if isinstance(result, BaseException):
                result = (502, str(result).encode(), "text/plain")
            done.set_result(result)
            await asyncio.sleep(self.gap)


def main() -> None:
    """Serve the proxy until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--wait", type=float, default=2.0)
    parser.add_argument("--gap", type=float, default=0.2)
    args = parser.parse_args()
    proxy = ReverseBatches(args.upstream, args.batch, args.wait, args.gap)

    async def open_session(_: web.Application) -> None:
        proxy.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))

    async def close_session(_: web.Application) -> None:
        if proxy.session is not None:
            await proxy.session.close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
