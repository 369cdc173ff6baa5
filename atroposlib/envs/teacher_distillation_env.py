"""``TeacherDistillationEnv``: attach a teacher model's top-k logprobs to every group (docs/design.md, "Teacher distillation").

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
from abc import ABC
from typing import Any, Dict, List, Tuple, Union

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.validation import InvalidGroupError, normalize_group
from atroposlib.type_definitions import Item
from atroposlib.utils.cli import merge_dicts

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


def _flag_values(namespace: str, cli_passed_flags: Dict[str, Any] | None) -> Dict[str, Any]:
    """``--<namespace>.<field>`` values of ``cli_passed_flags`` (flat ``"teacher.x"`` keys or
    a nested ``{"teacher": {...}}``), keyed by field."""
    flags = cli_passed_flags or {}
    prefix = f"{namespace}."
    values = {k[len(prefix) :]: v for k, v in flags.items() if k.startswith(prefix)}
    nested = flags.get(namespace)
    if isinstance(nested, dict):
        values = {**nested, **values}
    return values


class TeacherDistillationEnv(BaseEnv, ABC):
    """A :class:`BaseEnv` whose groups carry a teacher's logprobs for distillation.

    Teacher servers come from ``teacher_server_configs``, else from
    :meth:`teacher_config_init`; on the command line (``serve``) from ``--teacher.*`` flags
    and a YAML ``teacher:`` section, resolved as ``--openai.*`` is. The module-level
    ``ServerManager`` and ``load_tokenizer`` are looked up at call time, so tests can patch
    them on this module.
    """

    env_config_cls = TeacherDistillationConfig
    teacher_namespace = "teacher"
    cli_server_namespaces = ("teacher",)

    @classmethod
    def teacher_config_init(
        cls,
    ) -> Union[ServerBaseline, List[APIServerConfig], APIServerConfig] | None:
        """Default teacher server config(s) of this env (None: no teacher unless the command
        line or the constructor gives one). Override like ``config_init``."""
        return None

    @classmethod
    def _resolve_teacher_server_configs(
        cls,
        default_teacher_server_configs: Union[
            ServerBaseline, List[APIServerConfig], APIServerConfig
        ]
        | None,
        yaml_config: Dict[str, Any],
        cli_passed_flags: Dict[str, Any],
    ) -> Union[ServerBaseline, List[APIServerConfig]] | None:
        """The teacher servers from the defaults, the YAML ``teacher:`` section and the
        ``--teacher.*`` flags (later wins), or None when none of them configures a teacher.

        Resolved as ``--openai.*`` is: a YAML list of servers gives one config each, one
        server gives one ``APIServerConfig`` of the merged values.
        """
        namespace = cls.teacher_namespace
        cli_values = _flag_values(namespace, cli_passed_flags)
        yaml_part = (yaml_config or {}).get(namespace)
        default = default_teacher_server_configs
        if default is None and yaml_part is None and not cli_values:
            return None
        single = default[0] if isinstance(default, list) and len(default) == 1 else default
        base = single.model_dump() if isinstance(single, ServerBaseline) else {}
        yaml_single = yaml_part if isinstance(yaml_part, dict) else {}
        merged = merge_dicts(base, yaml_single, cli_values)
        flat = {f"{namespace}.{k}": v for k, v in cli_values.items()}
        resolved = resolve_openai_configs(
            default if default is not None else APIServerConfig(),
            merged,
            yaml_config or {},
            flat,
            logger,
            namespace=namespace,
        )
        return resolved

    @classmethod
    def get_cli_serve_config_cls(cls) -> type:
        """``serve``'s settings class, with the ``--teacher.*`` server flags (defaults from
        :meth:`teacher_config_init`)."""
        config_cls = super().get_cli_serve_config_cls()
        if cls.teacher_namespace not in config_cls.model_fields:
            raise TypeError(
                f"{cls.__name__}.cli_server_namespaces must include {cls.teacher_namespace!r}"
            )
        return config_cls

    def __init__(
        self,
        config: TeacherDistillationConfig,
        server_configs: Union[ServerBaseline, APIServerConfig, List[APIServerConfig]],
        teacher_server_configs: Union[ServerBaseline, APIServerConfig, List[APIServerConfig]]
        | None = None,
        slurm: bool = False,
        testing: bool = False,
    ) -> None:
        super().__init__(config, server_configs, slurm=slurm, testing=testing)
        self.teacher_server: Any = None
        self.teacher_tokenizer_name: str | None = None
        self._teacher_checked = False
        if not getattr(config, "teacher_enabled", False):
            return
        if teacher_server_configs is None:
            teacher_server_configs = type(self).teacher_config_init()
        if teacher_server_configs is None or teacher_server_configs == []:
            raise ValueError(NO_TEACHER_CONFIG)
        if isinstance(teacher_server_configs, dict):  # one server's settings, by field
            teacher_server_configs = resolve_openai_configs(
                APIServerConfig(), teacher_server_configs, {}, {}, logger
            )
        if isinstance(teacher_server_configs, APIServerConfig):
            teacher_server_configs = [teacher_server_configs]
        elif isinstance(teacher_server_configs, tuple):
            teacher_server_configs = list(teacher_server_configs)
        self.teacher_server = ServerManager(teacher_server_configs)
        first = (
            teacher_server_configs[0]
            if isinstance(teacher_server_configs, list)
            else teacher_server_configs
        )
        self.teacher_tokenizer_name = _tokenizer_name(first)

    def _validate_teacher_tokenizer_compatibility(self, teacher_tokenizer_name: str) -> None:
        """Raise ValueError unless ``teacher_tokenizer_name`` has the student's vocabulary.

        The student's own tokenizer name passes at once; otherwise both vocabularies are
        compared (ValueError when they differ or the teacher's tokenizer cannot be loaded).
        """
        student_name = self.config.tokenizer_name
        if teacher_tokenizer_name == student_name:
            return
        try:
            teacher_vocab = load_tokenizer(teacher_tokenizer_name).get_vocab()
        except Exception as err:  # noqa: BLE001 - any load failure is a configuration error
            raise ValueError(
                f"cannot load the teacher tokenizer {teacher_tokenizer_name!r} to compare it "
                f"with the student's {student_name!r}: {err}"
            ) from err
        if teacher_vocab != self.tokenizer.get_vocab():
            raise ValueError(
                f"teacher tokenizer {teacher_tokenizer_name!r} does not match the student's "
                f"{student_name!r}; distillation needs the same vocabulary"
            )

    def check_teacher_tokenizer(self) -> None:
        """Validate every teacher server's tokenizer once (see
        :meth:`_validate_teacher_tokenizer_compatibility`)."""
        if self._teacher_checked or self.teacher_server is None:
            return
        for server in getattr(self.teacher_server, "servers", []):
            self._validate_teacher_tokenizer_compatibility(_tokenizer_name(server.config))
        self._teacher_checked = True

    async def _fetch_teacher_for_sequence(
        self, token_ids: List[int], top_k: int
    ) -> Tuple[List[List[int]], List[List[float]]]:
        """The teacher's top-``top_k`` token ids and logprobs at every position of
        ``token_ids`` (``[pos][k]``)."""
        result = await self.teacher_server.get_logprobs(
            input_ids=list(token_ids), top_k=top_k, max_tokens=1, split="train"
        )
        return result["prompt_topk_token_ids"], result["prompt_topk_logprobs"]

    def _group_top_k(self, group: ScoredDataGroup) -> int | None:
        overrides = group.get("group_overrides") or {}
        if overrides.get("skip_teacher_top_k"):
            return None
        top_k = int(overrides.get("teacher_top_k", self.config.teacher_top_k))
        return None if top_k <= -1 else top_k

    async def _attach_teacher_distillation(self, group: ScoredDataGroup) -> ScoredDataGroup:
        """``group`` with ``distill_token_ids``/``distill_logprobs`` (``[seq][pos][k]``).

        Unchanged when the teacher is disabled. Both None when the group has no tokens,
        ``group_overrides["skip_teacher_top_k"]`` is true or the top k (the override
        ``teacher_top_k``, else the config's) is -1 or less; also when any sequence fails
        or comes back with another length (a warning is logged; the group is still sent).
        A tokenizer mismatch raises ValueError.
        """
        if group is None or self.teacher_server is None:
            return group
        try:
            group = normalize_group(group)  # type: ignore[assignment]
        except InvalidGroupError:
            return group  # refused (and counted) by handle_send_to_api
        group["distill_token_ids"] = None
        group["distill_logprobs"] = None
        top_k = self._group_top_k(group)
        if not group["tokens"] or top_k is None:
            return group
        self.check_teacher_tokenizer()
        try:
            results = await asyncio.gather(
                *(self._fetch_teacher_for_sequence(tokens, top_k) for tokens in group["tokens"])
            )
        except Exception as err:  # noqa: BLE001 - any teacher failure only drops the payload
            logger.warning("teacher logprobs failed; group sent without distill data: %s", err)
            return group
        for tokens, (ids, lps) in zip(group["tokens"], results, strict=True):
            if len(ids) != len(tokens) or len(lps) != len(tokens):
                logger.warning(
                    "teacher returned %d/%d positions for a sequence of %d tokens; group sent "
                    "without distill data",
                    len(ids),
                    len(lps),
                    len(tokens),
                )
                return group
        group["distill_token_ids"] = [ids for ids, _ in results]
        group["distill_logprobs"] = [lps for _, lps in results]
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
