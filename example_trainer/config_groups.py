"""The fields of :class:`~example_trainer.config.TrainingConfig`, one model per topic.

Each class here is one topic of the trainer's settings and one argument group of its
command line (:mod:`example_trainer.cli` makes the groups from :data:`GROUPS`, the
original's ``add_model_args``, ``add_training_args``, ... each add one); ``TrainingConfig``
is all of them together, plus the checks that span topics. A new setting is a field of the
topic it belongs to, with its ``description`` (the ``--help`` text and a CONFIG.md row).
"""

from __future__ import annotations

import random
import string
from typing import Annotated, ClassVar, List, Literal

from pydantic import BaseModel, Field

from atroposlib.utils.settings_cli import Cli

WeightBridgeMode = Literal["none", "shared_vllm", "lora_only", "lora_restart", "http_reload"]
OptimizerName = Literal["adamw", "adamw_8bit", "adafactor"]
InferenceBackend = Literal["auto", "vllm", "serve_model"]
Precision = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]


def _default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (same rule as the original)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # torch is an optional extra; the config itself must import without it
        return "cpu"


def _random_group() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


class ModelOptions(BaseModel):
    """The model: what is trained, on which device, in which precision."""

    cli_title: ClassVar[str] = "model"

    model_name: str = Field(
        ..., description="HF model name or local directory of the policy to train."
    )
    dtype: str = Field(
        "bfloat16",
        description=(
            "Compute dtype (bfloat16|float16|float32): autocast dtype under --precision auto; "
            "master weights stay float32 (bf16-pure is the only policy with bf16 weights). "
            "On the CPU the default computes in float32 unless --dtype is given."
        ),
    )
    precision: Precision = Field(
        "auto",
        description=(
            "fp32 | bf16-mixed (fp32 weights and optimizer state, bf16 autocast; default on CUDA) | "
            "fp16-mixed (with a grad scaler) | bf16-pure (bf16 weights: small updates are lost; warns) | "
            "auto (from --device and --dtype)."
        ),
    )
    device: Annotated[str, Cli(default_text="cuda when available, else cpu")] = Field(
        default_factory=_default_device, description="Torch device (cuda, cpu, cuda:1...)."
    )
    seed: int = Field(0, description="Random seed for torch.")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op CPU threads (0 = torch's default)."
    )
    gradient_checkpointing: bool = Field(
        False, description="Enable gradient checkpointing (saves memory on big models, costs time)."
    )
    fp32_lm_head: bool = Field(
        False,
        description="Compute the LM head (the logits) in float32 under mixed precision.",
    )
    disable_dropout: bool = Field(
        False,
        description="Set every dropout probability of the policy to 0 (as TRL's disable_dropout).",
    )
    pad_to_multiple: int = Field(
        64, ge=1, description="Pad micro-batch sequence length to a multiple of this."
    )


class TrainingOptions(BaseModel):
    """Optimisation: steps, batch sizes, optimizer and schedule, checkpoints."""

    cli_title: ClassVar[str] = "training"

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    training_steps: int = Field(
        10,
        ge=1,
        description=(
            "Number of API batches to train on; each takes --ppo-epochs x --mini-batches "
            "optimizer steps (one by default)."
        ),
    )
    batch_size: int = Field(
        2, ge=1, description="Micro-batch size (sequences per forward/backward)."
    )
    seq_len: int = Field(
        2048, ge=2, description="Maximum sequence length; registered as max_token_len."
    )
    gradient_accumulation_steps: int = Field(
        32,
        ge=1,
        description="Micro-batches per optimizer step; the API batch is batch_size * this many sequences.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup steps.")
    optimizer: OptimizerName = Field(
        "adamw_8bit",
        description="adamw | adamw_8bit (bitsandbytes; falls back to AdamW when unavailable) | adafactor.",
    )
    adafactor_scale_parameter: bool = Field(False, description="Adafactor scale_parameter.")
    adafactor_relative_step: bool = Field(False, description="Adafactor relative_step.")
    weight_decay: float | None = Field(
        None,
        ge=0,
        description="Weight decay (default: the optimizer's own, 0.01 for AdamW, 0 for Adafactor).",
    )
    decay_norms_and_embeddings: bool = Field(
        False,
        description="Apply weight decay to biases, norm weights and embeddings too (default: to matrices only).",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate after --warmup-steps: constant | linear or cosine decay to --min-lr-ratio * lr at --training-steps.",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="linear/cosine: the final learning rate as a fraction of --lr."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    max_consecutive_skipped_steps: int = Field(
        5,
        ge=0,
        description=(
            "An optimizer step whose gradient is not finite is skipped (weights kept, counted in "
            "train/skipped_steps); stop the run after this many in a row (0 = never stop)."
        ),
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Passes over each API batch (each pass takes --mini-batches optimizer steps).",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over an API batch (its sequences split in this many parts).",
    )
    save_path: str = Field(
        "trained_model_checkpoints", description="Directory for step_N checkpoints and final_model."
    )
    checkpoint_interval: int = Field(
        3, description="Save a resumable checkpoint every N steps (<=0: only the final model)."
    )
    resume: bool = Field(
        False,
        description="Continue from the newest save_path/step_N checkpoint (optimizer and step included).",
    )
    stop_file: str | None = Field(
        None,
        description=(
            "End training early, saving final_model as at the last step, once this file exists "
            "(checked before each step; atropos-grpo-run creates it at max_wall_time)."
        ),
    )


