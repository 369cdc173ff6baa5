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
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
import subprocess
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Mapping, Sequence, Union

from pydantic import BaseModel, Field

from atroposlib.envs.server_handling.errors import (
    NoHealthyServerError,
    ServerUnavailableError,
    is_client_error,
)
from atroposlib.envs.server_handling.openai_server import OpenAIServer, merge_choices
from atroposlib.envs.server_handling.policy_version import join_results
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.session_affinity import (
    CURRENT_SESSION,
    MAX_PINNED_SESSIONS,
    SessionRoute,
    new_session_id,
)

logger = logging.getLogger(__name__)

DEFAULT_LOCAL_PORTS = range(9004, 9008)
DEFAULT_TIMEOUT = ServerBaseline.model_fields["timeout"].default
_NO_EXCLUDE: frozenset[int] = frozenset()
SLURM_BASE_PORT = 9000
GPUS_PER_NODE = 8


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


def server_class_for(server_type: str) -> type[APIServer]:
    """The backend class for a config's ``server_type``."""
    from atroposlib.envs.server_handling.sglang_server import SGLangServer
    from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    classes: dict[str, type[APIServer]] = {
        "openai": OpenAIServer,
        "trl": TrlVllmServer,
        "sglang": SGLangServer,
        "vllm": VLLMServer,
    }
    if server_type not in classes:
        raise ValueError(f"unknown server_type {server_type!r}; expected one of {sorted(classes)}")
    return classes[server_type]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from e


