"""Kebab-case command line for :class:`~example_trainer.config.TrainingConfig`.

The flags come from the config model through :mod:`atroposlib.utils.settings_cli` (the
one way every command of this project turns a config into a command line): every field
is a flag (``gradient_accumulation_steps`` -> ``--gradient-accumulation-steps``) and its
``description``, with its default, is the help text. The flags stand in one argument group
per topic of :mod:`example_trainer.config_groups` (the original's ``add_model_args``,
``add_training_args``, ... each add one group, so a field is listed in one place only: the
topic that declares it). Switches take an optional value (``--use-wandb``,
``--use-wandb false``) and lists several values after one flag
(``--train-layer-indices 0 1``). Unknown flags and invalid values end the program with a
one-line message naming the flag and exit status 2 (argparse's convention), never a
traceback.

Example (the original's parser builders)::

    parser = create_base_parser("my trainer")
    add_model_args(parser)
    add_training_args(parser)
    config = config_from_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable, Sequence

from pydantic import BaseModel

from atroposlib.utils.settings_cli import add_fields, validate

from .config import TrainingConfig
from .config_groups import (
    GROUPS,
    ApiOptions,
    DebugOptions,
    DistributedOptions,
    GrpoOptions,
    InferenceOptions,
    LoggingOptions,
    LoraOptions,
    ModelOptions,
    ModeOptions,
    TrainingOptions,
)

DESCRIPTION = "GRPO trainer for Atropos: pulls scored batches from run-api and trains the policy."


def create_base_parser(description: str) -> argparse.ArgumentParser:
    """An empty parser with the trainer's conventions (defaults in the help, no prefix
    abbreviations)."""
    return argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )


def build_parser(prog: str = "atropos-grpo") -> argparse.ArgumentParser:
    """Return the argparse parser with one flag per ``TrainingConfig`` field, grouped by topic."""
    parser = create_base_parser(DESCRIPTION)
    parser.prog = prog
    parser.usage = f"{prog} --model-name MODEL [options]  (see --help)"
    for options in GROUPS:
        _add_group(parser, options)
    return parser


def add_training_fields(parser: Any, names: Iterable[str] | None = None) -> None:
    """Add the flags of ``TrainingConfig``'s fields (all, or ``names``) to ``parser`` or an
    argument group; each is absent unless given, so the config's default applies."""
    add_fields(parser, TrainingConfig, names, bools="value", lists="nargs")


def _add_group(parser: argparse.ArgumentParser, options: type[BaseModel]) -> None:
    group = parser.add_argument_group(options.cli_title)
    add_training_fields(group, list(options.model_fields))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model: ``--model-name``, ``--dtype``, ``--precision``, ``--device``, ..."""
    _add_group(parser, ModelOptions)


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Learning rate, steps, batch and sequence sizes, optimizer, checkpoints."""
    _add_group(parser, TrainingOptions)


def add_grpo_args(parser: argparse.ArgumentParser) -> None:
    """The loss: ``--clip-eps`` and the other clipping, KL, off-policy and aggregation flags."""
    _add_group(parser, GrpoOptions)


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The inference server the trainer starts or reaches: port, GPU, memory, length, URLs."""
    _add_group(parser, InferenceOptions)


def add_atropos_args(parser: argparse.ArgumentParser) -> None:
    """``--atropos-url`` and how batches are polled."""
    _add_group(parser, ApiOptions)


def add_wandb_args(parser: argparse.ArgumentParser) -> None:
    """``--use-wandb``, ``--wandb-project``, ``--wandb-group``, ``--log-dir``, ``--progress``."""
    _add_group(parser, LoggingOptions)


def add_mode_args(parser: argparse.ArgumentParser) -> None:
    """``--weight-bridge-mode``, ``--train-layer-indices``, ``--single-copy``."""
    _add_group(parser, ModeOptions)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA rank, alpha, dropout, target modules and layers."""
    _add_group(parser, LoraOptions)


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Rank, world size, init method, nodes and rendezvous, inference nodes."""
    _add_group(parser, DistributedOptions)


def add_debug_args(parser: argparse.ArgumentParser) -> None:
    """``--debug-loading``, ``--benchmark``."""
    _add_group(parser, DebugOptions)


def create_full_parser() -> argparse.ArgumentParser:
    """Every group: one flag per ``TrainingConfig`` field."""
    parser = create_base_parser("GRPO trainer for Atropos.")
    for options in GROUPS:
        _add_group(parser, options)
    return parser


def create_unified_parser() -> argparse.ArgumentParser:
    """The parser of the one-command entry point: the full parser (the launcher's own
    options are ``atropos-grpo-run``'s)."""
    return create_full_parser()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with :func:`create_full_parser`; pass the
    result to :func:`config_from_args`."""
    return create_full_parser().parse_args(None if argv is None else list(argv))


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