class GrpoOptions(BaseModel):
    """The GRPO loss and advantages: clipping, KL, off-policy correction, aggregation, entropy, distillation (gathered for the loss by :class:`~example_trainer.loss_config.LossConfig`)."""

    cli_title: ClassVar[str] = "GRPO loss and advantages"

    clip_eps: float = Field(0.2, ge=0, description="PPO clip range for the importance ratio.")
    clip_eps_high: float | None = Field(
        None,
        ge=0,
        description="Upper clip range (ratio <= 1 + this; DAPO clip-higher); default: --clip-eps.",
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1,
        description="Dual-clip PPO: cap the loss of a token with A < 0 at -c*A (no gradient once the ratio exceeds c; verl uses 3); default off.",
    )
    loss_type: Literal["token-mean", "grpo", "dr_grpo", "seq-mean-token-sum"] = Field(
        "token-mean",
        description=(
            "How per-token losses become the step's loss (N label tokens, B sequences of the "
            "optimizer step): token-mean sum/N (TRL dapo, verl token-mean; as the original) | "
            "grpo mean over sequences of each sequence's token mean | dr_grpo sum/(B*seq_len) | "
            "seq-mean-token-sum mean over sequences of each sequence's token sum (verl)."
        ),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description=(
            "Advantage = score - group mean, divided by: group (the group's sample std + 1e-4, as TRL) | "
            "batch (the std of all the batch's scores + 1e-4) | none (not divided: Dr. GRPO)."
        ),
    )
    mask_truncated: bool = Field(
        False,
        description=(
            "Sequences that hit the length limit get no loss: cut at --seq-len here, or reported "
            "with finish_reason 'length' in the group's overrides."
        ),
    )
    overlong_penalty_len: int = Field(
        0,
        ge=0,
        description=(
            "DAPO soft overlong penalty: a sequence with more than --seq-len minus this many "
            "trained tokens loses up to --overlong-penalty-factor, linearly (0 = off)."
        ),
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="The overlong penalty at --seq-len trained tokens."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of a KL penalty towards a frozen copy of the starting policy (0 = off, as in the original).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description=(
            "KL estimator with x = ref_logp - logp clamped to +-20: k1 -x | k2 x^2/2 | "
            "k3 exp(x)-x-1 clamped to +-10 (verl's low_var_kl)."
        ),
    )
    kl_in_reward: bool = Field(
        False,
        description=(
            "Put the KL in the reward instead of the loss (verl use_kl_in_reward): each "
            "sequence's score loses --kl-coef x its summed KL before the advantages are computed."
        ),
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "token: one ratio per token (PPO/GRPO) | sequence: GSPO's ratio, exp of the mean "
            "log-ratio of the sequence, shared by its tokens."
        ),
    )
    off_policy_correction: Literal["none", "tis", "icepop"] = Field(
        "none",
        description=(
            "Correct for rollouts sampled by older or numerically different weights, from "
            "inference_logprobs; every mode keeps the PPO clip against the sampler's ratio: "
            "none (as the original), tis (truncate the ratio's weight on the tokens the clip "
            "leaves active at --off-policy-clip) or icepop (drop tokens whose ratio is outside "
            "[--off-policy-clip-low, --off-policy-clip])."
        ),
    )
    off_policy_clip: float = Field(
        2.0,
        gt=0,
        description="tis: the cap on the ratio's weight; icepop: the upper bound of kept ratios.",
    )
    off_policy_clip_low: float = Field(
        0.5, ge=0, description="icepop: the lower bound of kept ratios."
    )
    tis_mode: Literal["clip-zone-zero", "truncate"] = Field(
        "clip-zone-zero",
        description=(
            "--off-policy-correction tis: clip-zone-zero (tokens in PPO's clip zone get no "
            "gradient) | truncate (TRL/verl: every token's loss times min(ratio to the sampler, "
            "--off-policy-clip), PPO's clip against the trainer's own old policy)."
        ),
    )
    entropy_coef: float = Field(
        0.0,
        description="Entropy bonus: subtract this times the policy's token entropy from the loss (0 = off).",
    )
    log_entropy: bool = Field(
        True, description="Log the policy's mean token entropy (train/entropy) every step."
    )
    distill_enabled: bool = Field(
        False,
        description=(
            "On-policy distillation: groups carrying distill_token_ids/distill_logprobs (the "
            "teacher's top-k per position) add --distill-coef x the per-token reverse KL from "
            "the policy to the teacher's top-k (both renormalised over the top-k at "
            "--distill-temperature); groups without them train as before."
        ),
    )
    distill_coef: float = Field(
        1.0, gt=0, description="Weight of the distillation term (with --distill-enabled)."
    )
    distill_temperature: float = Field(
        1.0,
        gt=0,
        description="Temperature of both distributions in the distillation term (logits / T, teacher log-probs / T).",
    )
    distill_only: bool = Field(
        False,
        description=(
            "Train on the teacher signal alone: the loss is the distillation term only (no "
            "policy-gradient, KL or entropy term); needs --distill-enabled."
        ),
    )


