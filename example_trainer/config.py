"""`TrainingConfig`: every knob of the example GRPO trainer.

Field names and defaults follow the original trainer (single-file 2025 version plus
the 2026 modular additions). Each field's ``description`` is also its ``--help`` text
(see :mod:`example_trainer.cli`, which turns ``lr`` into ``--lr`` and
``gradient_accumulation_steps`` into ``--gradient-accumulation-steps`` with
:mod:`atroposlib.utils.settings_cli`, as ``run-api`` and ``atropos-serve-model`` do).

Additions over the original (all default to the original behaviour):

- ``weight_bridge_mode="http_reload"``: push new weights to ``atropos-serve-model``
  through ``POST /update_weights`` without restarting it;
- ``kl_coef`` (default 0, i.e. no KL term, like the original) for an optional KL
  penalty towards a frozen copy of the starting policy;
- ``resume`` to continue from the newest ``save_path/step_N`` checkpoint;
- ``inference_url``/``inference_backend``/``sync_timeout`` for weight sync;
- ``pad_to_multiple``, ``batch_poll_interval``, ``max_grad_norm``, ``seed``;
- ``off_policy_correction`` (``none``/``tis``/``icepop``, see
  :mod:`example_trainer.off_policy`) with ``off_policy_clip``/``off_policy_clip_low``,
  and ``sync_mode=pause`` (pause the server around an ``http_reload`` sync);
- ``precision`` (see :mod:`example_trainer.precision`): fp32 master weights under
  mixed precision unless ``bf16-pure`` is asked for; ``dtype`` is the compute dtype.

``trainer_rank``/``world_size``/``init_method`` start ``torch.distributed`` training
(FSDP2, see :mod:`example_trainer.distributed`); under ``torchrun`` they come from its
environment. ``nnodes``/``node_rank``/``rdzv_endpoint`` do the same across nodes without
torchrun (one process per node). ``inference_urls``/``inference_urls_file`` name every
inference server of a fleet; rank 0 pushes each weight sync to all of them. Settings that this trainer does not implement (``shared_vllm`` and its
``single_copy``/``vllm_config_path``) are rejected here, before anything is loaded.
"""

from __future__ import annotations

import os
import random
import string
from typing import Annotated, List, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from atroposlib.utils.settings_cli import Cli

WeightBridgeMode = Literal["none", "shared_vllm", "lora_only", "lora_restart", "http_reload"]
OptimizerName = Literal["adamw", "adamw_8bit", "adafactor"]
InferenceBackend = Literal["auto", "vllm", "serve_model"]
Precision = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]
_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float", "auto")


def _default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (same rule as the original)."""
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # torch is an optional extra; the config itself must import without it
        return "cpu"


def check_server_url(url: str) -> str:
    """``url`` as a server base URL: http(s)://host[:port], no trailing ``/`` or ``/v1``
    (so the URLs environments are given work as they are); ValueError otherwise."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return u


def read_urls_file(path: str) -> List[str]:
    """The server URLs in ``path``: one per line, ``#`` comments and blank lines skipped.

    ValueError names the file (and the line) when it cannot be read or a line is no URL.
    """
    try:
        text = open(os.path.expanduser(path), encoding="utf-8").read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    urls = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                urls.append(check_server_url(line))
            except ValueError as exc:
                raise ValueError(f"{path} line {n}: {exc}") from None
    if not urls:
        raise ValueError(f"{path} lists no URL")
    return urls


def _random_group() -> str:
    return "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


