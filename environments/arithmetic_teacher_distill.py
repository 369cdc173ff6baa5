"""Arithmetic with a teacher: every group carries the teacher's top-k per position for distillation.

The same task, split, prompts and reward as :mod:`environments.arithmetic_server`;
before a group is sent, each sequence goes through the teacher server
(:class:`~atroposlib.envs.teacher_distillation_env.TeacherDistillationEnv`), which fills
``distill_token_ids``/``distill_logprobs`` (``[seq][pos][k]``); the trainer uses them with
``--distill-enabled``. The teacher must share the student's tokenizer (the tiny model's
checkpoints all do).

The CPU distillation demo (``atropos-grpo-run --config
example_trainer/configs/distill_cpu.yaml``) starts the teacher server and passes it as
``--teacher.*`` flags; by hand::

    python environments/arithmetic_teacher_distill.py serve \\
        --openai.base_url http://127.0.0.1:9001/v1 --openai.model_name STUDENT_DIR \\
        --env.tokenizer_name STUDENT_DIR \\
        --teacher.base_url http://127.0.0.1:9003/v1 --teacher.model_name teacher \\
        --teacher.server_type vllm --env.teacher_top_k 8
"""

from __future__ import annotations

from typing import List, Tuple

from pydantic import Field

from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.teacher_distillation_env import (
    TeacherDistillationConfig,
    TeacherDistillationEnv,
)

try:
    from environments.arithmetic_server import (
        ArithmeticEnv,
        ArithmeticEnvConfig,
        greedy_eval,
        sft_examples,
    )
except ModuleNotFoundError:  # run as a script (python environments/...): its folder is on the path
    from arithmetic_server import (  # type: ignore[no-redef]
        ArithmeticEnv,
        ArithmeticEnvConfig,
        greedy_eval,
        sft_examples,
    )

__all__ = [
    "ArithmeticTeacherDistillConfig",
    "ArithmeticTeacherDistillEnv",
    "greedy_eval",
    "sft_examples",
]


class ArithmeticTeacherDistillConfig(ArithmeticEnvConfig, TeacherDistillationConfig):
    """Arithmetic settings plus the teacher switches (on, top 8 by default)."""

    teacher_enabled: bool = Field(
        default=True, description="Fetch teacher top-k logprobs for every group."
    )
    teacher_top_k: int = Field(
        default=8,
        ge=-1,
        description="Teacher logprobs per position: 0 = the sampled token only, -1 = disabled.",
    )


class ArithmeticTeacherDistillEnv(TeacherDistillationEnv, ArithmeticEnv):
    """:class:`ArithmeticEnv` whose groups carry the teacher's top-k logprobs."""

    name = "arithmetic_teacher_distill"
    env_config_cls = ArithmeticTeacherDistillConfig

    @classmethod
    def config_init(cls) -> Tuple[ArithmeticTeacherDistillConfig, List[APIServerConfig]]:
        env_config, servers = ArithmeticEnv.config_init()
        config = ArithmeticTeacherDistillConfig(
            **{**env_config.model_dump(), "wandb_name": cls.name},
            teacher_enabled=True,
            teacher_top_k=8,
        )
        return config, servers


if __name__ == "__main__":
    ArithmeticTeacherDistillEnv.cli()