class InferenceOptions(BaseModel):
    """The inference server the trainer starts or reaches, and how weight syncs reach it."""

    cli_title: ClassVar[str] = "inference server and weight sync"

    vllm_restart_interval: int = Field(
        3, ge=1, description="Sync weights to inference every N steps (and on the last step)."
    )
    vllm_port: int = Field(9001, ge=1, le=65535, description="Port of the inference server.")
    vllm_gpu: int | None = Field(
        None, description="GPU index for the inference server the trainer launches."
    )
    vllm_gpu_memory_utilization: float = Field(
        0.45, gt=0, le=1, description="vLLM --gpu-memory-utilization."
    )
    max_model_len: int = Field(4096, ge=1, description="Inference server maximum model length.")
    vllm_config_path: str | None = Field(
        None, description="vllm_bridge_config.json path (shared_vllm mode)."
    )
    inference_backend: InferenceBackend = Field(
        "auto",
        description="Server the trainer launches in none/lora_restart mode: vllm, serve_model (atropos-serve-model) or auto (vllm if installed).",
    )
    inference_url: str | None = Field(
        None, description="Base URL of the inference server (default http://localhost:{vllm_port})."
    )
    inference_urls: List[str] | None = Field(
        None,
        description=(
            "Base URLs of every inference server the weights go to (http_reload/lora_only; "
            "with --inference-url, that one comes first); rank 0 pushes each sync to all of "
            "them, names those that failed and goes on while at least one took the weights. "
            "A trailing /v1 is dropped."
        ),
    )
    inference_urls_file: str | None = Field(
        None,
        description=(
            "File with one inference server base URL per line ('#' comments and blank lines "
            "skipped), added after --inference-urls; read when the trainer starts."
        ),
    )
    launch_inference: bool = Field(
        True,
        description="In none/lora_restart mode, launch the inference server at start (false: one is already running and is restarted by us only after the first sync).",
    )
    sync_mode: Literal["live", "pause"] = Field(
        "live",
        description=(
            "http_reload: live (generation goes on while new weights load; the server swaps "
            "between steps) or pause (POST /pause before saving the weights, so in-flight "
            "requests finish and new ones wait, and POST /resume after the update)."
        ),
    )
    sync_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds a weight sync (reload or restart) may take before it fails.",
    )


