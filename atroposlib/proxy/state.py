"""The proxy's state: the server pool, tokenizers and bounded sessions (:class:`ProxyState`,
kept on ``app.state.proxy``; the routes read everything from it).

Every session holds a ``ManagedServer`` whose nodes (token ids, masks, logprobs, text)
live in the proxy's memory until the environment reads them and deletes the session. Left
unbounded, a client that opens sessions and never deletes them, or one that asks for a
long prompt many times over, grows the proxy until it dies. :class:`SessionStore` bounds
that: a number of sessions (429 when full), an idle time after which a session is
evicted (counted), a number of nodes per session (429) and the tokens held by all
sessions together (503). Time comes from an injected clock, so tests never sleep.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from atroposlib.envs.server_handling._common import load_tokenizer
from atroposlib.envs.server_handling.managed_server import ManagedServer, resolve_tokenizer
from atroposlib.envs.server_handling.server_baseline import config_value
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator
from atroposlib.http.answers import openai_error_type
from atroposlib.http.client_session import DEFAULT_MAX_ANSWER_BYTES
from atroposlib.http.openai_protocol import OpenAIError
from atroposlib.proxy.upstream import UpstreamPolicy

logger = logging.getLogger(__name__)


@dataclass
class SessionState:
    """One proxy session: its ``ManagedServer`` and when it was made and last used.

    ``base_url`` is the inference server the session is pinned to; ``created_at`` and
    ``last_accessed`` are wall-clock times (``time.time()``) for display, while idle
    expiry uses the store's monotonic clock.
    """

    uuid: str
    managed_server: ManagedServer
    translator: ToolCallTranslator | None
    model_name: str
    base_url: str | None = None
    created_at: float = field(default_factory=time.time)
    last_accessed: float = field(default_factory=time.time)
    requests: int = 0
    in_flight: int = 0
    reserved_nodes: int = 0
    num_nodes: int = 0
    stored_tokens: int = 0
    touched: float = 0.0


def _limit(default: float, description: str) -> Any:
    # The description is also the proxy's command-line help for the field (``--max-sessions``).
    return field(default=default, metadata={"help": description})


@dataclass
class SessionLimits:
    """Bounds on what sessions may hold (see the module docstring); each field is also a
    command-line flag of the proxy, with its ``metadata["help"]`` as the help."""

    max_sessions: int = _limit(4096, "Sessions held at once (creating one more is a 429).")
    session_idle_s: float = _limit(
        3600.0,
        "Evict a session unused for this many seconds, with no request in flight (0: never); "
        "evictions are counted in /health.",
    )
    max_session_nodes: int = _limit(
        1024, "Nodes one session may hold (a request that could pass it is a 429)."
    )
    max_stored_tokens: int = _limit(
        16_000_000,
        "Tokens all sessions' nodes may hold together (a request that could pass it is a 503).",
    )


class SessionStore:
    """The proxy's sessions, least recently used first, with :class:`SessionLimits`.

    Counters (``evicted_idle``, ``refused_sessions``, ``refused_nodes``,
    ``refused_tokens``) report what the bounds did, ``abandoned_requests`` and
    ``withdrawn_nodes`` the requests whose client left before its answer was delivered
    (their nodes are not kept); ``/health`` shows them.
    """

    def __init__(
        self, limits: SessionLimits | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.limits = limits or SessionLimits()
        self.clock = clock
        self._sessions: collections.OrderedDict[str, SessionState] = collections.OrderedDict()
        self.stored_tokens = 0
        self.reserved_tokens = 0  # admitted generations still running may add this many
        self.evicted_idle = 0
        self.refused_sessions = 0
        self.refused_nodes = 0
        self.refused_tokens = 0
        self.abandoned_requests = 0  # the client left before its answer was delivered
        self.withdrawn_nodes = 0  # nodes of those requests, taken back

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def values(self) -> Iterator[SessionState]:
        """The sessions, least recently used first."""
        return iter(list(self._sessions.values()))

    def counters(self) -> dict[str, int]:
        """What the bounds did so far, and the tokens held now."""
        return {
            "sessions_evicted": self.evicted_idle,
            "sessions_refused": self.refused_sessions,
            "requests_refused_nodes": self.refused_nodes,
            "requests_refused_tokens": self.refused_tokens,
            "stored_tokens": self.stored_tokens,
            "requests_abandoned": self.abandoned_requests,
            "nodes_withdrawn": self.withdrawn_nodes,
        }

    def expire(self) -> int:
        """Evict the sessions idle for longer than ``session_idle_s``; how many were."""
        idle_s = self.limits.session_idle_s
        if idle_s <= 0:
            return 0
        cutoff = self.clock() - idle_s
        expired = [s for s in self._sessions.values() if s.touched <= cutoff and s.in_flight == 0]
        for session in expired:
            self._drop(session.uuid)
            logger.warning(
                "evicted proxy session %s after %.0fs idle (%d nodes, %d tokens dropped)",
                session.uuid,
                idle_s,
                session.num_nodes,
                session.stored_tokens,
            )
        self.evicted_idle += len(expired)
        return len(expired)

    def check_room(self) -> None:
        """:class:`OpenAIError` 429 when ``max_sessions`` are held (after evicting idle ones)."""
        self.expire()
        if len(self._sessions) >= self.limits.max_sessions:
            self.refused_sessions += 1
            raise OpenAIError(
                f"the proxy holds {len(self._sessions)} sessions, its limit "
                f"(--max-sessions {self.limits.max_sessions}): DELETE finished sessions "
                "(idle ones are evicted after --session-idle-s) and retry",
                status=429,
                type="rate_limit_error",
            )

    def add(self, session: SessionState) -> None:
        """Hold ``session``; :class:`OpenAIError` 429 when ``max_sessions`` are held."""
        self.check_room()
        session.touched = self.clock()
        self._sessions[session.uuid] = session

    def get(self, session_id: str) -> SessionState:
        """The session (marked as used now); 404 when unknown, deleted or evicted."""
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise OpenAIError(
                f"unknown session {session_id!r} (never created, deleted, or evicted after "
                f"{self.limits.session_idle_s:g}s idle)",
                param="uuid",
                status=404,
                type=openai_error_type(404),
            )
        self._touch(session)
        return session

    def _touch(self, session: SessionState) -> None:
        session.touched = self.clock()
        session.last_accessed = time.time()
        self._sessions.move_to_end(session.uuid)

    def remove(self, session_id: str) -> SessionState:
        """Forget a session (404 when unknown)."""
        session = self.get(session_id)
        self._drop(session_id)
        return session

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self.stored_tokens -= session.stored_tokens

    def admit(self, session: SessionState, n: int, max_new_tokens: int, prompt_bound: int) -> int:
        """Refuse a generation that could pass a bound, before anything is sent; else
        reserve its room (until :meth:`release`) and return the tokens reserved.

        ``n`` nodes may be added, each holding at most ``prompt_bound + max_new_tokens``
        tokens (``prompt_bound``: the request's size in bytes, never fewer than its prompt's
        tokens). Generations running at once count with what they reserved, so concurrent
        requests cannot pass the bounds together.
        """
        limits = self.limits
        estimate = n * (prompt_bound + max_new_tokens)
        if n > limits.max_session_nodes or estimate > limits.max_stored_tokens:
            self.refused_tokens += int(estimate > limits.max_stored_tokens)
            self.refused_nodes += int(n > limits.max_session_nodes)
            raise OpenAIError(
                f"this request may store {n} nodes of up to {prompt_bound + max_new_tokens} "
                f"tokens each (prompt of up to {prompt_bound} + max_tokens {max_new_tokens}), "
                f"more than the proxy holds (--max-session-nodes {limits.max_session_nodes}, "
                f"--max-stored-tokens {limits.max_stored_tokens}): lower n, max_tokens or "
                "the prompt",
                param="n",
                status=400,
            )
        if session.num_nodes + session.reserved_nodes + n > limits.max_session_nodes:
            self.refused_nodes += 1
            raise OpenAIError(
                f"session {session.uuid} holds {session.num_nodes} nodes and this request may "
                f"add {n}, above the limit of {limits.max_session_nodes} per session "
                "(--max-session-nodes): read the nodes, then POST /{uuid}/reset or DELETE the "
                "session",
                param="n",
                status=429,
                type="rate_limit_error",
            )
        if self.stored_tokens + self.reserved_tokens + estimate > limits.max_stored_tokens:
            self.refused_tokens += 1
            raise OpenAIError(
                f"the proxy's sessions hold {self.stored_tokens} tokens (running requests may "
                f"add {self.reserved_tokens}) and this request may add up to {estimate}, above "
                f"--max-stored-tokens {limits.max_stored_tokens}: "
                "read and DELETE finished sessions, then retry",
                status=503,
                type="server_error",
            )
        session.reserved_nodes += n
        self.reserved_tokens += estimate
        return estimate

    def release(self, session: SessionState, n: int, reserved: int) -> None:
        """End an admitted generation: drop its reservation and recount what it stored."""
        session.reserved_nodes -= n
        self.reserved_tokens -= reserved
        self.account(session)

    def account(self, session: SessionState) -> None:
        """Recount the nodes and tokens ``session`` holds (after a request, reset or error)."""
        managed = session.managed_server
        nodes = list(getattr(managed, "current_nodes", ())) + list(
            getattr(managed, "sequences", {}).values()
        )
        tokens = sum(len(node.tokens) for node in nodes)
        if session.uuid in self._sessions:
            self.stored_tokens += tokens - session.stored_tokens
        session.num_nodes, session.stored_tokens = len(nodes), tokens


def _no_tokenizer(message: str) -> OpenAIError:
    return OpenAIError(message, param="tokenizer", status=409, type="invalid_state")


class ProxyState:
    """Everything the proxy's routes share: the server pool (None until ``POST /setup``),
    the tokenizers, the sessions, and the policies ``create_app`` was given.

    ``api_key_set`` says whether bearer auth is on (``/setup`` needs it); ``upstreams``
    which hosts ``/setup`` may point at; ``max_answer_bytes`` bounds each inference server
    answer the servers read.
    """

    def __init__(
        self,
        manager: ServerManager | None = None,
        tokenizer: Any = None,
        tool_parser: str | None = None,
        model_name: str = "unknown",
        limits: SessionLimits | None = None,
        *,
        api_key_set: bool = False,
        upstreams: UpstreamPolicy | None = None,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ):
        self.manager = manager
        self.tokenizer = tokenizer
        self.tool_parser = tool_parser
        self.model_name = model_name
        self.sessions = SessionStore(limits)
        self.api_key_set = api_key_set
        self.upstreams = upstreams or UpstreamPolicy()
        self.max_answer_bytes = max_answer_bytes
        self._tokenizers: dict[str, Any] = {}
        self.bound_transports(manager, check_peers=False)

    def require_manager(self) -> ServerManager:
        """The server pool; 409 before ``POST /setup`` gave one."""
        if self.manager is None:
            raise OpenAIError(
                "the proxy has no servers yet; POST /setup first", status=409, type="invalid_state"
            )
        return self.manager

    def bound_transports(self, manager: ServerManager | None, check_peers: bool) -> None:
        """Bound the answers ``manager``'s servers read; with ``check_peers`` (servers set up
        through ``/setup``) connect only to addresses the upstream policy allows."""
        for server in manager.servers if manager is not None else ():
            make = getattr(server, "transport", None)
            if not callable(make):
                continue
            transport = make()
            transport.max_answer_bytes = self.max_answer_bytes
            if check_peers:
                transport.peer_check = self.upstreams.peer_allowed

    def model_names(self) -> list[str]:
        """The names ``/v1/models`` lists: ``model_name`` when given, else the servers'."""
        if self.model_name != "unknown" or self.manager is None:
            return [self.model_name]
        names = {str(config_value(s.config, "model_name")) for s in self.manager.servers}
        return sorted(names) or [self.model_name]

    def server_model(self, server: Any) -> str:
        """The model name a session on ``server`` reports."""
        if self.model_name != "unknown":
            return self.model_name
        return str(config_value(getattr(server, "config", None), "model_name"))

    def tokenizer_for(self, server: Any) -> Any:
        """The proxy's tokenizer, else the server's own, else the one its config names."""
        if self.tokenizer is not None:
            return self.tokenizer
        return resolve_tokenizer(
            server,
            self.load_tokenizer,
            lambda: _no_tokenizer(
                "no tokenizer configured for this server: start the proxy with --tokenizer or "
                "POST /setup with 'tokenizer'"
            ),
            lambda name: _no_tokenizer(
                f"could not load tokenizer {name!r} named by the server's config: POST /setup "
                "with a loadable 'tokenizer'"
            ),
        )

    def load_tokenizer(self, name: str) -> Any:
        """``load_tokenizer(name)``, once per name (a failure, None, is remembered too).
        Blocking: the routes call it in a thread."""
        if name not in self._tokenizers:
            self._tokenizers[name] = load_tokenizer(name)
        return self._tokenizers[name]

    def fresh_tokenizer(self, name: str) -> Any:
        """``load_tokenizer(name)``, not remembered (``POST /setup`` may retry a name that
        failed). Blocking: the routes call it in a thread."""
        return load_tokenizer(name)

    def session(self, session_id: str) -> SessionState:
        """The session (404 when unknown, deleted or evicted)."""
        return self.sessions.get(session_id)
