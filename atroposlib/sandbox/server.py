"""``atropos-sandbox-server``'s app: the original's ``POST /execute`` over the sandbox.

A request ``{"code": "...", "input": "..."}`` runs ``code`` as a Python program with
``input`` on stdin; the answer is ``{"output": stdout, "error": stderr}`` as the original's
Flask server gave it, plus ``returncode``, ``reason`` (an :class:`EndReason` value) and
``message``. A run that hit a bound has that bound's message at the end of ``error`` too, so
a client that only reads ``error`` sees why. A missing or empty ``code`` is 400 ``{"error":
"No code provided"}`` as in the original; other bad fields are 422 naming the field.

Security (docs/design.md, "Security model"): :func:`atroposlib.http.server.build_server`
puts the shared browser guard, bearer auth and body bound in front; the work itself is a
subprocess awaited on the event loop, at most ``max_concurrency`` at once and
``max_waiting`` queued (503 with ``Retry-After`` beyond).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from atroposlib.http.server import ServerOptions, build_server
from atroposlib.sandbox.result import EndReason, SandboxResult
from atroposlib.sandbox.runner import Sandbox
from atroposlib.sandbox.settings import SandboxServerSettings

__all__ = ["create_app", "execute_answer", "execute_error"]

_PLAIN_ENDS = (EndReason.OK, EndReason.ERROR)


def execute_error(status: int, message: str, param: str | None = None) -> bytes:
    """The original's error body, ``{"output": "", "error": message}``."""
    return json.dumps({"output": "", "error": message}).encode()


def execute_answer(result: SandboxResult) -> dict[str, Any]:
    """The ``/execute`` answer of one run."""
    error = result.stderr
    if result.reason not in _PLAIN_ENDS:
        error = f"{error.rstrip()}\n{result.message}".lstrip()
    return {
        "output": result.stdout,
        "error": error,
        "returncode": result.exit_code,
        "reason": result.reason.value,
        "message": result.message,
    }


def _refuse(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"output": "", "error": message}, status_code=status, headers=headers)


async def execute(request: Request) -> JSONResponse:
    """``POST /execute``: run ``code`` with ``input`` on stdin in a fresh sandbox."""
    state = request.app.state
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        return _refuse(400, "body: not valid JSON")
    if not isinstance(body, dict):
        return _refuse(422, "body: must be a JSON object with 'code' and 'input'")
    code = body.get("code")
    if not code:
        return _refuse(400, "No code provided")
    if not isinstance(code, str):
        return _refuse(422, "code: must be a string")
    stdin = body.get("input")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return _refuse(422, "input: must be a string (the program's stdin)")
    if state.waiting >= state.max_waiting + state.sandbox.max_concurrency:
        return _refuse(503, "too many executions waiting; retry later", **{"Retry-After": "1"})
    state.waiting += 1
    try:
        result = await state.sandbox.run_python(code, stdin=stdin)
    finally:
        state.waiting -= 1
    return JSONResponse(execute_answer(result))


async def health(request: Request) -> JSONResponse:
    """``GET /health``: the server is up and its sandbox works."""
    return JSONResponse({"status": "ok"})


def create_app(settings: SandboxServerSettings, sandbox: Sandbox | None = None) -> Starlette:
    """The app for ``settings``; creating the sandbox here fails at once where it cannot run.

    Raises:
        SandboxUnavailable: bubblewrap cannot isolate code on this machine.
    """
    sandbox = sandbox or Sandbox(
        settings.sandbox_config(), max_concurrency=settings.max_concurrency
    )
    app = Starlette(
        routes=[
            Route("/execute", execute, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/", health, methods=["GET"]),
        ]
    )
    app.state.sandbox = sandbox
    app.state.waiting = 0
    app.state.max_waiting = settings.max_waiting
    build_server(
        app,
        ServerOptions(
            bind_host=settings.host,
            api_key=settings.api_key,
            allowed_origins=tuple(settings.cors_origin or ()),
            max_body_bytes=int(settings.max_request_mb * 2**20),
            shape=execute_error,
        ),
    )
    return app
