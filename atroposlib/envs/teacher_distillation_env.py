"""``TeacherDistillationEnv``: attach a teacher model's top-k logprobs to every group (§4.12).

Before a group is sent, each sequence goes through the teacher's
``get_logprobs(input_ids=tokens, top_k=k, max_tokens=1)``; the result fills
``distill_token_ids`` and ``distill_logprobs`` (``[seq][pos][k]``). Teacher servers
come from ``--teacher.*`` flags or a ``teacher:`` YAML key (serve mode).

Example::

    class MyDistillEnv(TeacherDistillationEnv):
        env_config_cls = TeacherDistillationConfig
        ...

    python my_env.py serve --env.teacher_enabled true --env.teacher_top_k 8 \\
        --teacher.base_url http://127.0.0.1:9002/v1 --teacher.model_name teacher --teacher.server_type vllm
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, List, Union

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.type_definitions import Item

logger = logging.getLogger(__name__)


class TeacherDistillationConfig(BaseEnvConfig):
    """Adds the teacher switches to :class:`BaseEnvConfig`."""

    teacher_enabled: bool = Field(
        default=False, description="Fetch teacher top-k logprobs for every group."
    )
    teacher_top_k: int = Field(
        default=0,
        ge=-1,
        description="Teacher logprobs per position: 0 = the sampled token only, -1 = disabled.",
    )


def load_tokenizer(name: str) -> Any:
    """Load a Hugging Face tokenizer by name or local path."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _tokenizer_name(config: Any) -> str:
    name = getattr(config, "tokenizer_name", "none")
    return config.model_name if name in (None, "", "none") else name


class TeacherDistillationEnv(BaseEnv):
    """A :class:`BaseEnv` whose groups carry a teacher's logprobs for distillation."""

    env_config_cls = TeacherDistillationConfig
    cli_server_namespaces = ("teacher",)

    def __init__(
        self,
        config: TeacherDistillationConfig,
        server_configs: Union[ServerBaseline, APIServerConfig, List[APIServerConfig]],
        slurm: bool = False,
        testing: bool = False,
        teacher_server_configs: Union[APIServerConfig, List[APIServerConfig]] | None = None,
    ) -> None:
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        self.teacher_server: Any = None
        self._teacher_checked = False
        if getattr(config, "teacher_enabled", False):
            if teacher_server_configs is None:
                raise ValueError(
                    "teacher_enabled needs teacher server configs (--teacher.* or a teacher: YAML key)"
                )
            from atroposlib.envs.server_handling.server_manager import ServerManager

            self.teacher_server = ServerManager(teacher_server_configs)

    def check_teacher_tokenizer(self) -> None:
        """Raise ValueError unless the teacher's tokenizer matches the student's."""
        if self._teacher_checked or self.teacher_server is None:
            return
        for server in getattr(self.teacher_server, "servers", []):
            teacher_name = _tokenizer_name(server.config)
            if teacher_name == self.config.tokenizer_name:
                continue
            teacher_vocab = load_tokenizer(teacher_name).get_vocab()
            if teacher_vocab != self.tokenizer.get_vocab():
                raise ValueError(
                    f"teacher tokenizer {teacher_name!r} does not match the student's "
                    f"{self.config.tokenizer_name!r}; distillation needs the same vocabulary"
                )
        self._teacher_checked = True

    def _group_top_k(self, group: ScoredDataGroup) -> int | None:
        overrides = group.get("group_overrides") or {}
        if overrides.get("skip_teacher_top_k"):
            return None
        top_k = int(overrides.get("teacher_top_k", self.config.teacher_top_k))
        return None if top_k <= -1 else top_k

    async def attach_teacher_logprobs(self, group: ScoredDataGroup | None) -> None:
        """Fill ``distill_token_ids``/``distill_logprobs``; on any failure leave them None."""
        if group is None or self.teacher_server is None or not group.get("tokens"):
            return
        top_k = self._group_top_k(group)
        if top_k is None:
            return
        try:
            self.check_teacher_tokenizer()
            results = await asyncio.gather(
                *(
                    self.teacher_server.get_logprobs(
                        input_ids=list(tokens), top_k=top_k, max_tokens=1
                    )
                    for tokens in group["tokens"]
                )
            )
            group["distill_token_ids"] = [r["prompt_topk_token_ids"] for r in results]
            group["distill_logprobs"] = [r["prompt_topk_logprobs"] for r in results]
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - any teacher failure only drops the payload
            logger.warning("teacher logprobs failed; group sent without distill data: %s", err)
            group["distill_token_ids"] = None
            group["distill_logprobs"] = None

    async def handle_send_to_api(
        self,
        scored_data: Union[ScoredDataGroup | None, List[ScoredDataGroup | None]],
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> None:
        """Attach teacher logprobs to each group, then send as :class:`BaseEnv` does."""
        groups = scored_data if isinstance(scored_data, list) else [scored_data]
        await asyncio.gather(*(self.attach_teacher_logprobs(g) for g in groups))
        await super().handle_send_to_api(
            scored_data, item, do_send_to_api, abort_on_any_max_length_exceeded
        )

    async def close_servers(self) -> None:
        """Also stop the teacher servers' background tasks."""
        await super().close_servers()
        if self.teacher_server is not None and hasattr(self.teacher_server, "close"):
            await self.teacher_server.close()
