"""``VerifiersEnv``: verifiers 0.4 tasksets (``verifiers.v1``) as an environment.

verifiers 0.4 describes an environment as a *taskset* (tasks plus their scorers:
``@vf.reward`` methods run by ``Task.score(trace)``) played by a *harness* (the agent
program) through an interception server that relays the program's model calls, as
streaming ``POST /chat/completions``, to an OpenAI-compatible endpoint. This adapter
makes that endpoint a session of our OpenAI proxy
(:mod:`atroposlib.envs.server_handling.managed_server_proxy`): every rollout gets its own
``ManagedServer`` session, so its tokens, logprobs and masks come from the session's
nodes (only the policy's own turns are trained), and the score of a rollout is the
reward verifiers computed for it (the sum of its weighted rewards).

It needs the proxy (``--proxy_url`` or ``ATROPOS_PROXY_URL``) and verifiers 0.4,
which cannot share a venv with the rest of atroposlib's extras (it needs ``openai<3``
and has the distribution name of the ``verifiers`` extra's 0.1.9): ``make
.venv-verifiers`` builds one from ``requirements-verifiers.lock`` (``pip install
'atroposlib[verifiers-v1]'`` elsewhere). Importing this module does not import verifiers.

Offline use: verifiers runs harness programs with ``uv``, which installs their
dependencies from PyPI. ``harness: auto`` (the default) keeps a taskset's own harness
when it ships one, and otherwise runs verifiers' tool-less chat program with this
interpreter (the ``atropos-chat`` harness, no network; see ``_vf_chat``), in the local
``subprocess`` runtime (verifiers' default is a remote sandbox). A taskset that loads a
hub dataset or needs a sandbox still needs the network.

Example::

    python environments/verifiers_v1_server.py process --env.taskset_id my_taskset \\
        --env.taskset_args '{"split": "train"}' --proxy_url http://127.0.0.1:9100 \\
        --openai.base_url http://127.0.0.1:9001/v1
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections import Counter
from typing import Any, Dict, Iterator, List, Literal, Tuple

from pydantic import Field

from atroposlib.envs.adapters._defaults import adapter_config_init
from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup, first_model_name
from atroposlib.envs.eval_helpers import drain_metrics, mean_of, run_eval_set
from atroposlib.envs.rollout_helpers import scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig

logger = logging.getLogger(__name__)

__all__ = ["VerifiersEnv", "VerifiersEnvConfig", "import_verifiers"]

EXTRA_HINT = (
    "VerifiersEnv needs verifiers 0.4 (`verifiers.v1`): install the extra "
    "'atroposlib[verifiers-v1]' in a venv of its own (it needs openai<3 and conflicts with "
    "the 'verifiers' extra); in this repository `make .venv-verifiers` builds one, then run "
    "the environment with .venv-verifiers/bin/python"
)
PROXY_HINT = (
    "VerifiersEnv talks to the model through the managed-server proxy: start it "
    "(python -m atroposlib.envs.server_handling.managed_server_proxy --config servers.json "
    "--port 9100) and pass --proxy_url http://127.0.0.1:9100 (or set ATROPOS_PROXY_URL)"
)


@functools.cache
def import_verifiers() -> Any:
    """``verifiers.v1``, or an ImportError that names the extra to install.

    The installed version is checked first (from its metadata, without importing it):
    the 0.1 line has no ``verifiers.v1`` and is slow to import. The module is kept after
    the first success: every rollout asks for it, and reading the metadata again scans
    the installed distributions on the event loop (about a millisecond each time)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise ImportError(f"{EXTRA_HINT} (verifiers is not installed)") from None
    if not Version("0.4") <= Version(installed) < Version("0.5"):
        raise ImportError(f"{EXTRA_HINT} (verifiers {installed} is installed)")
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ImportError(f"{EXTRA_HINT} ({type(err).__name__}: {err})") from err
    return vf