class ApiOptions(BaseModel):
    """The rollout API (``run-api``) the batches come from."""

    cli_title: ClassVar[str] = "rollout API"

    atropos_url: str = Field(
        "http://localhost:8000", description="Base URL of the rollout API (run-api)."
    )
    batch_poll_interval: float = Field(
        1.0, gt=0, description="Seconds between GET /batch polls while no batch is ready."
    )
    batch_wait_timeout: float = Field(
        0.0,
        ge=0,
        description="Give up if no batch arrives for this many seconds (0 = wait forever).",
    )


class LoggingOptions(BaseModel):
    """Where metrics go: Weights & Biases, ``metrics.jsonl``, the progress bar."""

    cli_title: ClassVar[str] = "logging"

    use_wandb: bool = Field(
        False, description="Log metrics to Weights & Biases (WANDB_MODE=offline works)."
    )
    wandb_project: str | None = Field(None, description="W&B project.")
    wandb_group: Annotated[str | None, Cli(default_text="")] = Field(
        default_factory=_random_group, description="W&B group (random 8 characters if unset)."
    )
    log_dir: str | None = Field(
        None, description="Directory for metrics.jsonl (default: save_path)."
    )
    progress: bool = Field(True, description="Show a rich progress bar.")


class ModeOptions(BaseModel):
    """How new weights reach inference, and which layers train."""

    cli_title: ClassVar[str] = "weight bridge"

    weight_bridge_mode: WeightBridgeMode = Field(
        "none",
        description=(
            "How new weights reach inference: none (checkpoint + restart the inference server), "
            "http_reload (POST /update_weights to atropos-serve-model), lora_only (hot-swap a PEFT adapter), "
            "lora_restart (restart the server with the merged adapter), shared_vllm (CUDA IPC; needs vLLM)."
        ),
    )
    train_layer_indices: List[int] | None = Field(
        None, description="Train only these transformer layers (others frozen)."
    )
    single_copy: bool = Field(False, description="shared_vllm: train directly on vLLM's weights.")


class LoraOptions(BaseModel):
    """LoRA adapters (``lora_only`` and ``lora_restart`` modes)."""

    cli_title: ClassVar[str] = "LoRA"

    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: List[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names LoRA adapts."
    )
    lora_layer_indices: List[int] | None = Field(
        None, description="Apply LoRA only to these layers."
    )


class DistributedOptions(BaseModel):
    """Several trainer processes (``torch.distributed`` + FSDP2; torchrun's RANK/WORLD_SIZE win), on one node or several."""

    cli_title: ClassVar[str] = "distributed"

    trainer_rank: int = Field(
        0, ge=0, description="Rank of this trainer process (torchrun sets RANK instead)."
    )
    world_size: int = Field(
        1,
        ge=1,
        description="Number of trainer processes (torchrun sets WORLD_SIZE instead); >1 shards the model with FSDP2.",
    )
    init_method: str = Field(
        "env://", description="torch.distributed init method (env:// under torchrun)."
    )
    nnodes: int = Field(
        1,
        ge=1,
        description=(
            "Nodes of a run started without torchrun: one trainer process per node, meeting at "
            "--rdzv-endpoint (under torchrun its WORLD_SIZE/RANK win and this is ignored)."
        ),
    )
    node_rank: int = Field(
        0, ge=0, description="This node's rank among --nnodes (0 talks to run-api and syncs)."
    )
    rdzv_endpoint: str | None = Field(
        None,
        description=(
            "host:port where the --nnodes trainer processes meet (torch.distributed's TCP store, "
            "served by --node-rank 0); needed with --nnodes > 1 outside torchrun."
        ),
    )
    num_inference_nodes: int = Field(
        0, ge=0, description="Number of inference nodes (informational)."
    )


class DebugOptions(BaseModel):
    """Debugging and benchmarking."""

    cli_title: ClassVar[str] = "debugging"

    debug_loading: bool = Field(False, description="Log details while loading the model.")
    benchmark: bool = Field(False, description="Log benchmark/* summary metrics at the end.")


GROUPS: tuple[type[BaseModel], ...] = (
    ModelOptions,
    TrainingOptions,
    GrpoOptions,
    InferenceOptions,
    ApiOptions,
    LoggingOptions,
    ModeOptions,
    LoraOptions,
    DistributedOptions,
    DebugOptions,
)
"""The topics in the order the original's command line grouped them."""