def slurm_inference_urls(
    env: Mapping[str, str] | None = None, hostnames: Sequence[str] | None = None
) -> list[str] | None:
    """Inference server URLs of a SLURM allocation, or None with fewer than 2 nodes.

    Nodes after the first ``NUM_TRAINING_NODES`` (default 1) each run ``8 // INFER_TP``
    servers on ports 9000, 9001, ... ``hostnames`` overrides ``scontrol show hostnames``.
    """
    env = os.environ if env is None else env
    if hostnames is None:
        nodelist = env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            return None
        try:
            result = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(
                f"SLURM_JOB_NODELIST is set but `scontrol show hostnames` failed: {e}"
            ) from e
        hostnames = result.stdout.split()
    nodes = list(hostnames)
    if len(nodes) < 2:
        return None
    num_training = _env_int(env, "NUM_TRAINING_NODES", 1)
    tp = _env_int(env, "INFER_TP", 1)
    if tp < 1 or tp > GPUS_PER_NODE:
        raise ValueError(f"INFER_TP must be between 1 and {GPUS_PER_NODE}, got {tp}")
    return [
        f"http://{node}:{SLURM_BASE_PORT + i}/v1"
        for node in nodes[num_training:]
        for i in range(GPUS_PER_NODE // tp)
    ]


def _configs_from_template(template: ServerBaseline, urls: Sequence[str]) -> list[APIServerConfig]:
    base = template.model_dump()
    base.pop("base_url", None)
    base.pop("api_key", None)
    return [APIServerConfig(**{**base, "base_url": url, "api_key": "x"}) for url in urls]


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


class ServerManager:
    """Routes requests over a pool of inference servers.

    Example::

        manager = ServerManager([APIServerConfig(base_url="http://localhost:9001/v1",
                                                 model_name="Qwen/Qwen3-1.7B", server_type="vllm")])
        completion = await manager.chat_completion(messages=[...], n=4, max_tokens=256)
        async with manager.managed_server(tokenizer=tokenizer) as managed:
            await managed.chat_completion(messages=[...], n=4)
            nodes = managed.get_state()["nodes"]
    """

    sweep_interval: float = 0.1
    """Seconds between checks for callers whose wait deadline passed."""

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
    _sweeper: asyncio.Task[None] | None = None
    _timeout_cache: float | None = None
    _health_loop: asyncio.AbstractEventLoop | None = None

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

    def _init_routing(self) -> None:
        """Create the wait queues and subscribe to the servers' slot and health changes."""
        self._waiters: dict[bool, deque[tuple[asyncio.Future[int], frozenset[int], float]]] = {
            True: deque(),
            False: deque(),
        }
        self._affinity: dict[str, int] = {}  # session id -> index of its server
        for server in self.servers:
            for sem in (getattr(server, "sem", None), getattr(server, "eval_sem", None)):
                add_listener = getattr(sem, "add_listener", None)
                if add_listener is not None:
                    add_listener(self._dispatch)
            add_health_listener = getattr(server, "add_health_listener", None)
            if add_health_listener is not None:
                add_health_listener(self._dispatch)

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
    @staticmethod
    def _resolve_configs(
        configs: Union[ServerBaseline, Sequence[ServerBaseline]], slurm: bool
    ) -> list[ServerBaseline]:
        if isinstance(configs, ServerBaseline):
            if isinstance(configs, APIServerConfig) and configs.base_url:
                return [configs]  # one server at its base_url
            urls = slurm_inference_urls()
            if urls is None:
                urls = [f"http://localhost:{p}/v1" for p in DEFAULT_LOCAL_PORTS]
            return list(_configs_from_template(configs, urls))
        configs = list(configs)
        if not slurm or not configs:
            return configs
        urls = slurm_inference_urls()
        if urls is None:
            logger.warning(
                "slurm=True but fewer than 2 SLURM nodes found; using the configs as given"
            )
            return configs
        return list(_configs_from_template(configs[0], urls))

    # ----------------------------------------------------------------- slot routing
    @staticmethod
    def _free_slots(server: APIServer, is_train: bool) -> float:
        if not is_train:
            return server.eval_sem.available()
        free = server.sem.available()
        eval_sem = server.eval_sem
        if eval_sem._value < eval_sem.max_val:  # eval in progress: leave its share
            free -= eval_sem.available()
        return free

    def _pick(self, is_train: bool, exclude: frozenset[int] = frozenset()) -> int | None:
        best, best_slots = None, 0.0
        free_slots = self._free_slots
        for i, server in enumerate(self.servers):
            if not server._server_healthy or (exclude and i in exclude):
                continue
            slots = free_slots(server, is_train)
            if slots > best_slots:
                best, best_slots = i, slots
        return best

    def _take(self, idx: int, is_train: bool) -> bool:
        server = self.servers[idx]
        return (server.sem if is_train else server.eval_sem).try_acquire()

    def _release(self, idx: int, is_train: bool) -> None:
        server = self.servers[idx]
        (server.sem if is_train else server.eval_sem).release()

    def _dispatch(self) -> None:
        """Hand free slots to queued callers, FIFO, eval first."""
        waiters = self._waiters
        if not (waiters[True] or waiters[False]):
            return
        for is_train in (False, True):
            queue = self._waiters[is_train]
            while queue:
                fut, exclude, _ = queue[0]
                if fut.done():
                    queue.popleft()
                    continue
                idx = self._pick(is_train, exclude)
                if idx is None or not self._take(idx, is_train):
                    break
                queue.popleft()
                fut.set_result(idx)

    def _start_health_checks(self) -> None:
        loop = asyncio.get_running_loop()
        if self._health_loop is loop:
            return
        self._health_loop = loop
        for server in self.servers:
            server.start_health_check()

    async def _acquire_slot(self, is_train: bool, exclude: frozenset[int], timeout: float) -> int:
        """Take a slot on the best server, waiting FIFO up to ``timeout`` seconds.

        Waiters carry their deadline and one sweeper task expires them, so waiting
        costs no timer per request.
        """
        queue = self._waiters[is_train]
        if not queue:
            idx = self._pick(is_train, exclude)
            if idx is not None and self._take(idx, is_train):
                return idx
        if timeout <= 0:
            raise asyncio.TimeoutError()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        entry = (fut, exclude, loop.time() + timeout)
        queue.append(entry)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep_expired(), context=contextvars.Context())
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), is_train)  # granted just before we were cancelled
            try:
                queue.remove(entry)
            except ValueError:
                pass
            raise

    async def _sweep_expired(self) -> None:
        """Fail waiters whose deadline passed (runs while anyone waits)."""
        loop = asyncio.get_running_loop()
        while any(self._waiters.values()):
            await asyncio.sleep(self.sweep_interval)
            now = loop.time()
            for queue in self._waiters.values():
                if not queue:
                    continue
                expired = [e for e in queue if e[2] <= now or e[0].done()]
                for entry in expired:
                    queue.remove(entry)
                    if not entry[0].done():
                        entry[0].set_exception(asyncio.TimeoutError())

    def _wait_timeout(self) -> float:
        if self._timeout_cache is None:
            self._timeout_cache = float(
                max(getattr(s.config, "timeout", DEFAULT_TIMEOUT) for s in self.servers)
            )
        return self._timeout_cache

    def _describe(self, tried: Sequence[int] = ()) -> list[str]:
        """Every server with its health, marking those this request tried."""
        out = []
        for i, server in enumerate(self.servers):
            state = "healthy" if server.server_healthy else "unhealthy"
            mark = f", tried {tried.count(i)}x" if i in tried else ", not tried"
            out.append(f"{server.name} ({state}{mark})")
        return out

    async def _call(self, kind: str, kwargs: dict[str, Any]) -> Any:
        loop = asyncio.get_running_loop()
        if self._health_loop is not loop:
            self._start_health_checks()
        is_train = kwargs.get("split", "train") != "eval"
        started = loop.time()
        session = CURRENT_SESSION.get()
        if session is not None:
            return await self._call_session(kind, kwargs, is_train, started, session)
        # Fast path: a slot is free now and nobody is queued.
        first: tuple[int, BaseException] | None = None
        if not self._waiters[is_train]:
            idx = self._pick(is_train)
            if idx is not None and self._take(idx, is_train):
                try:
                    return await self.servers[idx].run_request(
                        kind, kwargs, slot_held=True, fail_fast=True
                    )
                except Exception as e:  # classified by _call_with_failover
                    first = (idx, e)
                finally:
                    self._release(idx, is_train)
        return await self._call_with_failover(kind, kwargs, is_train, started, first)

    async def _call_session(
        self, kind: str, kwargs: dict[str, Any], is_train: bool, started: float, session: str
    ) -> Any:
        """A request of ``session``: on its pinned server while that one is healthy (waiting
        for a slot there), else fail over and re-pin to the server that answers."""
        idx = self._affinity.get(session)
        first: tuple[int, BaseException] | None = None
        if idx is not None and idx < len(self.servers) and self.servers[idx]._server_healthy:
            held = self._take(idx, is_train)
            if not held:
                others = frozenset(i for i in range(len(self.servers)) if i != idx)
                try:
                    await self._acquire_slot(is_train, others, self._wait_timeout())
                    held = True
                except asyncio.TimeoutError:
                    pass  # its server stayed busy or went down: any server will do
            if held:
                try:
                    return await self.servers[idx].run_request(
                        kind, kwargs, slot_held=True, fail_fast=True
                    )
                except Exception as e:  # classified by _call_with_failover
                    first = (idx, e)
                finally:
                    self._release(idx, is_train)
        return await self._call_with_failover(kind, kwargs, is_train, started, first, session)

    def _pin(self, session: str, idx: int) -> None:
        affinity = self._affinity
        if affinity.get(session) == idx:
            return
        if session not in affinity and len(affinity) >= MAX_PINNED_SESSIONS:
            affinity.pop(next(iter(affinity)))  # the oldest pin
        affinity[session] = idx

    def _on_failure(self, idx: int, error: BaseException, exclude: set[int]) -> None:
        """Decide whether a failed attempt may be retried elsewhere; raise ``error`` if not."""
        server = self.servers[idx]
        if isinstance(error, ServerUnavailableError):
            if not server._health_enabled:
                exclude.add(idx)  # stays "healthy" without probes; do not retry it for this call
            logger.warning("request failed on %s, trying another server: %s", server.name, error)
            return
        if is_client_error(error) or isinstance(error, (NotImplementedError, KeyError, ValueError)):
            raise error
        exclude.add(idx)
        if not any(s.server_healthy and i not in exclude for i, s in enumerate(self.servers)):
            raise error
        logger.warning("request failed on %s, retrying on another server: %r", server.name, error)

    async def _call_with_failover(
        self,
        kind: str,
        kwargs: dict[str, Any],
        is_train: bool,
        started: float,
        first: tuple[int, BaseException] | None,
        session: str | None = None,
    ) -> Any:
        loop = asyncio.get_running_loop()
        deadline = started + self._wait_timeout()
        tried: list[int] = []
        exclude: set[int] = set()
        last_error: BaseException | None = None
        max_tries = 2 * len(self.servers) + 2
        if first is not None:
            tried.append(first[0])
            last_error = first[1]
            self._on_failure(first[0], first[1], exclude)
        while True:
            if len(tried) >= max_tries:
                raise NoHealthyServerError(
                    self._describe(tried), loop.time() - started, last_error
                ) from last_error
            try:
                # Past the deadline only servers not yet failed may be tried, without waiting.
                if tried and loop.time() >= deadline:
                    skip = frozenset(exclude | set(tried))
                else:
                    skip = frozenset(exclude) if exclude else _NO_EXCLUDE
                idx = await self._acquire_slot(is_train, skip, deadline - loop.time())
            except asyncio.TimeoutError:
                names = self._describe(tried)
                raise NoHealthyServerError(names, loop.time() - started, last_error) from last_error
            tried.append(idx)
            try:
                result = await self.servers[idx].run_request(
                    kind, kwargs, slot_held=True, fail_fast=True
                )
                if session is not None:
                    self._pin(session, idx)
                return result
            except Exception as e:
                last_error = e
                self._on_failure(idx, e, exclude)
            finally:
                self._release(idx, is_train)

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
