"""``ServerManager``: one entry point over a pool of inference servers.

Routing: every request goes to the healthy server with the most free slots (ties to
the lowest index). The manager takes the slot itself, atomically with the choice, and
callers that find no free slot wait in a FIFO queue that is served whenever a slot is
released or a server's health changes (no polling). A server that cannot be reached
is marked unhealthy by the failing request and the request is retried on another
server; when no server is healthy, callers wait up to the servers' ``timeout`` and then
get a ``NoHealthyServerError`` naming the servers.

Session affinity: a request made inside a session (a ``ManagedServer``'s, see
``session_affinity``) goes to the server its session is pinned to while that server is
healthy, waiting for a slot there rather than moving; when the server fails or is
unhealthy, the request fails over as any other and the session is pinned to the server
that answered it.

The routing is ``ServerRouter``'s (``server_routing``), the base of ``ServerManager``;
where the servers come from (backend classes, SLURM discovery, config templates) is
``server_discovery``. Their names stay importable from here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Mapping, Sequence, Union

from pydantic import BaseModel, Field

from atroposlib.envs.server_handling.errors import (  # noqa: F401 - original import path
    NoHealthyServerError,
    ServerUnavailableError,
    is_client_error,
)
from atroposlib.envs.server_handling.openai_server import OpenAIServer, merge_choices
from atroposlib.envs.server_handling.policy_version import join_results
from atroposlib.envs.server_handling.server_baseline import (  # noqa: F401 - original import path
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_discovery import (  # noqa: F401 - original import path
    DEFAULT_LOCAL_PORTS,
    GPUS_PER_NODE,
    SLURM_BASE_PORT,
    _configs_from_template,
    _env_int,
    resolve_server_configs,
    server_class_for,
    slurm_inference_urls,
)
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.server_routing import (  # noqa: F401 - original import path
    _NO_EXCLUDE,
    DEFAULT_TIMEOUT,
    ServerRouter,
)
from atroposlib.envs.server_handling.session_affinity import (  # noqa: F401 - original import path
    CURRENT_SESSION,
    MAX_PINNED_SESSIONS,
    SessionRoute,
    new_session_id,
)

logger = logging.getLogger(__name__)


class ServerManagerConfig(BaseModel):
    """Settings of the ``ServerManager`` itself (the CLI's ``--server.*``)."""

    slurm: bool = Field(False, description="Discover inference servers from the SLURM allocation.")
    testing: bool = Field(
        False, description="Use the in-process ServerHarness mock instead of servers."
    )
    max_n_completions: int = Field(
        8, ge=1, description="Requests with a larger n are split into chunks of at most this size."
    )
    proxy_url: str | None = Field(
        None,
        description="URL of a managed-server proxy; managed_server() then opens proxy sessions "
        "(also read from ATROPOS_PROXY_URL).",
    )


def _requested_n(kwargs: Mapping[str, Any]) -> int:
    """The ``n`` of a request (default 1); a non-integer or n < 1 is a clear ValueError."""
    n = kwargs.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    return n


def split_n(n: int, max_n: int) -> list[int]:
    """Chunk sizes for ``n`` completions at most ``max_n`` at a time (``split_n(20, 8) == [8, 8, 4]``)."""
    chunks = [max_n] * (n // max_n)
    if n % max_n:
        chunks.append(n % max_n)
    return chunks


class ServerManager(ServerRouter):
    """Routes requests over a pool of inference servers (the routing itself is
    ``ServerRouter``'s, in ``server_routing``).

    Example::

        manager = ServerManager([APIServerConfig(base_url="http://localhost:9001/v1",
                                                 model_name="Qwen/Qwen3-1.7B", server_type="vllm")])
        completion = await manager.chat_completion(messages=[...], n=4, max_tokens=256)
        async with manager.managed_server(tokenizer=tokenizer) as managed:
            await managed.chat_completion(messages=[...], n=4)
            nodes = managed.get_state()["nodes"]
    """

    # Defaults for managers built without ``__init__`` (``ServerManager.__new__(ServerManager)``
    # followed by ``manager.servers = [...]``, as tests and tools of the original do): every
    # public method then works with the constructor's defaults, and the routing state
    # (``_waiters`` and the slot listeners on the servers) is created on first use.
    max_n_completions: int = 8
    reasoning_config: ReasoningConfig | None = None
    tool_parser: str | None = None
    proxy_url: str | None = None
    use_proxy: bool = False
    testing: bool = False
    slurm: bool = False

    def __init__(
        self,
        configs: Union[ServerBaseline, Sequence[ServerBaseline]],
        server_class: type[APIServer] = APIServer,
        slurm: bool = False,
        testing: bool = False,
        max_n_completions: int = 8,
        reasoning_config: ReasoningConfig | None = None,
        proxy_url: str | None = None,
        use_proxy: bool = False,
        tool_parser: str | None = None,
    ):
        if max_n_completions < 1:
            raise ValueError("max_n_completions must be >= 1")
        self.max_n_completions = max_n_completions
        self.reasoning_config = reasoning_config
        self.tool_parser = tool_parser
        self.proxy_url = proxy_url or os.environ.get("ATROPOS_PROXY_URL") or None
        self.use_proxy = use_proxy or self.proxy_url is not None
        if self.use_proxy and not self.proxy_url:
            raise ValueError("use_proxy=True needs proxy_url or ATROPOS_PROXY_URL")
        self.testing = testing
        self.slurm = slurm
        if testing:
            self.servers: list[APIServer] = [ServerHarness()]
        else:
            server_configs = self._resolve_configs(configs, slurm)
            if not server_configs:
                raise ValueError("ServerManager needs at least one server config")
            if inspect.isabstract(server_class):
                cls = server_class_for(server_configs[0].server_type)
                self.servers = [
                    server_class_for(c.server_type)(c, reasoning_config=reasoning_config)
                    if c.server_type != server_configs[0].server_type
                    else cls(c, reasoning_config=reasoning_config)
                    for c in server_configs
                ]
            else:
                self.servers = [
                    server_class(c, reasoning_config=reasoning_config) for c in server_configs
                ]
        self._init_routing()

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails, i.e. on a manager built with ``__new__``:
        # the routing state is made on first use, so the hot path pays nothing for this.
        if name in ("_waiters", "_affinity"):
            self._init_routing()
            return self.__dict__[name]
        if name == "servers":
            raise AttributeError(
                "ServerManager has no servers: construct it with ServerManager(configs) "
                "or set manager.servers = [...]"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ----------------------------------------------------------------- configuration
    _resolve_configs = staticmethod(resolve_server_configs)

    async def wait_for_sem(self, is_training: bool = True) -> None:
        """Wait until some healthy server has a free slot (train or eval)."""
        is_train = bool(is_training)
        idx = await self._acquire_slot(is_train, frozenset(), self._wait_timeout())
        self._release(idx, is_train)

    # ----------------------------------------------------------------- public API
    async def chat_completion(self, **kwargs: Any) -> Any:
        """A ``ChatCompletion``; ``n`` above ``max_n_completions`` is split across requests."""
        n = _requested_n(kwargs)
        if n > self.max_n_completions:
            return await self._split_n("chat", kwargs, n, merge_choices)
        return await self._call("chat", kwargs)

    async def completion(self, **kwargs: Any) -> Any:
        """A ``Completion``; ``n`` above ``max_n_completions`` is split across requests."""
        n = _requested_n(kwargs)
        if n > self.max_n_completions:
            return await self._split_n("completion", kwargs, n, merge_choices)
        return await self._call("completion", kwargs)

    async def _split_n(
        self, kind: str, kwargs: dict[str, Any], n: int, merge: Callable[[list[Any]], Any]
    ) -> Any:
        """``n`` choices as requests of at most ``max_n_completions`` each, joined by ``merge``."""
        parts = await asyncio.gather(
            *(self._call(kind, {**kwargs, "n": c}) for c in split_n(n, self.max_n_completions))
        )
        return merge(list(parts))

    async def tokens_and_logprobs_completion(
        self, **kwargs: Any
    ) -> tuple[list[int], list[list[int]], list[list[float]], list[str]]:
        """``(prompt_tokens, output_tokens_list, output_logprobs_list, finish_reasons)``."""
        n = _requested_n(kwargs)
        if n > self.max_n_completions:
            return await self._split_n("tokens", kwargs, n, join_results)
        return await self._call("tokens", kwargs)

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Top-k prompt logprobs from the most available server (``prompt`` or ``input_ids``,
        ``top_k``).

        Servers that are not ``APIServer`` subclasses work too when they have
        ``get_logprobs`` and the semaphores (``sem``, ``eval_sem``): the request then holds a
        slot of the chosen server's semaphore around its ``get_logprobs``.
        """
        if all(isinstance(s, APIServer) for s in self.servers):
            return await self._call("logprobs", kwargs)
        return await self._call_plain("get_logprobs", kwargs)

    async def _call_plain(self, method: str, kwargs: dict[str, Any]) -> Any:
        """Call ``method`` on the healthy server with the most free slots, holding one of
        its slots (for duck-typed servers without ``run_request``)."""
        is_train = kwargs.get("split", "train") != "eval"
        candidates = [
            s
            for s in self.servers
            if getattr(s, "server_healthy", True) and callable(getattr(s, method, None))
        ]
        if not candidates:
            raise NotImplementedError(
                f"no healthy server implements {method}: "
                + ", ".join(type(s).__name__ for s in self.servers)
            )

        def free(server: Any) -> float:
            sem = getattr(server, "sem" if is_train else "eval_sem", None)
            available = getattr(sem, "available", None)
            if callable(available):
                return float(available())
            return float(getattr(sem, "_value", 0))

        server = max(candidates, key=free)  # max keeps the first of equals: lowest index
        sem = getattr(server, "sem" if is_train else "eval_sem", None)
        if sem is None:
            return await getattr(server, method)(**kwargs)
        async with sem:
            return await getattr(server, method)(**kwargs)

    @asynccontextmanager
    async def dedicated_server(self) -> AsyncIterator[APIServer]:
        """Hold one training slot of the most available server and yield that server."""
        self._start_health_checks()
        try:
            idx = await self._acquire_slot(True, frozenset(), self._wait_timeout())
        except asyncio.TimeoutError as e:
            raise NoHealthyServerError(self._describe(), self._wait_timeout()) from e
        try:
            yield self.servers[idx]
        finally:
            self._release(idx, True)

    def _server_for_managed(self, base_url: str | None) -> APIServer:
        if base_url is not None:
            for server in self.servers:
                if getattr(server.config, "base_url", None) == base_url:
                    return server
            raise ValueError(f"no server with base_url {base_url!r}")
        healthy = [s for s in self.servers if s.server_healthy] or self.servers
        return max(healthy, key=lambda s: s.sem._value)

    @asynccontextmanager
    async def managed_server(
        self,
        tokenizer: Any = None,
        base_url: str | None = None,
        preserve_think_blocks: bool = False,
    ) -> AsyncIterator[Any]:
        """A ``ManagedServer`` over one server, tracking tokens, masks and logprobs.

        With a proxy URL this opens a proxy session instead. An OpenAI-only server gives
        a ``DummyManagedServer`` when ``ATROPOS_ALLOW_DUMMY_MANAGED_SERVER`` is 1/true/yes.
        """
        from atroposlib.envs.server_handling.managed_server import (
            DummyManagedServer,
            ManagedServer,
        )

        if self.use_proxy and self.proxy_url:
            from atroposlib.envs.server_handling.proxy_client import ProxyManagedServer

            proxy = await ProxyManagedServer.create(self.proxy_url, base_url=base_url)
            try:
                yield proxy
            finally:
                await proxy.close()
            return
        server = self._server_for_managed(base_url)
        session = new_session_id()
        # Without a named base_url the session's requests go through the manager: its
        # first request pins it to the freest server at that moment (trajectories opened
        # together spread over the servers) and the pin moves when that server fails.
        backend: Any = server
        if base_url is None and isinstance(server, APIServer):
            backend = SessionRoute(self, server)
        if supports_tokens(server):
            managed: Any = ManagedServer(
                backend,
                tokenizer=tokenizer,
                tool_parser=self.tool_parser,
                preserve_think_blocks=preserve_think_blocks,
                session_id=session,
            )
        else:
            flag = os.environ.get("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "").strip().lower()
            if flag not in ("1", "true", "yes"):
                raise NotImplementedError(
                    f"{type(server).__name__} cannot return tokens and logprobs, so ManagedServer "
                    "cannot track them; use server_type='vllm' or 'sglang', or set "
                    "ATROPOS_ALLOW_DUMMY_MANAGED_SERVER=1 for placeholder tokens (not for training)"
                )
            managed = DummyManagedServer(backend, tokenizer=tokenizer, session_id=session)
        try:
            yield managed
        finally:
            managed.reset()
            self._affinity.pop(session, None)

    def note_weights_update(self, version: int) -> None:
        """Tell every server that it now serves weights ``version`` (used as the policy
        version of answers from servers that do not report one, e.g. plain vLLM)."""
        for server in self.servers:
            note = getattr(server, "note_weights_update", None)
            if callable(note):
                note(version)

    async def update_weight(self, weight: float) -> None:
        """Scale every server's usable capacity by ``weight`` (the env's weight from the API)."""
        for server in self.servers:
            pending = server.update_weight(weight)
            if inspect.isawaitable(pending):
                await pending

    def _get_server_base_url(self, server_idx: int = 0) -> str | None:
        """The ``base_url`` of server ``server_idx`` (None when it has none or there is no
        such server)."""
        if not 0 <= server_idx < len(self.servers):
            return None
        config = getattr(self.servers[server_idx], "config", None)
        return getattr(config, "base_url", None) or None

    async def wandb_metrics(
        self, metrics_dict: dict[str, Any] | None = None, server_name: str | None = None
    ) -> dict[str, Any]:
        """Metrics of every server (``server/server_{i}_*``) plus the healthy-server count."""
        metrics = {} if metrics_dict is None else metrics_dict
        for i, server in enumerate(self.servers):
            name = f"{server_name}_{i}" if server_name else f"server_{i}"
            await server.wandb_metrics(metrics, name)
        metrics["server/healthy_servers"] = sum(1 for s in self.servers if s.server_healthy)
        return metrics

    async def close(self) -> None:
        """Stop every server's background work and fail queued callers."""
        for queue in self.__dict__.get("_waiters", {}).values():
            while queue:
                fut = queue.popleft()[0]
                if not fut.done():
                    fut.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except (asyncio.CancelledError, RuntimeError):
                pass
            self._sweeper = None
        for server in self.servers:
            await server.close()

    async def __aenter__(self) -> ServerManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def supports_tokens(server: APIServer) -> bool:
    """Whether ``server`` implements ``tokens_and_logprobs_completion`` (ManagedServer needs it)."""
    if not isinstance(server, APIServer):
        return callable(getattr(server, "tokens_and_logprobs_completion", None))
    impl = type(server)._tokens_and_logprobs_completion_wrapper
    return impl is not APIServer._tokens_and_logprobs_completion_wrapper and (
        impl is not OpenAIServer._tokens_and_logprobs_completion_wrapper
    )
