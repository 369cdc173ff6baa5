"""GSM8K with a teacher: every group carries the teacher's top-k per position for distillation.

The same task, prompts and scoring as :mod:`environments.gsm8k_server`; before a group is
written or sent, each sequence goes through the teacher server
(:class:`~atroposlib.envs.teacher_distillation_env.TeacherDistillationEnv`), which fills
``distill_token_ids``/``distill_logprobs`` (``[seq][pos][k]``). The trainer uses them with
``--distill-enabled`` (example_trainer/README.md, "On-policy distillation"). The teacher must
share the student's tokenizer.

The teacher server is :meth:`GSM8kTeacherDistillEnv.teacher_config_init` (a vLLM-style server
on port 9003); in ``serve`` mode ``--teacher.*`` flags or a ``teacher:`` YAML key replace it.

Run::

    python environments/gsm8k_server_teacher_distill.py serve \\
        --openai.base_url http://127.0.0.1:9001/v1 --openai.server_type vllm \\
        --teacher.base_url http://127.0.0.1:9003/v1 --teacher.server_type vllm \\
        --env.teacher_top_k 8
    python environments/gsm8k_server_teacher_distill.py process --env.data_path my_gsm8k.jsonl \\
        --env.total_steps 8 --env.data_path_to_save_groups out/gsm8k_distill.jsonl
"""

from __future__ import annotations

from typing import Tuple

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.teacher_distillation_env import (
    TeacherDistillationConfig,
    TeacherDistillationEnv,
)

try:
    from environments.gsm8k_server import DEFAULT_MODEL, GSM8kConfig, GSM8kEnv
except ModuleNotFoundError:  # run as a script (python environments/...): its folder is on the path
    from gsm8k_server import DEFAULT_MODEL, GSM8kConfig, GSM8kEnv  # type: ignore[no-redef]

TEACHER_BASE_URL = "http://localhost:9003/v1"


class GSM8kTeacherDistillConfig(GSM8kConfig, TeacherDistillationConfig):
    """GSM8K settings plus the teacher switches (``teacher_enabled``, ``teacher_top_k``)."""


class GSM8kTeacherDistillEnv(TeacherDistillationEnv, GSM8kEnv):
    """:class:`GSM8kEnv` whose groups carry the teacher's top-k logprobs."""

    name = "gsm8k_teacher_distill"
    env_config_cls = GSM8kTeacherDistillConfig

    @classmethod
    def config_init(cls) -> Tuple[GSM8kTeacherDistillConfig, APIServerConfig]:
        env_config, server_config = GSM8kEnv.config_init()
        config = GSM8kTeacherDistillConfig(
            **{**env_config.model_dump(), "wandb_name": cls.name},
            teacher_enabled=True,
            teacher_top_k=8,
        )
        return config, server_config

    @classmethod
    def teacher_config_init(cls) -> APIServerConfig:
        """The teacher: a vLLM-style server with the student's tokenizer on port 9003."""
        return APIServerConfig(
            model_name=DEFAULT_MODEL,
            base_url=TEACHER_BASE_URL,
            api_key="x",
            server_type="vllm",
        )


if __name__ == "__main__":
    GSM8kTeacherDistillEnv.cli()
