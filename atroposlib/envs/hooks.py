"""What the loop reads from and calls on an environment, and on its runner, as protocols.

:class:`~atroposlib.envs.base.BaseEnv` satisfies :class:`EnvHooks`;
:class:`~atroposlib.envs.runner.EnvRunner` satisfies :class:`RunnerView`. The
runner, the ``process``/``evaluate`` modes (``offline``) and the command line
(``cli``) are written against these, so none of them imports ``base`` (which
imports them), nor ``offline`` the runner (which calls it): the modules of
``envs`` form no circle, not even for the type checker.

This module imports nothing at run time; keep it that way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Counter, Dict, List, Protocol

if TYPE_CHECKING:
    from atroposlib.envs.config import BaseEnvConfig
    from atroposlib.envs.files import JsonlGroupWriter

__all__ = ["EnvHooks", "RunnerView"]


class EnvHooks(Protocol):
    """An environment as the loop sees it (attribute and method names are the original's)."""

    # --- the class, as the command line reads and builds it
    name: str | None
    env_config_cls: type

    def __init__(
        self, config: Any, server_configs: Any, slurm: bool = False, testing: bool = False
    ) -> None: ...

    @classmethod
    def config_init(cls) -> Any:
        """Default ``(env config, server configs)`` of the class."""

    # --- configuration and servers
    config: BaseEnvConfig
    server: Any
    """The ``ServerManager`` over the inference servers."""
    testing: bool

    # --- run state the loop reads and updates
    env_id: int | None
    curr_step: int
    max_token_len: int
    status_dict: Dict[str, Any]
    backlog: List[Any]
    max_num_workers: int
    derived_batch_size: int
    items_sent_this_step: int
    items_rejected: Counter[str]
    wandb_project: str | None
    wandb_group: str | None
    wandb_prepend: str | None
    checkpoint_dir: str
    checkpoint_interval: int
    task_duration: List[float]
    succeeded_task_duration: List[float]
    failed_task_duration: List[float]
    mainloop_timings: List[float]
    workers_added_list: List[int]

    # --- process mode (jsonl + html, no API)
    process_mode: bool
    n_groups_to_process: int | None
    group_size_to_process: int | None
    jsonl_writer: JsonlGroupWriter | None

    # --- the hooks an environment implements
    async def setup(self) -> None: ...
    async def get_next_item(self) -> Any: ...
    async def collect_trajectories(self, item: Any) -> Any: ...
    async def postprocess_histories(self, trajectories: Any) -> Any: ...
    async def evaluate(self, *args: Any, **kwargs: Any) -> Any: ...
    async def cleanup(self) -> None: ...
    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None: ...
    def load_checkpoint(self) -> None: ...

    # --- the loop's steps, overridable by name (the defaults hand over to the runner)
    async def handle_env(self, item_uuid: str) -> None: ...
    async def add_train_workers(self) -> None: ...
    async def handle_send_to_api(self, scored_data: Any, *args: Any, **kwargs: Any) -> Any: ...
    async def register_env(self) -> None: ...
    async def get_server_info(self) -> None: ...
    async def get_status(self) -> None: ...
    async def setup_wandb(self) -> None: ...
    async def env_step_checks(self) -> None: ...
    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None: ...
    def all_rejections(self) -> Counter[str]: ...
    async def close_servers(self) -> None: ...

    # --- the modes the command line runs
    async def env_manager(self) -> None: ...
    async def process_manager(self) -> None: ...
    async def run_evaluate(self) -> None: ...


class RunnerView(Protocol):
    """The runner as the ``process`` and ``evaluate`` modes use it."""

    env: EnvHooks
    failures: Any
    """The failure tracker (``record_success()``, ``total``)."""
    FAILED: object
    """The sentinel :meth:`attempt` and :meth:`next_item` give for a failed step."""

    write_report: Callable[[Path], Awaitable[None]]
    """Writes the html report beside the jsonl of ``process`` mode."""

    async def attempt(
        self, where: str, call: Callable[[], Awaitable[Any]], failed: Any, message: str
    ) -> Any: ...
    async def collect(self, item: Any) -> Any: ...
    async def next_item(self) -> Any: ...
    def can_start_work(self) -> bool: ...
    def raise_if_fatal(self) -> None: ...
    def start_server_watch(self) -> None: ...
    async def stop_server_watch(self) -> None: ...
