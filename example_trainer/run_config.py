"""What ``atropos-grpo-run`` is told to do: the run configuration (YAML and/or flags).

Every field's ``description`` is its documentation (CONFIG.md is generated from it).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal

from pydantic import BaseModel, ConfigDict, Field

from atroposlib.utils.settings_cli import Cli

from .config import Precision


class WarmupSection(BaseModel):
    """Supervised warm-up on the task format before RL (cached)."""

    model_config = ConfigDict(extra="forbid")
    examples: str = Field(
        ...,
        description="'path/to/env.py:function' returning (messages, answer) pairs; called as fn(n, seed).",
    )
    n_examples: int = Field(2000, ge=1, description="Number of examples generated.")
    steps: int = Field(100, ge=1, description="Optimizer steps.")
    lr: float = Field(3e-3, gt=0, description="Learning rate.")
    batch_size: int = Field(32, ge=1, description="Examples per step.")
    seed: int = Field(0, description="Seed of the examples and the training order.")
    score_function: str | None = Field(
        None,
        description="'path/to/env.py:function' called as fn(model, tokenizer) → score, to stop early.",
    )
    stop_at_score: float | None = Field(
        None, ge=0, le=1, description="Stop the warm-up once score_function reaches this."
    )
    check_every: int = Field(10, ge=1, description="Steps between score checks.")


class EvalSection(BaseModel):
    """Evaluation through the inference server before, during and after training."""

    model_config = ConfigDict(extra="forbid")
    function: str = Field(
        ...,
        description="'path/to/env.py:function' called as fn(base_url, tokenizer) → score in [0, 1].",
    )
    every_steps: int = Field(
        0,
        ge=0,
        description="Also evaluate whenever the trainer passes a multiple of this step (0 = only before/after).",
    )


class RunConfig(BaseModel):
    """Configuration of ``atropos-grpo-run`` (YAML file and/or flags)."""

    model_config = ConfigDict(extra="forbid")
    run_dir: str | None = Field(
        None,
        description="Directory for logs, checkpoints and the summary (default runs/run-<time>).",
    )
    model: str = Field(
        "tiny", description="Model directory or hub name; 'tiny' = the offline tiny model."
    )
    tiny_model_size: Dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Shape overrides of the tiny model (model: tiny), e.g. {num_attention_heads: 2, "
            "num_key_value_heads: 1}: head_dim 32, the least vLLM's CPU attention serves."
        ),
    )
    served_model_name: str | None = Field(
        None, description="Model name the inference server reports (default: model path)."
    )
    api_port: int = Field(8000, ge=0, le=65535, description="run-api port (0 = any free port).")
    inference_port: int = Field(
        9001, ge=0, le=65535, description="Inference server port (0 = any free port)."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="run-api --max-staleness: drop queued groups more than this many policy versions behind the step (default: keep all).",
    )
    api_args: List[str] = Field(default_factory=list, description="Extra flags for run-api.")
    inference_backend: Literal["serve_model", "vllm"] = Field(
        "serve_model",
        description=(
            "Inference server: atropos-serve-model or vLLM's own OpenAI server (run by "
            "ATROPOS_VLLM_PYTHON, else .venv-vllm/bin/python when present; started with its "
            "RL routes on, so http_reload reloads the weights in place)."
        ),
    )
    inference_env: Dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables for the inference server (e.g. VLLM_CPU_KVCACHE_SPACE).",
    )
    inference_device: str = Field(
        "auto",
        description="Device of the inference server: auto, cpu, cuda or cuda:N (N becomes CUDA_VISIBLE_DEVICES).",
    )
    inference_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype of the inference server (auto: its own default)."
    )
    inference_args: List[str] = Field(
        default_factory=list, description="Extra flags for the inference server."
    )
    device: str | None = Field(
        None,
        description="Trainer (and warm-up) device: cpu, cuda, cuda:N (default: cuda when available).",
    )
    precision: Precision = Field(
        "auto", description="Trainer --precision (see atropos-grpo --help)."
    )
    trainer_procs: int = Field(
        1,
        ge=1,
        description="Trainer processes; >1 launches the trainer with torchrun (FSDP2 across processes/GPUs).",
    )
    envs: Annotated[List[str], Cli(flag="--env")] = Field(
        default_factory=lambda: ["environments/arithmetic_server.py"],
        description="Environment files to run (python FILE serve ...); one --env per file.",
    )
    env_args: List[str] = Field(
        default_factory=list, description="Extra flags for every environment."
    )
    group_size: int = Field(8, ge=1, description="--env.group_size for the environments.")
    weight_bridge_mode: Literal["http_reload", "none", "lora_only", "lora_restart"] = Field(
        "http_reload", description="Trainer weight sync mode."
    )
    trainer: Dict[str, Any] = Field(
        default_factory=dict, description="TrainingConfig fields for the trainer (snake_case keys)."
    )
    trainer_args: List[str] = Field(
        default_factory=list,
        description="Extra atropos-grpo flags (after '--' on the command line).",
    )
    warmup: WarmupSection | None = Field(None, description="Supervised warm-up before RL.")
    eval: EvalSection | None = Field(None, description="Evaluation before/after training.")
    cpu_threads: int = Field(
        0,
        ge=0,
        description="If > 0: OMP/torch CPU threads for every process (1 is fastest on a busy CPU).",
    )
    startup_timeout: float = Field(
        180.0, gt=0, description="Seconds each service may take to become healthy."
    )
    max_wall_time: float = Field(
        0.0, ge=0, description="Stop everything after this many seconds (0 = no limit)."
    )
    status_interval: float = Field(1.0, gt=0, description="Seconds between status refreshes.")

    @property
    def owns_inference(self) -> bool:
        """True when the launcher runs the inference server (the restart modes let the trainer do it)."""
        return self.weight_bridge_mode not in ("none", "lora_restart")

    def trainer_device(self) -> str:
        """``device``, or cuda when a GPU is visible."""
        if self.device:
            return self.device
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
