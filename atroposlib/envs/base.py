"""``BaseEnv``: the class an environment subclasses.

An environment turns items (prompts, tasks) into scored groups of rollouts and
sends them to the rollout API, from which the trainer pulls batches. A subclass
implements :meth:`BaseEnv.setup`, :meth:`BaseEnv.get_next_item`,
:meth:`BaseEnv.evaluate` and one of :meth:`BaseEnv.collect_trajectory` /
:meth:`BaseEnv.collect_trajectories`, then ends its file with ``MyEnv.cli()``::

    class MyEnv(BaseEnv):
        name = "my_env"

        async def setup(self): ...
        async def get_next_item(self): ...
        async def collect_trajectories(self, item): ...
        async def evaluate(self, *args, **kwargs): ...

    if __name__ == "__main__":
        MyEnv.cli()   # python my_env.py serve|process|evaluate --env.group_size 8 ...

This file holds the hooks, read top to bottom, and the attributes environment files
read (``config``, ``server``, ``curr_step``, ``status_dict`` ...). The loop that drives
the hooks, and what it holds while it runs (API client, sender, status, worker pool,
failure tracking), is ``self.runner``, an :class:`~atroposlib.envs.runner.EnvRunner`,
which sees the env through :class:`~atroposlib.envs.hooks.EnvHooks`; the original's
loop methods that hand over to it (``handle_env``, ``register_env``, ``env_manager``
...) are :class:`~atroposlib.envs.handoffs.RunnerHandoffs`, which ``BaseEnv`` inherits.
The CLI, logging and files live in sibling modules too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Dict, List, Tuple, Type, Union

from rich.console import Console

from atroposlib.envs import cli, files
from atroposlib.envs import wandb_logging as wl
from atroposlib.envs.api_client import encode_body
from atroposlib.envs.config import (
    BaseEnvConfig,
    EvalHandlingEnum,
    ScoredDataGroup,
    ScoredDataItem,
)
from atroposlib.envs.handoffs import RunnerHandoffs
from atroposlib.envs.runner import EnvRunner
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    OpenaiConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.validation import InvalidGroupError, normalize_group
from atroposlib.type_definitions import Item
from atroposlib.utils.display import display_metrics_table
from atroposlib.utils.io import auth_headers

__all__ = [
    "APIServerConfig",
    "BaseEnv",
    "BaseEnvConfig",
    "EvalHandlingEnum",
    "OpenaiConfig",
    "ScoredDataGroup",
    "ScoredDataItem",
    "ServerBaseline",
]

logger = logging.getLogger(__name__)

OPTIONAL_GROUP_KEYS = (
    "ref_logprobs",
    "overrides",
    "group_overrides",
    "distill_token_ids",
    "distill_logprobs",
)


class BaseEnv(RunnerHandoffs, ABC):
    """Base class of all environments. See the module docstring for usage."""

    name: str | None = None
    env_config_cls: Type[BaseEnvConfig] = BaseEnvConfig
    server_cls: Type[APIServer] = APIServer

    def __init__(
        self,
        config: BaseEnvConfig,
        server_configs: Union[ServerBaseline, APIServerConfig, List[APIServerConfig]],
        slurm: bool = False,
        testing: bool = False,
    ) -> None:
        self.config = config
        self.server = self._make_server_manager(server_configs, slurm, testing)
        self.testing = testing
        self._tokenizer: Any = None
        # Run state (names kept from the original; env files read some of them).
        self.curr_step = 0
        self.max_token_len = -1
        self.status_dict: Dict[str, Any] = {}
        self.env_id: int | None = None
        self.wandb_prepend: str | None = None
        self.wandb_project: str | None = None
        self.wandb_group: str | None = None
        self.checkpoint_dir = ""
        self.checkpoint_interval = -1
        self.max_num_workers = config.max_num_workers
        self.backlog: List[Item] = []
        self.eval_workers: set = set()
        self.items_sent_this_step = 0
        self.items_sent_total = 0
        self.items_rejected: Counter[str] = Counter()
        # Metric buffers, reset after every W&B log.
        self.rollouts_for_wandb: List[List[Tuple[str, float]]] = []
        self.completion_lengths: List[int] = []
        self.task_duration: List[float] = []
        self.succeeded_task_duration: List[float] = []
        self.failed_task_duration: List[float] = []
        self.mainloop_timings: List[float] = []
        self.workers_added_list: List[int] = []
        self.jsonl_writer: files.JsonlGroupWriter | None = None
        # Set by the command line's process mode.
        self.process_mode = False
        self.n_groups_to_process: int | None = None
        self.group_size_to_process: int | None = None
        # The loop that drives these hooks and what it holds while it runs (API client,
        # sender, status, worker pool, failure tracking): see EnvRunner.
        self.runner = EnvRunner(self)

    def _make_server_manager(self, server_configs: Any, slurm: bool, testing: bool) -> Any:
        reasoning = None
        if (
            self.config.thinking_mode
            or self.config.reasoning_effort
            or self.config.max_reasoning_tokens
        ):
            reasoning = ReasoningConfig(
                enabled=self.config.thinking_mode or None,
                effort=self.config.reasoning_effort,
                max_tokens=self.config.max_reasoning_tokens,
            )
        return ServerManager(
            server_configs,
            server_class=self.server_cls,
            slurm=slurm,
            testing=testing,
            reasoning_config=reasoning,
        )

    @property
    def tokenizer(self) -> Any:
        """The tokenizer named by ``config.tokenizer_name``, loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_name)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    # ------------------------------------------------------------------ hooks

    @classmethod
    def config_init(
        cls,
    ) -> Tuple[BaseEnvConfig, Union[ServerBaseline, APIServerConfig, List[APIServerConfig]]]:
        """Default configuration of this environment: ``(env_config, server_config(s))``."""
        return cls.env_config_cls(), ServerBaseline()

    async def setup(self) -> None:
        """Load datasets and anything else needed before the first item."""
        raise NotImplementedError("setup() must be implemented by the environment")

    @abstractmethod
    async def get_next_item(self) -> Item:
        """The next item to roll out; None pauses adding workers for now."""

    @abstractmethod
    async def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Run the environment's evaluation (called every ``steps_per_eval`` steps)."""

    async def collect_trajectory(self, item: Item) -> Tuple[ScoredDataItem | None, List[Item]]:
        """Produce one scored rollout for ``item`` and any items to put in the backlog."""
        raise NotImplementedError(
            "implement collect_trajectory(item) or collect_trajectories(item)"
        )

    async def collect_trajectories(
        self, item: Item
    ) -> Tuple[Union[ScoredDataGroup | None, List[ScoredDataGroup | None], List[Any]], List[Item]]:
        """Produce a scored group for ``item``: ``group_size`` concurrent ``collect_trajectory`` calls."""
        results = await asyncio.gather(
            *(self.collect_trajectory(item) for _ in range(self.config.group_size))
        )
        backlog: List[Item] = []
        group: ScoredDataGroup = ScoredDataGroup(tokens=[], masks=[], scores=[])
        optional: Dict[str, list] = {}
        group_overrides: Dict[str, Any] = {}
        for scored, extra in results:
            backlog.extend(extra or [])
            if scored is None:
                continue
            if not isinstance(scored, dict):
                raise ValueError(
                    f"collect_trajectory must return a ScoredDataItem dict, got {type(scored).__name__}"
                )
            group["tokens"].append(scored["tokens"])
            group["masks"].append(scored["masks"])
            group["scores"].append(scored["scores"])
            for key in (
                "advantages",
                "ref_logprobs",
                "messages",
                "overrides",
                "images",
                "distill_token_ids",
                "distill_logprobs",
            ):
                if scored.get(key) is not None:
                    optional.setdefault(key, []).append(scored[key])
            group_overrides.update(scored.get("group_overrides") or {})
        group.update(optional)  # type: ignore[typeddict-item]
        if group_overrides:
            group["group_overrides"] = group_overrides
        return (group if group["tokens"] else None), backlog

    async def postprocess_histories(
        self, trajectories: Union[ScoredDataGroup | None, List[ScoredDataGroup | None]]
    ) -> Union[ScoredDataGroup | None, List[ScoredDataGroup | None]]:
        """Last chance to change groups before they are sent (identity by default)."""
        return trajectories

    async def cleanup(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Called after every handled item."""

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        """Save ``data`` as this env's checkpoint for ``step`` (no-op when None).

        Subclasses pass their state, e.g. ``super().save_checkpoint(step, {"iter": self.iter})``.
        """
        if data is None or not self.checkpoint_dir:
            return
        path = files.checkpoint_path(self.checkpoint_dir, self.wandb_prepend, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, default=str))
        logger.info("env checkpoint saved to %s", path)

    def load_checkpoint(self) -> None:
        """Restore the checkpoint for ``curr_step`` (or the newest before it) as attributes."""
        if not self.checkpoint_dir:
            return
        path = files.latest_checkpoint(self.checkpoint_dir, self.wandb_prepend, self.curr_step)
        if path is None:
            logger.info("no env checkpoint at or before step %d", self.curr_step)
            return
        for key, value in json.loads(path.read_text()).items():
            setattr(self, key, value)
        logger.info("env checkpoint loaded from %s", path)

    # ------------------------------------------------------------ W&B logging

    async def add_rollouts_for_wandb(self, scored_data: ScoredDataGroup, item: Item = None) -> None:
        """Keep decoded rollouts of a group for the W&B rollout table."""
        keep = self.config.num_rollouts_per_group_for_logging
        if keep == -1:
            keep = self.config.group_size
        keep = min(keep, len(scored_data["tokens"]))
        self.rollouts_for_wandb.append(
            [
                (self.tokenizer.decode(scored_data["tokens"][i]), scored_data["scores"][i])
                for i in range(keep)
            ]
        )
        while len(self.rollouts_for_wandb) > self.config.num_rollouts_to_keep:
            self.rollouts_for_wandb.pop(0)

    async def create_rollout_table(self, wandb_metrics: Dict[str, Any]) -> Dict[str, Any]:
        """Add ``train/rollouts`` (a ``wandb.Table`` of text and score) to the metrics."""
        if self.rollouts_for_wandb:
            wandb_metrics["train/rollouts"] = wl.rollout_table(self.rollouts_for_wandb)
        return wandb_metrics

    def perf_metrics(self) -> Dict[str, Any]:
        """Performance and drop counters collected since the last log."""
        metrics: Dict[str, Any] = {}
        metrics.update(wl.completion_length_metrics(self.completion_lengths, self.max_token_len))
        metrics.update(wl.list_stats("train_perf/task_duration", self.task_duration))
        metrics.update(
            wl.list_stats("train_perf/succeeded_task_duration", self.succeeded_task_duration)
        )
        metrics.update(wl.list_stats("train_perf/failed_task_duration", self.failed_task_duration))
        metrics.update(wl.list_stats("train_perf/mainloop_timings", self.mainloop_timings))
        metrics.update(
            wl.list_stats("train_perf/workers_added_per_attempt", self.workers_added_list)
        )
        metrics["train/items_sent_to_api"] = self.items_sent_total
        metrics.update(wl.rejected_metrics(self.all_rejections()))
        metrics.update(self.runner.poll_failures.metrics())
        return metrics

    def perf_stats(self, metrics_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Add the performance metrics (:meth:`perf_metrics`) to ``metrics_dict`` and
        return it."""
        metrics_dict.update(self.perf_metrics())
        return metrics_dict

    def all_rejections(self) -> Counter:
        """Every dropped group or item so far, counted per reason."""
        total = Counter(self.items_rejected)
        total.update(self.runner.rejected())
        return total

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        """Log ``wandb_metrics`` plus the base metrics; subclasses add keys, then call super."""
        metrics = dict(wandb_metrics or {})
        metrics.update(self.perf_metrics())
        if self.config.use_wandb:
            metrics = await self.create_rollout_table(metrics)
            metrics = wl.prefix_keys(metrics, self.wandb_prepend)
            metrics.update(await self._server_metrics())
            wl.log(metrics, step=self.curr_step)
        self.completion_lengths = []
        self.task_duration, self.succeeded_task_duration, self.failed_task_duration = [], [], []
        self.mainloop_timings, self.workers_added_list = [], []
        self.rollouts_for_wandb = []

    async def _server_metrics(self) -> Dict[str, Any]:
        wandb_metrics = getattr(self.server, "wandb_metrics", None)
        if wandb_metrics is None:
            return {}
        try:
            result = wandb_metrics({})
            if asyncio.iscoroutine(result):
                result = await result
            return dict(result or {})
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            logger.warning("server metrics unavailable: %s", err)
            return {}

    async def evaluate_log(
        self,
        metrics: Dict[str, Any],
        task_name: str | None = None,
        model_name: str | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        generation_parameters: Dict[str, Any] | None = None,
        samples: List[Dict[str, Any]] | None = None,
        verbose: bool = True,
    ) -> None:
        """Write ``metrics.json`` (and ``samples.jsonl``) to ``data_dir_to_save_evals``."""
        if verbose:
            _print_metrics_table(metrics, task_name)
        if not self.config.data_dir_to_save_evals:
            logger.warning("data_dir_to_save_evals is not set; evaluation results are not written")
            return
        task = task_name or f"{self.name or type(self).__name__}_eval"
        if model_name is None:
            model_name = first_model_name(self.server)
        params = {"max_new_tokens": self.config.max_token_length, **(generation_parameters or {})}
        elapsed = (end_time or time.time()) - (start_time or time.time())
        doc = files.eval_metrics_document(metrics, task, model_name, elapsed, params)
        path = files.write_eval_results(self.config.data_dir_to_save_evals, doc, samples)
        logger.info("evaluation results written to %s", path)

    # ----------------------------------------------------------------- sending

    def _drop(self, reason: str, detail: str = "") -> None:
        self.items_rejected[reason] += 1
        log = logger.info if reason == "scores_all_equal" else logger.warning
        log("group dropped (%s)%s", reason, f": {detail}" if detail else "")

    def _filter_group(
        self, group: ScoredDataGroup | None, abort_on_max_len: bool
    ) -> ScoredDataGroup | None:
        """The group ready to send, or None (the reason is logged and counted)."""
        if group is None:
            return None
        if isinstance(group, dict):
            tokens = group.get("tokens")
            if tokens is None or (isinstance(tokens, list) and not tokens):
                self._drop("empty_group")
                return None
        try:
            group = normalize_group(group)  # type: ignore[assignment]
        except InvalidGroupError as err:
            reason = f"invalid_{err.field.split('[', 1)[0]}"
            self._drop(reason, f"{err} (the group breaks the ScoredData rules)")
            self.runner.record_failure(err, "group validation")
            return None
        expected = (group.get("group_overrides") or {}).get("group_size", self.config.group_size)
        if self.process_mode and self.group_size_to_process:
            expected = (group.get("group_overrides") or {}).get(
                "group_size", self.group_size_to_process
            )
        if len(group["tokens"]) != expected:
            self._drop("wrong_group_size", f"{len(group['tokens'])} sequences, expected {expected}")
            return None
        if self.config.ensure_scores_are_not_same and len(set(group["scores"])) == 1:
            self._drop("scores_all_equal")
            return None
        for key in OPTIONAL_GROUP_KEYS:
            group.setdefault(key, None)  # type: ignore[misc]
        # Masks are lists of ints by now (normalize_group): count the prompt positions in C.
        self.completion_lengths.extend(len(mask) - mask.count(-100) for mask in group["masks"])
        if self.max_token_len <= 0:
            if not self.process_mode:
                logger.warning(
                    "max_token_len is unknown (%s); not checking lengths", self.max_token_len
                )
        elif abort_on_max_len and any(len(t) >= self.max_token_len for t in group["tokens"]):
            self._drop("max_token_len_exceeded", f"a sequence reached {self.max_token_len} tokens")
            return None
        if self.config.include_messages and group.get("messages") is None:
            group["messages"] = [
                [{"role": "user", "content": self.tokenizer.decode(tokens)}]
                for tokens in group["tokens"]
            ]
        return group

    async def handle_send_to_api(
        self,
        scored_data: Union[ScoredDataGroup | None, List[ScoredDataGroup | None]],
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> None:
        """Validate groups, record them (W&B buffer, jsonl) and send them to the API."""
        groups = scored_data if isinstance(scored_data, list) else [scored_data]
        valid: List[ScoredDataGroup] = []
        for group in groups:
            ready = self._filter_group(group, abort_on_any_max_length_exceeded)
            if ready is None:
                continue
            if self.config.use_wandb:
                await self.add_rollouts_for_wandb(ready, item)
            if self.config.data_path_to_save_groups:
                if self.jsonl_writer is None:
                    self.jsonl_writer = files.JsonlGroupWriter(self.config.data_path_to_save_groups)
                self.jsonl_writer.write(ready)
            valid.append(ready)
        if not valid or not do_send_to_api:
            return
        for group in valid:
            group["env_id"] = self.env_id  # type: ignore[typeddict-unknown-key]
        await self.runner.send(valid[0] if len(valid) == 1 else valid)
        self.items_sent_this_step += len(valid)
        self.items_sent_total += len(valid)

    # ------------------------------------------------------- API and policy
    # The loop's steps and modes (``handle_env``, ``register_env``, ``env_manager`` ...)
    # are the original's names handed over to the runner: :class:`RunnerHandoffs`.

    def _post_json_with_compression(
        self, session: Any, url: str, payload: Any, *, minimum_size: int = 1024
    ) -> Any:
        """``session.post(url, ...)`` with ``payload`` as JSON, gzipped (``Content-Encoding:
        gzip``) when the body is at least ``minimum_size`` bytes and compression helps.

        Works with an ``aiohttp.ClientSession`` (returns its request context manager) and an
        ``httpx.AsyncClient`` (returns the request coroutine).
        """
        body, headers = encode_body(payload, minimum_size=minimum_size)
        headers.update(auth_headers())
        if hasattr(session, "build_request"):  # httpx
            return session.post(url, content=body, headers=headers)
        return session.post(url, data=body, headers=headers)

    @property
    def latest_policy_version(self) -> int | None:
        """The API's current policy version (its trainer step) at the last ``/status-env``
        poll; None before the first poll or against an API that does not report it."""
        version = self.status_dict.get("current_version")
        return version if isinstance(version, int) else None

    def is_too_stale(self, policy_version: int | None) -> bool:
        """Whether a rollout generated by weights ``policy_version`` is already more than
        ``run-api --max-staleness`` versions behind, so the API would drop its group: a
        long or multi-turn rollout can stop early. False when anything is unknown."""
        limit = self.status_dict.get("max_staleness")
        current = self.latest_policy_version
        if policy_version is None or current is None or not isinstance(limit, int):
            return False
        return current - policy_version > limit

    # ------------------------------------------------------------------ modes

    async def close_servers(self) -> None:
        """Stop the inference servers' background tasks (health checks)."""
        close = getattr(self.server, "close", None)
        if close is not None:
            try:
                await close()
            except (RuntimeError, OSError) as err:
                logger.warning("closing inference servers failed: %s", err)

    @classmethod
    def get_cli_serve_config_cls(cls) -> type:
        """The settings class of ``serve`` (``--env.*``, ``--openai.*``, ...); an instance's
        ``cli_cmd()`` runs serve mode with its values. Override to add flags."""
        return cli.mode_config_cls(cls, "serve")

    @classmethod
    def get_cli_process_config_cls(cls) -> type:
        """The settings class of ``process`` (see :meth:`get_cli_serve_config_cls`)."""
        return cli.mode_config_cls(cls, "process")

    @classmethod
    def get_cli_evaluate_config_cls(cls) -> type:
        """The settings class of ``evaluate`` (see :meth:`get_cli_serve_config_cls`)."""
        return cli.mode_config_cls(cls, "evaluate")

    @classmethod
    def cli(cls) -> None:
        """Command line: ``serve``, ``process`` or ``evaluate`` with ``--env.*``/``--openai.*`` flags."""
        cli.run_cli(cls)


def first_model_name(server: Any) -> str | None:
    """The ``model_name`` of the first of ``server``'s backends that has one (a
    ``ServerManager`` or anything with ``.servers``); None when none does."""
    for srv in getattr(server, "servers", []) or []:
        config = getattr(srv, "config", None)
        if config is not None and getattr(config, "model_name", None):
            return config.model_name
    return None


def _print_metrics_table(metrics: Dict[str, Any], task_name: str | None) -> None:
    display_metrics_table(task_name or "evaluation", metrics, console=Console(stderr=True))
