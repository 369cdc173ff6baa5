"""``POST /pause`` and ``POST /resume``: quiesce generation around a weight sync.

Trainers that write weights in place, free accelerator memory for a sync, or want no
sample of a batch to straddle an update, ask the server to stop generating first:

- ``POST /pause {"mode": "finish"}`` (the default): new generation requests are **held**
  (they wait, nothing is refused), the requests already in flight run to completion, and
  the call answers once none is left (or after ``timeout`` seconds, with
  ``"drained": false``);
- ``POST /pause {"mode": "hold"}``: the engine stops stepping at once; in-flight requests
  keep their place and continue on ``/resume``. If the weights are swapped meanwhile, held
  non-streamed requests are restarted from their prompt on the new weights (after
  ``--swap-drain-timeout``), so every answer still comes from one version;
- ``POST /resume``: held requests go on.

A pause ends by itself after ``max_pause_seconds`` (default 600, logged) so that a trainer
that died mid-sync cannot wedge the server. ``/update_weights`` works while paused.
Both routes, and ``GET /pause``, answer the pause state: ``{"paused", "mode", "in_flight",
"held", "drained", "version"}``. ``GET /weights_history`` lists every swap the server made
(``[{"version", "path", "time"}]``, oldest first): the ground truth of which weights were
served when.

Generation routes are gated by :class:`PauseMiddleware` (inside the auth and browser
checks, so an unauthenticated request is refused, not held), which also names the weight
version of each non-streamed answer in the ``X-Atropos-Policy-Version`` header.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, Callable, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from atroposlib.http.headers import POLICY_VERSION_HEADER
from atroposlib.utils.aio import within

logger = logging.getLogger(__name__)

GATED_PATHS = frozenset(
    ("/generate", "/v1/completions", "/v1/chat/completions", "/health_generate")
)


class PauseRequest(BaseModel):
    """``POST /pause``."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["finish", "hold"] = Field(
        "finish",
        description="finish: let in-flight requests complete and wait for them; "
        "hold: stop stepping now, in-flight requests continue on /resume.",
    )
    timeout: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="Seconds to wait for in-flight requests to finish (finish) or for the "
        "step in progress to end (hold).",
    )
    max_pause_seconds: float = Field(
        600.0, gt=0, le=86400, description="Resume by itself after this long."
    )


class PauseGate:
    """The pause state and the count of generation requests inside the server."""

    def __init__(self) -> None:
        self.paused = False
        self.mode: str | None = None
        self.in_flight = 0
        self.held = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._auto_resume: asyncio.TimerHandle | None = None
        self._on_resume: Callable[[], None] | None = None

    async def enter(self) -> None:
        """Wait while paused, then count one request in."""
        while not self._open.is_set():
            self.held += 1
            try:
                await self._open.wait()
            finally:
                self.held -= 1
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """Count one request out."""
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def pause(
        self,
        mode: str,
        timeout: float,
        max_pause_seconds: float,
        on_resume: Callable[[], None] | None = None,
    ) -> bool:
        """Pause; for ``finish``, wait up to ``timeout`` for in-flight requests. True when
        none is left in flight."""
        self.paused, self.mode = True, mode
        self._open.clear()
        self._on_resume = on_resume
        if self._auto_resume is not None:
            self._auto_resume.cancel()
        self._auto_resume = asyncio.get_running_loop().call_later(
            max_pause_seconds, self._expire, max_pause_seconds
        )
        if mode == "finish":
            try:
                await within(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning(
                    "pause: %d request(s) still in flight after %.1fs", self.in_flight, timeout
                )
        return self.in_flight == 0

    def resume(self) -> None:
        """Let held requests go on."""
        if self._auto_resume is not None:
            self._auto_resume.cancel()
            self._auto_resume = None
        callback, self._on_resume = self._on_resume, None
        if callback is not None:
            callback()
        self.paused, self.mode = False, None
        self._open.set()

    def _expire(self, seconds: float) -> None:
        logger.warning("pause lasted %.0fs without /resume; resuming", seconds)
        self._auto_resume = None
        self.resume()

    def state(self) -> dict[str, Any]:
        """The pause state as the routes report it."""
        return {
            "paused": self.paused,
            "mode": self.mode,
            "in_flight": self.in_flight,
            "held": self.held,
        }


_SERVED: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "atropos_served_versions", default=None
)


def record_served_version(version: int) -> None:
    """Called by the engine when a request's result is ready: the version that made it."""
    seen = _SERVED.get()
    if seen is not None:
        seen.append(int(version))


class PauseMiddleware:
    """Hold generation requests while paused and count those in flight (streams included).

    It also sets :data:`POLICY_VERSION_HEADER` on non-streamed generation answers: the
    oldest weight version among the results the request got from the engine.
    """

    def __init__(self, app: Any, gate: PauseGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        await self.gate.enter()
        seen: list[int] = []
        token = _SERVED.set(seen)

        async def send_with_version(message: Any) -> None:
            if message["type"] == "http.response.start" and seen:
                headers = list(message.get("headers") or [])
                headers.append((POLICY_VERSION_HEADER.lower().encode(), str(min(seen)).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_version)
        finally:
            _SERVED.reset(token)
            self.gate.leave()


router = APIRouter()
"""``POST /pause``, ``POST /resume``, ``GET /pause`` and ``GET /weights_history``; each reads
the engine and the gate from the app's ``ServingState`` (``app.state.serving``)."""


async def _serving(request: Request) -> Any:
    return request.app.state.serving


@router.post("/pause")
async def pause(body: PauseRequest, st: Any = Depends(_serving)) -> dict[str, Any]:
    started = time.monotonic()
    engine, gate = st.engine, st.pause_gate
    release = None
    if body.mode == "hold":
        engine.hold()
        release = engine.release
        try:  # answer once the step in progress, if any, has ended
            await within(engine.parked.wait(), body.timeout)
        except asyncio.TimeoutError:
            logger.warning("pause: the engine did not stop within %.1fs", body.timeout)
    elif engine.held:
        engine.release()
    drained = await gate.pause(body.mode, body.timeout, body.max_pause_seconds, release)
    logger.info("paused (%s) in %.3fs", body.mode, time.monotonic() - started)
    return {**gate.state(), "drained": drained, "version": engine.version}


@router.post("/resume")
async def resume(st: Any = Depends(_serving)) -> dict[str, Any]:
    gate = st.pause_gate
    was = gate.paused
    gate.resume()
    if st.engine.held:
        st.engine.release()
    if was:
        logger.info("resumed")
    return {**gate.state(), "drained": gate.in_flight == 0, "version": st.engine.version}


@router.get("/pause")
async def pause_state(st: Any = Depends(_serving)) -> dict[str, Any]:
    return {**st.pause_gate.state(), "version": st.engine.version}


@router.get("/weights_history")
async def weights_history(st: Any = Depends(_serving)) -> dict[str, Any]:
    return {"version": st.engine.version, "swaps": list(st.engine.swap_log)}
