"""Configuration of ``atropos-serve-model``: each field is a flag and its description that
flag's ``--help`` text (see :mod:`atroposlib.utils.settings_cli`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from atroposlib.utils.settings_cli import Cli


class ServeModelConfig(BaseModel):
    """Settings of the embedded inference server."""

    model: Annotated[str, Cli(positional=True)] = Field(
        ..., description="Local model directory or a Hugging Face hub name."
    )
    host: str = Field(
        "127.0.0.1", description="Interface to bind (use 0.0.0.0 for remote clients)."
    )
    port: int = Field(9001, ge=0, le=65535, description="TCP port to listen on.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto picks cuda when available."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; auto is float32 on CPU and bfloat16 on CUDA."
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Longest prompt+completion in tokens; default: the model's "
        "max_position_embeddings.",
    )
    served_model_name: Annotated[list[str] | None, Cli(nargs="+")] = Field(
        None, description="Name(s) clients use in the 'model' field; default: MODEL as given."
    )
    api_key: str | None = Field(
        None,
        description="Require 'Authorization: Bearer KEY' on every endpoint but /health (and /). "
        "Visible in `ps`: prefer --api-key-file or $ATROPOS_SERVE_MODEL_API_KEY.",
    )
    api_key_file: str | None = Field(
        None, description="Read the API key from this file (used when --api-key is not given)."
    )
    cors_origin: list[str] | None = Field(
        None,
        description="Origin (scheme://host:port) whose browser requests are accepted; "
        "repeatable, '*' accepts any. Other Origins get 403.",
    )
    weights_root: list[str] | None = Field(
        None,
        description="Directory /update_weights may load checkpoints from (repeatable); the "
        "served model's parent directory is always allowed. Paths resolving elsewhere get 403.",
    )
    allow_client_chat_template: bool = Field(
        False,
        description="Accept 'chat_template' from clients (rendered in a sandboxed process with "
        "time, memory and size limits). Off: such requests get 400.",
    )
    client_template_timeout: float = Field(
        2.0, gt=0.0, le=60.0, description="Seconds a client chat template may take to render."
    )
    client_template_max_chars: int = Field(
        1_000_000, ge=1, description="Longest output of a client chat template, in characters."
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        description="Most sequences decoded at once (KV cache slots of --max-model-len "
        "tokens each; on CUDA fewer when --gpu-memory-fraction does not hold them all).",
    )
    max_prefill_tokens: int = Field(
        2048,
        ge=1,
        description="Most (padded) prompt tokens prefilled in one engine step; longer "
        "prompts are prefilled in chunks while running sequences keep decoding.",
    )
    gpu_memory_fraction: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="Share of the GPU's memory the server may use (weights, a second "
        "copy for weight updates unless --swap-in-place, activations and the KV cache); "
        "CUDA only.",
    )
    swap_drain_timeout: float = Field(
        30.0,
        ge=0.0,
        description="Seconds a weight update lets running sequences finish on the "
        "old weights before restarting them on the new ones.",
    )
    swap_in_place: bool = Field(
        False,
        description="/update_weights copies the new safetensors weights tensor by tensor "
        "into the served model's tensors between decode steps instead of loading a second "
        "model: no second copy of the weights on the device (one tensor of extra host "
        "memory), but the copy itself pauses decoding.",
    )
    max_n: int = Field(128, ge=1, description="Largest 'n' (completions per request) accepted.")
    max_request_mb: float = Field(
        64.0,
        gt=0.0,
        description="Largest request body in MiB (413 above it): a body is held in memory "
        "whole, and parsed JSON takes several times its size.",
    )
    body_timeout: float = Field(
        30.0,
        ge=0.0,
        description="Seconds a request body may go without receiving a byte before it is "
        "dropped with 408; 0 never.",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads on CPU; default 1 for models under "
        "100M parameters (threading overhead dominates), else torch's "
        "default.",
    )
    seed: int = Field(0, description="Seed of the global sampler (requests may pass their own).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of the server."
    )
