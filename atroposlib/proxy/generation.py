"""One generation request of a proxy session: its bounds, the mapping of its failures to
status classes, and delivery (a session keeps only the nodes of answers it delivered).

A request runs as :func:`answer`: the session admits it within its bounds
(:meth:`~atroposlib.proxy.state.SessionStore.admit`), the generation runs while the
client's connection is watched (:class:`~atroposlib.proxy.delivery.ClientWatch`), and the
nodes it stored are taken back when the answer does not reach the client.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from atroposlib.http.openai_protocol import ClientGone, OpenAIError
from atroposlib.proxy.delivery import STORED, ClientWatch, Stored
from atroposlib.proxy.state import ProxyState, SessionState
from atroposlib.proxy.upstream import UPSTREAM_REACHED, UPSTREAM_USAGE, proxy_error_for

logger = logging.getLogger(__name__)

BuildAnswer = Callable[[Any, "list[int] | None"], Response]
"""``build(completion, usage)``: the response for a finished generation."""


async def run_call(coro: Awaitable[Any]) -> Any:
    """Await a ``ManagedServer`` call, its failure mapped to its status class (see
    :func:`~atroposlib.proxy.upstream.proxy_error_for`): before the inference server was
    called the fault is the client's input, from then on the inference server's."""
    reached = [False]
    token = UPSTREAM_REACHED.set(reached)
    try:
        return await coro
    except OpenAIError:
        raise
    except Exception as e:  # never a bare 500
        raise proxy_error_for(e, reached[0]) from e
    finally:
        UPSTREAM_REACHED.reset(token)


async def _generate(
    state: ProxyState,
    session: SessionState,
    call: Any,
    body: Any,
    raw_size: int,
    watch: ClientWatch,
) -> Any:
    """Run one generation of ``session`` within the bounds (cancelled when the client
    disconnects, see ``watch``); nodes are recounted after."""
    max_new = body.max_tokens or body.max_completion_tokens or 0
    try:
        reserved = state.sessions.admit(session, body.n, max_new, raw_size)
    except OpenAIError:
        call.close()  # never awaited: close it so it is not reported as forgotten
        raise
    session.requests += 1
    session.in_flight += 1
    try:
        return await watch.run(run_call(call))
    finally:
        session.in_flight -= 1
        state.sessions.release(session, body.n, reserved)


async def _generate_counted(
    state: ProxyState,
    session: SessionState,
    call: Any,
    body: Any,
    request: Request,
    count: bool,
    watch: ClientWatch,
) -> tuple[Any, list[int] | None]:
    """:func:`_generate`, and with ``count`` the request's ``[prompt_tokens,
    completion_tokens]`` as the inference server was asked and answered (else None)."""
    size = request.state.body_size
    if not count:
        return await _generate(state, session, call, body, size, watch), None
    usage = [0, 0]
    token = UPSTREAM_USAGE.set(usage)
    try:
        return await _generate(state, session, call, body, size, watch), usage
    finally:
        UPSTREAM_USAGE.reset(token)


def _undelivered(state: ProxyState, session: SessionState, stored: Stored, when: str) -> None:
    """The client left ``when``: take back what its request stored, and count it."""
    withdrawn = session.managed_server.withdraw(stored) if stored else 0
    state.sessions.account(session)
    state.sessions.abandoned_requests += 1
    state.sessions.withdrawn_nodes += withdrawn
    logger.info("session %s: %s (%d node(s) not kept)", session.uuid, when, withdrawn)


async def answer(
    state: ProxyState,
    session: SessionState,
    call: Any,
    body: Any,
    request: Request,
    count: bool,
    build: BuildAnswer,
) -> Response:
    """Generate and answer ``build(completion, usage)`` (``usage`` counted when ``count``),
    keeping the request's nodes only when the answer is delivered: a client that
    disconnects cancels the generation, and one gone before the answer's end (or an answer
    that fails after the generation) takes back its nodes."""
    stored: Stored = []
    token = STORED.set(stored)
    watch = ClientWatch(request.receive)
    try:
        completion, usage = await _generate_counted(
            state, session, call, body, request, count, watch
        )
        response = build(completion, usage)
    except ClientGone:
        _undelivered(state, session, stored, "the client left before its answer was ready")
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        watch.stop()
        if stored:
            _undelivered(state, session, stored, "its answer failed after the generation")
        raise
    finally:
        STORED.reset(token)
    return watch.deliver(
        response,
        lambda: _undelivered(state, session, stored, "the client left before its answer was sent"),
    )
