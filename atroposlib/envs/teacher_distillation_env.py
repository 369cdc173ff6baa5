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
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.validation import InvalidGroupError, normalize_group
from atroposlib.type_definitions import Item

logger = logging.getLogger(__name__)

NO_TEACHER_CONFIG = (
    "no teacher server configuration was provided "
    "(pass teacher_server_configs, --teacher.* flags or a teacher: YAML key)"
)


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
    """A :class:`BaseEnv` whose groups carry a teacher's logprobs for distillation.

    Extension points (override them in a subclass): ``_resolve_teacher_server_configs``
    turns what the constructor got into server configs, ``_validate_teacher_tokenizer_compatibility``
    checks the vocabulary, ``_attach_teacher_distillation`` fills one group. The
    module-level ``ServerManager`` and ``resolve_openai_configs`` are looked up at
    call time, so tests can patch them on this module.
    """

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
            resolved = self._resolve_teacher_server_configs(teacher_server_configs)
            self.teacher_server = ServerManager(resolved)

    def _resolve_teacher_server_configs(
        self, teacher_server_configs: Union[APIServerConfig, List[APIServerConfig], Any] | None
    ) -> Union[ServerBaseline, List[APIServerConfig]]:
        """Server configs for the teacher; raises ValueError when none was provided."""
        if teacher_server_configs is None or teacher_server_configs == []:
            raise ValueError(NO_TEACHER_CONFIG)
        if isinstance(teacher_server_configs, dict):
            return resolve_openai_configs(APIServerConfig(), teacher_server_configs, {}, {}, logger)
        if isinstance(teacher_server_configs, APIServerConfig):
            return [teacher_server_configs]
        if isinstance(teacher_server_configs, (list, tuple)):
            return list(teacher_server_configs)
        return resolve_openai_configs(teacher_server_configs, {}, {}, {}, logger)

    def _validate_teacher_tokenizer_compatibility(self) -> None:
        """Raise ValueError unless every teacher's tokenizer has the student's vocabulary."""
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

    def check_teacher_tokenizer(self) -> None:
        """Same as :meth:`_validate_teacher_tokenizer_compatibility`."""
        self._validate_teacher_tokenizer_compatibility()

    def _group_top_k(self, group: ScoredDataGroup) -> int | None:
        overrides = group.get("group_overrides") or {}
        if overrides.get("skip_teacher_top_k"):
            return None
        top_k = int(overrides.get("teacher_top_k", self.config.teacher_top_k))
        return None if top_k <= -1 else top_k

    async def _attach_teacher_distillation(
        self, group: ScoredDataGroup | None
    ) -> ScoredDataGroup | None:
        """Fill ``distill_token_ids``/``distill_logprobs`` of ``group`` and return it.

        A teacher failure leaves both None (the group is still sent); a tokenizer
        mismatch raises.
        """
        if group is None or self.teacher_server is None:
            return group
        try:
            group = normalize_group(group)  # type: ignore[assignment]
        except InvalidGroupError:
            return group  # refused (and counted) by handle_send_to_api
        if not group["tokens"]:
            return group
        top_k = self._group_top_k(group)
        if top_k is None:
            return group
        try:
            self._validate_teacher_tokenizer_compatibility()
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
        return group

    async def attach_teacher_logprobs(self, group: ScoredDataGroup | None) -> None:
        """Same as :meth:`_attach_teacher_distillation`, without the return value."""
        await self._attach_teacher_distillation(group)

    async def handle_send_to_api(
        self,
        scored_data: Union[ScoredDataGroup | None, List[ScoredDataGroup | None]],
        item: Item = None,
        do_send_to_api: bool = True,
        abort_on_any_max_length_exceeded: bool = True,
    ) -> None:
        """Attach teacher logprobs to each group, then send as :class:`BaseEnv` does."""
        if isinstance(scored_data, list):
            scored_data = list(
                await asyncio.gather(*(self._attach_teacher_distillation(g) for g in scored_data))
            )
        else:
            scored_data = await self._attach_teacher_distillation(scored_data)
        await super().handle_send_to_api(
            scored_data, item, do_send_to_api, abort_on_any_max_length_exceeded
        )

    async def close_servers(self) -> None:
        """Also stop the teacher servers' background tasks."""
        await super().close_servers()
        if self.teacher_server is not None and hasattr(self.teacher_server, "close"):
            await self.teacher_server.close()
