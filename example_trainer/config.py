"""`TrainingConfig`: every knob of the example GRPO trainer.

The fields are declared by topic in :mod:`example_trainer.config_groups` (model, training,
GRPO loss, inference server, rollout API, logging, weight bridge, LoRA, distributed,
debugging); ``TrainingConfig`` joins the topics and checks what spans them. Field names
and defaults follow the original trainer (single-file 2025 version plus the 2026 modular
additions). Each field's ``description`` is also its ``--help`` text (see
:mod:`example_trainer.cli`, which turns ``lr`` into ``--lr`` and
``gradient_accumulation_steps`` into ``--gradient-accumulation-steps`` with
:mod:`atroposlib.utils.settings_cli`, as ``run-api`` and ``atropos-serve-model`` do), in
the argument group of its topic.

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
inference server of a fleet; rank 0 pushes each weight sync to all of them. Settings that
this trainer does not implement (``shared_vllm`` and its ``single_copy``/``vllm_config_path``)
are rejected here, before anything is loaded.
"""

from __future__ import annotations

import os
from typing import List

from pydantic import ConfigDict, field_validator, model_validator

from .config_groups import (
    ApiOptions,
    DebugOptions,
    DistributedOptions,
    GrpoOptions,
    InferenceBackend,
    InferenceOptions,
    LoggingOptions,
    LoraOptions,
    ModelOptions,
    ModeOptions,
    OptimizerName,
    Precision,
    TrainingOptions,
    WeightBridgeMode,
)

__all__ = [
    "InferenceBackend",
    "OptimizerName",
    "Precision",
    "TrainingConfig",
    "WeightBridgeMode",
    "check_server_url",
    "read_urls_file",
]

_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float", "auto")


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


# pydantic lists the fields of the last base first: so they read in the order of GROUPS.
class TrainingConfig(
    DebugOptions,
    DistributedOptions,
    LoraOptions,
    ModeOptions,
    LoggingOptions,
    ApiOptions,
    InferenceOptions,
    GrpoOptions,
    TrainingOptions,
    ModelOptions,
):
    """Configuration of the GRPO trainer (``atropos-grpo``): every field of the topics in
    :mod:`example_trainer.config_groups`, and the checks that span them.

    Example::

        cfg = TrainingConfig(model_name="/path/to/model", training_steps=20, lr=1e-4)
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

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