class TrainingConfig(BaseModel):
    """Configuration of the GRPO trainer (``atropos-grpo``).

    Example::

        cfg = TrainingConfig(model_name="/path/to/model", training_steps=20, lr=1e-4)
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- model and optimisation -------------------------------------------------------
    model_name: str = Field(
        ..., description="HF model name or local directory of the policy to train."
    )
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
    clip_eps: float = Field(0.2, ge=0, description="PPO clip range for the importance ratio.")
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
    tis_mode: Literal["clip-zone-zero", "truncate"] = Field(
        "clip-zone-zero",
        description=(
            "--off-policy-correction tis: clip-zone-zero (tokens in PPO's clip zone get no "
            "gradient) | truncate (TRL/verl: every token's loss times min(ratio to the sampler, "
            "--off-policy-clip), PPO's clip against the trainer's own old policy)."
        ),
    )
    fp32_lm_head: bool = Field(
        False,
        description="Compute the LM head (the logits) in float32 under mixed precision.",
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
    mask_truncated: bool = Field(
        False,
        description=(
            "Sequences that hit the length limit get no loss: cut at --seq-len here, or reported "
            "with finish_reason 'length' in the group's overrides."
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
    disable_dropout: bool = Field(
        False,
        description="Set every dropout probability of the policy to 0 (as TRL's disable_dropout).",
    )
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
    max_consecutive_skipped_steps: int = Field(
        5,
        ge=0,
        description=(
            "An optimizer step whose gradient is not finite is skipped (weights kept, counted in "
            "train/skipped_steps); stop the run after this many in a row (0 = never stop)."
        ),
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    gradient_checkpointing: bool = Field(
        False, description="Enable gradient checkpointing (saves memory on big models, costs time)."
    )
    device: Annotated[str, Cli(default_text="cuda when available, else cpu")] = Field(
        default_factory=_default_device, description="Torch device (cuda, cpu, cuda:1...)."
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
    seed: int = Field(0, description="Random seed for torch.")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op CPU threads (0 = torch's default)."
    )
    pad_to_multiple: int = Field(
        64, ge=1, description="Pad micro-batch sequence length to a multiple of this."
    )

    # --- checkpoints ----------------------------------------------------------------
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

    # --- inference server / weight sync ------------------------------------------------
    weight_bridge_mode: WeightBridgeMode = Field(
        "none",
        description=(
            "How new weights reach inference: none (checkpoint + restart the inference server), "
            "http_reload (POST /update_weights to atropos-serve-model), lora_only (hot-swap a PEFT adapter), "
            "lora_restart (restart the server with the merged adapter), shared_vllm (CUDA IPC; needs vLLM)."
        ),
    )
    sync_mode: Literal["live", "pause"] = Field(
        "live",
        description=(
            "http_reload: live (generation goes on while new weights load; the server swaps "
            "between steps) or pause (POST /pause before saving the weights, so in-flight "
            "requests finish and new ones wait, and POST /resume after the update)."
        ),
    )
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
    single_copy: bool = Field(False, description="shared_vllm: train directly on vLLM's weights.")
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
    sync_timeout: float = Field(
        300.0,
        gt=0,
        description="Seconds a weight sync (reload or restart) may take before it fails.",
    )

    # --- layer / LoRA selection ----------------------------------------------------------
    train_layer_indices: List[int] | None = Field(
        None, description="Train only these transformer layers (others frozen)."
    )
    lora_r: int = Field(16, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha.")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout.")
    lora_target_modules: List[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names LoRA adapts."
    )
    lora_layer_indices: List[int] | None = Field(
        None, description="Apply LoRA only to these layers."
    )

    # --- distributed (torch.distributed + FSDP2; torchrun's RANK/WORLD_SIZE win) -------------
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

    # --- API ---------------------------------------------------------------------------
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

    # --- logging -------------------------------------------------------------------------
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
    debug_loading: bool = Field(False, description="Log details while loading the model.")
    benchmark: bool = Field(False, description="Log benchmark/* summary metrics at the end.")

    @field_validator("atropos_url", "inference_url")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        return v.rstrip("/") if v else v

    @field_validator("inference_urls")
    @classmethod
    def _check_urls(cls, v: List[str] | None) -> List[str] | None:
        return None if v is None else [check_server_url(u) for u in v]

    @field_validator("inference_urls_file")
    @classmethod
    def _urls_file_exists(cls, v: str | None) -> str | None:
        if v is not None:
            read_urls_file(v)  # a missing file or a bad line is refused here, naming both
        return v

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be host:port (e.g. node001:29500), got {v!r}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v not in _DTYPES:
            raise ValueError(
                f"must be one of bfloat16, float16, float32 (or bf16, fp16, fp32), got {v!r}"
            )
        return v

    @field_validator("model_name")
    @classmethod
    def _local_path_exists(cls, v: str) -> str:
        # A name spelled as a path must exist: otherwise transformers would try the hub
        # and fail after a long traceback.
        if v.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(v)):
            raise ValueError(f"{v} does not exist (no such local directory)")
        return v

    @model_validator(mode="after")
    def _check_off_policy_bounds(self) -> TrainingConfig:
        if self.off_policy_clip_low > self.off_policy_clip:
            raise ValueError(
                f"off_policy_clip_low ({self.off_policy_clip_low}) must not exceed "
                f"off_policy_clip ({self.off_policy_clip})"
            )
        return self

    @model_validator(mode="after")
    def _check_loss_options(self) -> TrainingConfig:
        if self.importance_sampling_level == "sequence" and (
            self.off_policy_correction == "icepop"
            or (self.off_policy_correction == "tis" and self.tis_mode != "truncate")
        ):
            raise ValueError(
                "importance_sampling_level sequence works with off_policy_correction none, or "
                "tis with tis_mode truncate"
            )
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (the weight of the KL in the reward)")
        if self.distill_only and not self.distill_enabled:
            raise ValueError("distill_only needs distill_enabled (the term it trains on)")
        if self.overlong_penalty_len >= self.seq_len:
            raise ValueError(
                f"overlong_penalty_len ({self.overlong_penalty_len}) must be below seq_len "
                f"({self.seq_len})"
            )
        return self

    @model_validator(mode="after")
    def _check_modes(self) -> TrainingConfig:
        if self.weight_bridge_mode == "shared_vllm":
            raise ValueError(
                "weight_bridge_mode=shared_vllm (CUDA IPC into vLLM) is not implemented by this trainer; "
                "use http_reload (atropos-serve-model) or none (checkpoint + restart)"
            )
        if self.single_copy:
            raise ValueError(
                "single_copy is part of shared_vllm, which this trainer does not implement"
            )
        if self.vllm_config_path is not None:
            raise ValueError(
                "vllm_config_path is read only by shared_vllm, which this trainer does not implement"
            )
        if self.nnodes > 1:
            if self.rdzv_endpoint is None and "WORLD_SIZE" not in os.environ:
                raise ValueError(
                    "nnodes > 1 needs rdzv_endpoint (host:port of --node-rank 0) or torchrun"
                )
            if self.node_rank >= self.nnodes:
                raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
            if self.world_size > 1:
                raise ValueError(
                    "world_size and nnodes both set: nnodes runs one process per node; "
                    "for several per node launch with torchrun --nnodes --nproc-per-node"
                )
        world = self.effective_world_size
        if world > 1 and self.uses_lora:
            raise ValueError(
                f"weight_bridge_mode={self.weight_bridge_mode} (LoRA) runs on one process only; "
                f"got world_size {world}"
            )
        if world > 1 and self.precision == "fp16-mixed":
            raise ValueError(
                "fp16-mixed (grad scaler) runs on one process only; use bf16-mixed or fp32"
            )
        if self.trainer_rank >= self.world_size and "RANK" not in os.environ:
            raise ValueError(
                f"trainer_rank {self.trainer_rank} must be < world_size {self.world_size}"
            )
        try:
            from .precision import PrecisionError, policy_for
        except ImportError:  # torch missing: the trainer cannot run anyway, the config still parses
            return self
        try:
            policy_for(self)
        except PrecisionError as exc:
            raise ValueError(str(exc)) from None
        return self

    # --- derived values ----------------------------------------------------------------------
    @property
    def effective_world_size(self) -> int:
        """Trainer processes: torchrun's ``WORLD_SIZE`` when set, else ``world_size``."""
        env = os.environ.get("WORLD_SIZE")
        if env and env.isdigit():
            return int(env)
        return self.nnodes if self.nnodes > 1 else self.world_size

    @property
    def api_batch_size(self) -> int:
        """Sequences per API batch: ``batch_size * gradient_accumulation_steps``."""
        return self.batch_size * self.gradient_accumulation_steps

    @property
    def resolved_inference_url(self) -> str:
        """Inference server base URL (no trailing slash, no ``/v1``)."""
        return self.inference_url or f"http://localhost:{self.vllm_port}"

    @property
    def resolved_inference_urls(self) -> List[str]:
        """Every inference server the weights go to, in order, without repeats: ``inference_url``
        (or the ``vllm_port`` default when no list is given), ``inference_urls``, then the
        lines of ``inference_urls_file``."""
        urls: List[str] = []
        if self.inference_url or not (self.inference_urls or self.inference_urls_file):
            urls.append(self.resolved_inference_url)
        urls += self.inference_urls or []
        if self.inference_urls_file:
            urls += read_urls_file(self.inference_urls_file)
        return list(dict.fromkeys(urls))

    @property
    def metrics_dir(self) -> str:
        """Where ``metrics.jsonl`` is written."""
        return self.log_dir or self.save_path

    @property
    def resolved_weight_decay(self) -> float:
        """``weight_decay``, or the optimizer's default (AdamW 0.01, Adafactor 0)."""
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.0 if self.optimizer == "adafactor" else 0.01

    @property
    def uses_lora(self) -> bool:
        """True for the PEFT modes."""
        return self.weight_bridge_mode in ("lora_only", "lora_restart")
