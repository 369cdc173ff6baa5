"""Kebab-case command line for :class:`~example_trainer.config.TrainingConfig`.

The flags come from the config model through :mod:`atroposlib.utils.settings_cli` (the
one way every command of this project turns a config into a command line): every field
is a flag (``gradient_accumulation_steps`` -> ``--gradient-accumulation-steps``) and its
``description``, with its default, is the help text. Switches take an optional value
(``--use-wandb``, ``--use-wandb false``) and lists several values after one flag
(``--train-layer-indices 0 1``). Unknown flags and invalid values end the program with a
one-line message naming the flag and exit status 2 (argparse's convention), never a
traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable, Sequence

from atroposlib.utils.settings_cli import add_fields, validate

from .config import TrainingConfig


def build_parser(prog: str = "atropos-grpo") -> argparse.ArgumentParser:
    """Return the argparse parser with one flag per ``TrainingConfig`` field."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} --model-name MODEL [options]  (see --help)",
        description="GRPO trainer for Atropos: pulls scored batches from run-api and trains the policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add_training_fields(parser)
    return parser


def add_training_fields(parser: Any, names: Iterable[str] | None = None) -> None:
    """Add the flags of ``TrainingConfig``'s fields (all, or ``names``) to ``parser`` or an
    argument group; each is absent unless given, so the config's default applies."""
    add_fields(parser, TrainingConfig, names, bools="value", lists="nargs")


def config_from_args(
    args: Sequence[str] | argparse.Namespace | None = None, prog: str = "atropos-grpo"
) -> TrainingConfig:
    """Parse ``args`` (default ``sys.argv[1:]``) into a validated ``TrainingConfig``; an
    ``argparse.Namespace`` (the original's :func:`parse_args`) is taken as parsed.

    Exits with status 2 and a clear message on unknown flags, missing
    ``--model-name`` or values the config rejects.
    """
    if isinstance(args, argparse.Namespace):
        names = TrainingConfig.model_fields
        values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    else:
        parser = build_parser(prog)
        values = vars(parser.parse_args(list(sys.argv[1:] if args is None else args)))
    return validate(TrainingConfig, values, prog=prog)


# The original's parser builders (argument groups, parse_args); see original_cli.
from .original_cli import (  # noqa: E402
    add_atropos_args,
    add_debug_args,
    add_distributed_args,
    add_grpo_args,
    add_lora_args,
    add_mode_args,
    add_model_args,
    add_training_args,
    add_vllm_args,
    add_wandb_args,
    create_base_parser,
    create_full_parser,
    create_unified_parser,
    parse_args,
)

__all__ = [
    "add_atropos_args",
    "add_debug_args",
    "add_distributed_args",
    "add_grpo_args",
    "add_lora_args",
    "add_mode_args",
    "add_model_args",
    "add_training_args",
    "add_training_fields",
    "add_vllm_args",
    "add_wandb_args",
    "build_parser",
    "config_from_args",
    "create_base_parser",
    "create_full_parser",
    "create_unified_parser",
    "parse_args",
]
