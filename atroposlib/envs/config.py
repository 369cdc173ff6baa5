"""``BaseEnvConfig``, ``EvalHandlingEnum`` and the env-side data shapes.

Re-exported from :mod:`atroposlib.envs.base`; import them from there.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Dict, List, TypedDict

from pydantic import BaseModel, Field, field_validator

from atroposlib.type_definitions import Message

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class EvalHandlingEnum(Enum):
    """What training workers do while an evaluation runs."""

    STOP_TRAIN = "STOP_TRAIN"
    LIMIT_TRAIN = "LIMIT_TRAIN"
    NONE = "NONE"


class ScoredDataGroup(TypedDict, total=False):
    """A scored group of rollouts, the unit sent to the rollout API.

    ``tokens``, ``masks`` and ``scores`` are required; the rest are optional and
    default to ``None``. ``env_id`` is stamped by :class:`BaseEnv` when sending.
    ``policy_version`` (per sequence: the oldest weight version that generated it) and
    ``policy_version_max`` (the newest, when a sequence spanned a weight swap) are filled by
    :class:`BaseEnv` from what the inference servers reported when the env sets none.
    """

    tokens: List[List[int]]
    masks: List[List[int]]
    scores: List[float]
    advantages: List[List[float]] | None
    ref_logprobs: List[List[float]] | None
    messages: List[List[Message]] | None
    generation_params: Dict[str, Any] | None
    inference_logprobs: List[List[float]] | None
    group_overrides: Dict[str, Any] | None
    overrides: List[Dict[str, Any]] | None
    images: Any | None
    distill_token_ids: List[List[List[int]]] | None
    distill_logprobs: List[List[List[float]]] | None
    policy_version: List[int] | None
    policy_version_max: List[int] | None


class ScoredDataItem(TypedDict, total=False):
    """One scored rollout, returned by ``collect_trajectory``."""

    tokens: List[int]
    masks: List[int]
    scores: float
    advantages: List[float] | None
    ref_logprobs: List[float] | None
    messages: List[Message] | None
    group_overrides: Dict[str, Any] | None
    overrides: Dict[str, Any] | None
    images: Any | None
    distill_token_ids: List[List[int]] | None
    distill_logprobs: List[List[float]] | None
    policy_version: int | None
    policy_version_max: int | None


class BaseEnvConfig(BaseModel):
    """Configuration of an environment; every field is also a ``--env.<name>`` flag."""

    group_size: int = Field(
        default=4, description="How many responses are grouped together for scoring."
    )
    max_num_workers: int = Field(
        default=-1,
        description="Maximum number of concurrent rollout workers; -1 means "
        "max_num_workers_per_node times the number of inference servers.",
    )
    max_eval_workers: int = Field(
        default=16, description="Maximum number of concurrent evaluation workers."
    )
    max_num_workers_per_node: int = Field(
        default=8, description="Workers per inference server, used when max_num_workers is -1."
    )
    steps_per_eval: int = Field(
        default=100, description="Run evaluate() every this many trainer steps (0 disables)."
    )
    max_token_length: int = Field(default=2048, description="Maximum token length of a rollout.")
    eval_handling: EvalHandlingEnum = Field(
        default=EvalHandlingEnum.STOP_TRAIN,
        description="What training does while evaluating: STOP_TRAIN, LIMIT_TRAIN or NONE.",
    )
    eval_limit_ratio: float = Field(
        default=0.5, description="Fraction of workers kept during evaluation with LIMIT_TRAIN."
    )
    inference_weight: float = Field(
        default=1.0,
        description="Relative share of inference capacity this env asks for (-1 ignores it).",
    )
    batch_size: int = Field(
        default=-1, description="Trainer batch size; -1 takes it from the rollout API."
    )
    max_batches_offpolicy: int = Field(
        default=3,
        description="Pause rollouts when this many batches are already queued (0 disables).",
    )
    tokenizer_name: str = Field(
        default="NousResearch/DeepHermes-3-Llama-3-3B-Preview",
        description="Hugging Face tokenizer name or local directory.",
    )
    use_wandb: bool = Field(default=True, description="Log metrics to Weights & Biases.")
    rollout_server_url: str = Field(
        default="http://localhost:8000", description="URL of the rollout API (run-api)."
    )
    total_steps: int = Field(
        default=1000,
        description="Trainer steps to run for; -1 takes num_steps from the rollout API.",
    )
    wandb_name: str | None = Field(
        default=None, description="Name of this env in W&B and in the rollout API registry."
    )
    num_rollouts_to_keep: int = Field(
        default=32, description="Groups kept in the W&B rollout table."
    )
    num_rollouts_per_group_for_logging: int = Field(
        default=1, description="Rollouts of each group shown in the W&B table (-1 = all)."
    )
    ensure_scores_are_not_same: bool = Field(
        default=True, description="Drop groups whose scores are all equal (they carry no signal)."
    )
    data_path_to_save_groups: str | None = Field(
        default=None, description="If set, also write every sent group to this jsonl file."
    )
    data_dir_to_save_evals: str | None = Field(
        default=None, description="Directory for evaluation results (metrics.json, samples.jsonl)."
    )
    min_items_sent_before_logging: int = Field(
        default=2, description="Groups that must be sent in a step before metrics are logged."
    )
    include_messages: bool = Field(
        default=False, description="Send the chat messages along with the tokens."
    )
    min_batch_allocation: float | None = Field(
        default=None, description="Minimum fraction of each batch reserved for this env (0..1)."
    )
    worker_timeout: float = Field(
        default=600, description="Seconds after which a rollout worker is cancelled (-1 = never)."
    )
    thinking_mode: bool = Field(
        default=False, description="Enable reasoning/thinking on the inference servers."
    )
    reasoning_effort: str | None = Field(
        default=None, description="Reasoning effort: none, minimal, low, medium, high or xhigh."
    )
    max_reasoning_tokens: int | None = Field(
        default=None, description="Token budget for reasoning (1024-32000)."
    )
    custom_thinking_prompt: str | None = Field(
        default=None, description="Custom system prompt used to turn thinking on."
    )
    max_consecutive_failures: int = Field(
        default=20,
        description="Stop with an error after this many failures in a row (collect_trajectories, "
        "get_next_item, invalid groups); 0 never stops.",
    )
    max_server_downtime: float = Field(
        default=600,
        description="Stop with an error after every inference server has been unreachable "
        "for this many seconds; 0 never stops.",
    )

    @field_validator("reasoning_effort")
    @classmethod
    def _check_effort(cls, value: str | None) -> str | None:
        if value is not None and value not in REASONING_EFFORTS:
            raise ValueError(
                f"Invalid reasoning_effort {value!r}. Must be one of: {', '.join(REASONING_EFFORTS)}"
            )
        return value

    @field_validator("max_reasoning_tokens")
    @classmethod
    def _check_reasoning_tokens(cls, value: int | None) -> int | None:
        if value is not None and not 1024 <= value <= 32000:
            raise ValueError("max_reasoning_tokens must be between 1024 and 32000")
        return value

    @field_validator("min_batch_allocation")
    @classmethod
    def _check_allocation(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError("min_batch_allocation must be between 0 and 1")
        return value
