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

from pydantic import Field, ValidationError

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.constants import OPENAI_NAMESPACE
from atroposlib.envs.server_handling.openai_server import resolve_openai_configs
from atroposlib.envs.server_handling.server_baseline import APIServerConfig, ServerBaseline
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.envs.validation import InvalidGroupError, normalize_group
from atroposlib.type_definitions import Item
from atroposlib.utils.cli import merge_dicts

logger = logging.getLogger(__name__)

NO_TEACHER_CONFIG = (
    "teacher_enabled=True but no teacher server configuration was provided "
    "(pass teacher_server_configs, --teacher.* flags or a teacher: YAML key)"
)
CROSS_TOKENIZER = "Cross-tokenizer distillation is not supported"


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
    """Load a Hugging Face tokenizer by name or local path (``transformers.AutoTokenizer``
    looked up at call time, so tests may patch ``from_pretrained``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, use_fast=True)


def _tokenizer_name(config: Any) -> str:
    """A teacher config's tokenizer: ``tokenizer_name``, or ``model_name`` when that is
    ``""`` or ``"none"``."""
    name = getattr(config, "tokenizer_name", "none")
    return config.model_name if name in (None, "", "none") else name


def _in_namespace(namespace: str, message: str) -> str:
    """``resolve_openai_configs`` names the ``--openai.*`` flags it was handed; the user
    wrote ``--<namespace>.*``."""
    return message.replace(f"--{OPENAI_NAMESPACE}.", f"--{namespace}.")


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
    ``ServerManager``, ``resolve_openai_configs`` and ``load_tokenizer`` (and through it
    ``transformers.AutoTokenizer.from_pretrained``) are looked up at call time, so tests
    can patch them; the methods need no state of ``__init__`` beyond ``config``,
    ``teacher_server`` and ``tokenizer``, so they also run on an instance made with
    ``object.__new__``.
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
        yaml_part = (yaml_config or {}).get(namespace) or {}
        default = default_teacher_server_configs
        if default is None and not yaml_part and not cli_values:
            return None
        effective = APIServerConfig() if default is None else default
        if (
            isinstance(effective, ServerBaseline)
            and not isinstance(effective, APIServerConfig)
            and (yaml_part or cli_values)
        ):
            effective = APIServerConfig(**effective.model_dump())
        single = effective[0] if isinstance(effective, list) and len(effective) == 1 else effective
        if isinstance(yaml_part, list) and len(yaml_part) == 1:
            yaml_part = yaml_part[0]
        merged: Dict[str, Any] = {}
        if isinstance(single, APIServerConfig) and isinstance(yaml_part, dict):
            merged = merge_dicts(single.model_dump(), yaml_part, cli_values)
        # Handed over as the openai namespace, by keyword, through the module-level name
        # (looked up at call time, so it can be patched).
        try:
            return resolve_openai_configs(
                default_server_configs=effective,
                openai_config_dict=merged,
                yaml_config={OPENAI_NAMESPACE: yaml_part},
                cli_passed_flags={
                    f"{OPENAI_NAMESPACE}.{key}": value for key, value in cli_values.items()
                },
                logger=logger,
            )
        except ValidationError:
            raise  # the command line names the field in the teacher namespace
        except ValueError as err:
            raise ValueError(_in_namespace(namespace, str(err))) from err

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
        if not getattr(config, "teacher_enabled", False):
            return
        if teacher_server_configs is None:
            teacher_server_configs = type(self).teacher_config_init()
        if teacher_server_configs is None or teacher_server_configs == []:
            raise ValueError(NO_TEACHER_CONFIG)
        if isinstance(teacher_server_configs, dict):  # one server's settings, by field
            teacher_server_configs = resolve_openai_configs(
                default_server_configs=APIServerConfig(),
                openai_config_dict=teacher_server_configs,
                yaml_config={},
                cli_passed_flags={},
                logger=logger,
            )
        if isinstance(teacher_server_configs, APIServerConfig):
            teacher_server_configs = [teacher_server_configs]
        elif isinstance(teacher_server_configs, tuple):
            teacher_server_configs = list(teacher_server_configs)
        # The module-level name, looked up now: tests replace it.
        self.teacher_server = ServerManager(teacher_server_configs, slurm=False, testing=False)
        configs = (
            teacher_server_configs
            if isinstance(teacher_server_configs, list)
            else [teacher_server_configs]
        )
        self.teacher_tokenizer_name = _tokenizer_name(configs[0])
        self._validate_teacher_tokenizer_compatibility(self.teacher_tokenizer_name)
        # Further teacher servers are sent the same token ids: each must share the vocabulary.
        for other in dict.fromkeys(_tokenizer_name(c) for c in configs[1:]):
            if other != self.teacher_tokenizer_name:
                self._validate_teacher_tokenizer_compatibility(other)

    def _student_tokenizer_name(self) -> str:
        """The student tokenizer's ``name_or_path`` once it is loaded, else the name it will
        be loaded from (``config.tokenizer_name``): comparing names loads nothing."""
        loaded = getattr(self, "_tokenizer", None)
        if loaded is not None:
            return getattr(loaded, "name_or_path", None) or ""
        return getattr(getattr(self, "config", None), "tokenizer_name", None) or ""

    def _validate_teacher_tokenizer_compatibility(self, teacher_tokenizer_name: str) -> None:
        """Raise ValueError unless ``teacher_tokenizer_name`` has the student's vocabulary.

        A teacher tokenizer named as the student's passes at once; otherwise it is loaded
        (:func:`load_tokenizer`) and both vocabularies are compared. A mismatch, or a
        teacher tokenizer that cannot be loaded, is a ValueError starting "Cross-tokenizer
        distillation is not supported".
        """
        student_name = self._student_tokenizer_name()
        if teacher_tokenizer_name == student_name:
            return
        try:
            teacher_vocab = load_tokenizer(teacher_tokenizer_name).get_vocab()
        except Exception as err:  # noqa: BLE001 - any load failure is a configuration error
            raise ValueError(
                f"{CROSS_TOKENIZER}, and the teacher tokenizer {teacher_tokenizer_name!r} "
                f"cannot be loaded to compare it with the student's {student_name!r}: {err}"
            ) from err
        if teacher_vocab != self.tokenizer.get_vocab():
            student = student_name or type(self.tokenizer).__name__
            raise ValueError(
                f"{CROSS_TOKENIZER}: the teacher tokenizer {teacher_tokenizer_name!r} does "
                f"not match the student's {student!r} (distillation needs the same vocabulary)"
            )

    def check_teacher_tokenizer(self) -> None:
        """Validate every teacher server's tokenizer against the student's again (see
        :meth:`_validate_teacher_tokenizer_compatibility`), e.g. after a server's config
        changed; the constructor already checked them."""
        for server in getattr(getattr(self, "teacher_server", None), "servers", None) or []:
            self._validate_teacher_tokenizer_compatibility(_tokenizer_name(server.config))

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
        config = getattr(self, "config", None)
        if (
            group is None
            or not getattr(config, "teacher_enabled", False)
            or getattr(self, "teacher_server", None) is None
        ):
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
        teacher = getattr(self, "teacher_server", None)
        if teacher is not None and hasattr(teacher, "close"):
            await teacher.close()
