"""The original trainer's parser builders: argument groups by topic, the full parser and
``parse_args``. Every flag is the one :func:`example_trainer.cli.build_parser` makes for the
same ``TrainingConfig`` field (kebab-case, the field's description as help), grouped as the
original grouped them; :mod:`example_trainer.cli` re-exports these functions.

Example::

    parser = create_base_parser("my trainer")
    add_model_args(parser)
    add_training_args(parser)
    config = config_from_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
from typing import Sequence

from .config import TrainingConfig

GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model_name", "dtype", "device"),
    "training": (
        "lr",
        "training_steps",
        "batch_size",
        "seq_len",
        "gradient_accumulation_steps",
        "warmup_steps",
        "optimizer",
        "adafactor_scale_parameter",
        "adafactor_relative_step",
        "save_path",
        "checkpoint_interval",
    ),
    "grpo": ("clip_eps",),
    "vllm": (
        "vllm_restart_interval",
        "vllm_port",
        "vllm_gpu",
        "vllm_gpu_memory_utilization",
        "max_model_len",
        "vllm_config_path",
    ),
    "atropos": ("atropos_url",),
    "wandb": ("use_wandb", "wandb_project", "wandb_group"),
    "mode": ("weight_bridge_mode", "train_layer_indices", "single_copy"),
    "lora": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_layer_indices"),
    "distributed": ("trainer_rank", "world_size", "init_method", "num_inference_nodes"),
    "debug": ("debug_loading", "benchmark"),
}
"""Fields per argument group, as the original grouped its flags."""


def _add_group(parser: argparse.ArgumentParser, topic: str, title: str) -> None:
    from .cli import add_training_fields

    group = parser.add_argument_group(title)
    add_training_fields(group, [n for n in GROUPS[topic] if n in TrainingConfig.model_fields])


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model-name``, ``--dtype``, ``--device``."""
    _add_group(parser, "model", "model")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Learning rate, steps, batch and sequence sizes, optimizer, checkpoints."""
    _add_group(parser, "training", "training")


def add_grpo_args(parser: argparse.ArgumentParser) -> None:
    """``--clip-eps``."""
    _add_group(parser, "grpo", "GRPO")


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The inference server the trainer starts: port, GPU, memory, length, restarts."""
    _add_group(parser, "vllm", "inference server")


def add_atropos_args(parser: argparse.ArgumentParser) -> None:
    """``--atropos-url``."""
    _add_group(parser, "atropos", "rollout API")


def add_wandb_args(parser: argparse.ArgumentParser) -> None:
    """``--use-wandb``, ``--wandb-project``, ``--wandb-group``."""
    _add_group(parser, "wandb", "Weights & Biases")


def add_mode_args(parser: argparse.ArgumentParser) -> None:
    """``--weight-bridge-mode``, ``--train-layer-indices``, ``--single-copy``."""
    _add_group(parser, "mode", "weight bridge")


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA rank, alpha, dropout, target modules and layers."""
    _add_group(parser, "lora", "LoRA")


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Rank, world size, init method, inference nodes."""
    _add_group(parser, "distributed", "distributed")


def add_debug_args(parser: argparse.ArgumentParser) -> None:
    """``--debug-loading``, ``--benchmark``."""
    _add_group(parser, "debug", "debugging")


def create_base_parser(description: str) -> argparse.ArgumentParser:
    """An empty parser with the trainer's conventions (defaults in the help, no prefix
    abbreviations)."""
    return argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )


def create_full_parser() -> argparse.ArgumentParser:
    """Every group, then every other ``TrainingConfig`` field (this trainer's additions)."""
    from .cli import add_training_fields

    parser = create_base_parser("GRPO trainer for Atropos.")
    for add in (
        add_model_args,
        add_training_args,
        add_grpo_args,
        add_vllm_args,
        add_atropos_args,
        add_wandb_args,
        add_mode_args,
        add_lora_args,
        add_distributed_args,
        add_debug_args,
    ):
        add(parser)
    grouped = {name for names in GROUPS.values() for name in names}
    others = parser.add_argument_group("other options")
    add_training_fields(others, [n for n in TrainingConfig.model_fields if n not in grouped])
    return parser


def create_unified_parser() -> argparse.ArgumentParser:
    """The parser of the one-command entry point: the full parser (the launcher's own
    options are ``atropos-grpo-run``'s)."""
    return create_full_parser()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with :func:`create_full_parser`; pass the
    result to ``config_from_args``."""
    return create_full_parser().parse_args(None if argv is None else list(argv))