def _merge(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """``over`` deep-merged onto ``base`` (dicts merge, anything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class VerifiersEnvConfig(BaseEnvConfig):
    """``BaseEnvConfig`` plus which verifiers taskset runs and how."""

    taskset_id: str = Field(
        default="",
        description="verifiers taskset id: an importable top-level module (or a package of "
        "verifiers.v1.tasksets) exporting one vf.Taskset subclass in __all__.",
    )
    taskset_args: Dict[str, Any] = Field(
        default_factory=dict,
        description='The taskset\'s config fields for training (JSON, e.g. \'{"split": "train"}\').',
    )
    eval_taskset_args: Dict[str, Any] | None = Field(
        default=None,
        description="The taskset's config fields for evaluate (None: taskset_args).",
    )
    env_id: str = Field(
        default="",
        description="verifiers Env id to pair with the taskset (empty: the taskset's own, "
        "else verifiers' single-agent env).",
    )
    env_args: Dict[str, Any] = Field(
        default_factory=dict,
        description="Fields deep-merged onto verifiers' env config last (e.g. "
        '\'{"agent": {"max_turns": 4}}\').',
    )
    harness: str = Field(
        default="auto",
        description="Harness id of every agent: 'auto' (the taskset's own harness when it "
        "ships one, else atropos-chat), 'atropos-chat' (verifiers' chat loop run by this "
        "interpreter, offline), or any verifiers harness id (null, bash, ...: run with uv, "
        "which installs from PyPI).",
    )
    runtime: Literal["subprocess", "docker", "podman", "prime"] = Field(
        default="subprocess",
        description="Where harness programs run (verifiers' runtime type).",
    )
    max_turns: int | None = Field(default=8, ge=1, description="Model turns per rollout.")
    max_tokens_per_turn: int = Field(default=256, ge=1, description="Generation budget per turn.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature.")
    rollout_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest one agent run may take (verifiers' limit)."
    )
    shuffle: bool = Field(default=True, description="Shuffle a finite taskset with `seed`.")
    seed: int = Field(default=0, description="Seed of the shuffle.")
    eval_limit: int = Field(default=32, ge=0, description="Tasks evaluated (the first ones).")
    eval_temperature: float = Field(default=0.0, ge=0, description="Temperature of evaluate.")
    correct_threshold: float = Field(
        default=1.0, description="A rollout whose reward is at least this counts as correct."
    )


class VerifiersEnv(BaseEnv):
    """A verifiers 0.4 taskset; one rollout = one verifiers episode in its own proxy session."""

    name = "verifiers_v1"
    env_config_cls = VerifiersEnvConfig

    def __init__(
        self,
        config: VerifiersEnvConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: VerifiersEnvConfig = config
        self.iter = 0
        self.vf_env: Any = None
        self.tasks: List[Any] | None = None
        self._task_stream: Iterator[Any] | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self.rewards: List[float] = []
        self.failures: Counter = Counter()
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[VerifiersEnvConfig, List[APIServerConfig]]:
        return adapter_config_init(VerifiersEnvConfig, "verifiers_v1", max_token_length=4096)

    # ------------------------------------------------------------------ setup

    def vf_env_config(self, taskset_args: Dict[str, Any]) -> Any:
        """verifiers' env config for this run: the taskset, then every agent role set to
        this env's harness, runtime and limits, then ``env_args``."""
        vf = import_verifiers()
        cfg = self.config
        if not cfg.taskset_id:
            raise ValueError("env.taskset_id is required (a verifiers 0.4 taskset module)")
        if "." in cfg.taskset_id:
            raise ValueError(
                f"env.taskset_id {cfg.taskset_id!r}: verifiers imports a taskset as a "
                "top-level module; put its directory on PYTHONPATH and name the module"
            )
        harness = cfg.harness
        if harness == "auto":
            own = vf.default_harness_id(cfg.taskset_id)
            harness = own if own == cfg.taskset_id else "atropos-chat"
        if harness == "atropos-chat":
            from atroposlib.envs.adapters import _vf_chat

            _vf_chat.register()
        role = {
            "harness": {"id": harness},
            "runtime": {"type": cfg.runtime},
            "max_turns": cfg.max_turns,
            "timeout": {"rollout": cfg.rollout_timeout_s},
        }
        config_cls = vf.env_config_type(cfg.taskset_id, cfg.env_id)
        roles = [
            name
            for name, field in config_cls.model_fields.items()
            if isinstance(field.default, vf.AgentConfig)
        ]
        data: Dict[str, Any] = {"taskset": {**taskset_args, "id": cfg.taskset_id}}
        if cfg.env_id:
            data["id"] = cfg.env_id
        data.update({name: role for name in roles})
        return vf.resolve_env_config(_merge(data, cfg.env_args))

    async def setup(self) -> None:
        vf = import_verifiers()
        if not getattr(self.server, "use_proxy", False):
            raise RuntimeError(PROXY_HINT)
        await self._stop_serving()
        self.vf_env = vf.load_environment(self.vf_env_config(self.config.taskset_args))
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.vf_env.serving())
        self._serving = stack
        taskset = self.vf_env.taskset
        if taskset.bounded:
            self.tasks = list(taskset)
            if not self.tasks:
                raise ValueError(f"taskset {self.config.taskset_id!r} yielded no task")
            if self.config.shuffle:
                random.Random(self.config.seed).shuffle(self.tasks)
        else:
            self.tasks, self._task_stream = None, iter(taskset)
        self.iter = 0

    async def _stop_serving(self) -> None:
        if self._serving is not None:
            stack, self._serving = self._serving, None
            await stack.aclose()

    async def close_servers(self) -> None:
        """Stop verifiers' interception servers, then the policy's servers."""
        try:
            await self._stop_serving()
        except Exception as err:  # shutting down: log and go on closing
            logger.warning("stopping verifiers' servers failed: %s", err)
        await super().close_servers()

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Any:
        i = self.iter
        self.iter += 1
        if self.tasks is not None:
            return self.tasks[i % len(self.tasks)]
        assert self._task_stream is not None, "call setup() first"
        task = next(self._task_stream, None)
        if task is None:
            # Raised inside a coroutine, StopIteration would become "coroutine raised
            # StopIteration", which names neither the taskset nor the cause.
            raise RuntimeError(
                f"taskset {self.config.taskset_id!r} is declared infinite (not bounded) "
                f"but ran out of tasks after {i}"
            )
        return task

    # ------------------------------------------------------------------ rollouts

    async def rollout(self, task: Any, temperature: float) -> Dict[str, Any]:
        """One verifiers episode of ``task`` in a fresh proxy session: ``{"episode",
        "nodes"}`` (the session's token sequences)."""
        vf = import_verifiers()
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            ctx = vf.ModelContext(
                model=first_model_name(self.server) or "default",
                client=vf.EvalClientConfig(
                    base_url=managed.get_url(), api_key_var="ATROPOS_API_KEY"
                ),
                sampling=vf.Sampling(
                    temperature=temperature, max_tokens=self.config.max_tokens_per_turn
                ),
            )
            episode = await self.vf_env.run_episode(task, ctx)
            nodes = (await managed.fetch_state())["nodes"]
        return {"episode": episode, "nodes": nodes}

    @staticmethod
    def episode_reward(episode: Any) -> float:
        """The episode's score: its trace's reward (the mean over traces of a multi-agent env)."""
        traces = episode.traces
        return sum(t.reward for t in traces) / len(traces) if traces else 0.0

    @staticmethod
    def episode_messages(episode: Any) -> List[Dict[str, Any]]:
        """The conversation of the episode's first trace (its last branch), as dicts."""
        if not episode.traces or not episode.traces[0].branches:
            return []
        return [
            m.model_dump(mode="json", exclude_none=True)
            for m in episode.traces[0].branches[-1].messages
        ]

    def _failed(self, episode: Any) -> str | None:
        """Why the episode cannot be trained on (None when it can)."""
        if episode.ok:
            return None
        error = episode.last_error or next(
            (t.last_error for t in episode.traces if t.last_error is not None), None
        )
        return f"{error.type}: {error.message}" if error is not None else "not completed"

    async def collect_trajectories(self, item: Any) -> Tuple[ScoredDataGroup | None, List[Any]]:
        runs = await asyncio.gather(
            *(self.rollout(item, self.config.temperature) for _ in range(self.config.group_size))
        )
        rollouts: List[Dict[str, Any]] = []
        scores: List[float] = []
        for run in runs:
            episode, nodes = run["episode"], run["nodes"]
            reason = self._failed(episode)
            if reason is not None:
                # A failed episode (harness crash, transport error, timeout) says nothing
                # about the policy: counted and logged, never trained on.
                self.failures["failed"] += 1
                logger.warning("verifiers: an episode of %s failed: %s", episode.task.key, reason)
                continue
            if not nodes:
                self.failures["no_tokens"] += 1
                continue
            if len(nodes) > 1:
                logger.info(
                    "verifiers: an episode made %d sequences; keeping the longest", len(nodes)
                )
            node = max(nodes, key=lambda n: len(n.tokens))
            reward = self.episode_reward(episode)
            self.rewards.append(reward)
            rollouts.append(
                {
                    "tokens": list(node.tokens),
                    "masks": list(node.masked_tokens),
                    "logprobs": list(node.logprobs),
                    "messages": self.episode_messages(episode),
                }
            )
            scores.append(reward)
        return (scored_group(rollouts, scores) if rollouts else None), []

    # ------------------------------------------------------------------ evaluate

    def eval_tasks(self) -> List[Any]:
        """The first ``eval_limit`` tasks of the eval taskset (``eval_taskset_args``)."""
        vf = import_verifiers()
        args = self.config.eval_taskset_args
        if args is None:
            taskset = self.vf_env.taskset
        else:
            taskset = vf.load_taskset(self.vf_env_config(args).taskset)
        return list(taskset.take(self.config.eval_limit))

    async def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        cfg = self.config

        async def one(task: Any) -> Dict[str, Any]:
            run = await self.rollout(task, cfg.eval_temperature)
            episode = run["episode"]
            reason = self._failed(episode)
            if reason is not None:
                raise RuntimeError(f"episode of {episode.task.key} failed: {reason}")
            reward = self.episode_reward(episode)
            sample: Dict[str, Any] = {
                "messages": self.episode_messages(episode),
                "task": task.data.name or task.key,
                "score": reward,
                "correct": reward >= cfg.correct_threshold,
            }
            for name, value in episode.traces[0].rewards.items():
                sample[f"reward/{name}"] = None if value is None else value.score
            return sample

        def per_reward(samples: List[Dict[str, Any]]) -> Dict[str, float]:
            # A reward no sample scored (None everywhere) has no mean: left out, not 0.
            scored = {
                k
                for s in samples
                for k, v in s.items()
                if k.startswith("reward/") and v is not None
            }
            metrics = {f"eval/{key}": mean_of(samples, key) for key in sorted(scored)}
            metrics["eval/mean_reward"] = mean_of(samples, "score")
            return metrics

        # A taskset may read its data as it loads; evaluate runs beside training rollouts,
        # whose model calls this event loop relays, so the loading happens off it.
        self.eval_metrics = await run_eval_set(
            self,
            await asyncio.to_thread(self.eval_tasks),
            one,
            metric="eval/percent_correct",
            value="correct",
            failed_metric="eval/failed_rollouts",
            extra_metrics=per_reward,
            task_name="verifiers_v1_eval",
            generation_parameters={
                "temperature": cfg.eval_temperature,
                "max_tokens": cfg.max_tokens_per_turn,
            },
        )
        return dict(self.eval_metrics)

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        metrics = drain_metrics(
            wandb_metrics, self.eval_metrics, train={"train/mean_reward": self.rewards}
        )
        for reason, count in self.failures.items():
            metrics[f"train/{reason}_rollouts"] = float(count)
        self.failures.clear()
        await super().wandb_log(metrics)
