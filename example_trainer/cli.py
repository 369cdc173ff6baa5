"""Kebab-case command line for :class:`~example_trainer.config.TrainingConfig`.

The parser is generated from the config model, so every field is a flag
(``gradient_accumulation_steps`` → ``--gradient-accumulation-steps``) and its
``description`` is the help text. Unknown flags and invalid values end the
program with a one-line message naming the flag and exit status 2 (argparse's
convention), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any, Sequence

from pydantic import ValidationError

from .config import TrainingConfig


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "y", "on"):
        return True
    if low in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (
        typing.Union,
        getattr(__import__("types"), "UnionType", None),
    ):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def build_parser(prog: str = "atropos-grpo") -> argparse.ArgumentParser:
    """Return the argparse parser with one flag per ``TrainingConfig`` field."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} --model-name MODEL [options]  (see --help)",
        description="GRPO trainer for Atropos: pulls scored batches from run-api and trains the policy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for name in TrainingConfig.model_fields:
        _add_field(parser, name)
    return parser


def _add_field(parser: Any, name: str) -> None:
    """Add the flag of ``TrainingConfig`` field ``name`` to ``parser`` (or an argument
    group); absent unless given (``argparse.SUPPRESS``), so the config's default applies."""
    field = TrainingConfig.model_fields[name]
    ann = _unwrap_optional(field.annotation)
    origin = typing.get_origin(ann)
    help_text = field.description or name
    kwargs: dict[str, Any] = {"dest": name, "help": help_text, "default": argparse.SUPPRESS}
    if name == "model_name":
        kwargs["help"] = help_text + " (required)"
    if ann is bool:
        # `--use-wandb` alone means true; `--use-wandb false` is accepted too.
        kwargs.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
    elif origin in (list, typing.List):
        (item,) = typing.get_args(ann) or (str,)
        kwargs.update(nargs="+", type=item)
    elif origin is typing.Literal:
        kwargs.update(choices=list(typing.get_args(ann)))
    elif ann in (int, float, str):
        kwargs["type"] = ann
    parser.add_argument(_flag(name), **kwargs)


def _field_of(loc: Sequence[Any]) -> str:
    return _flag(str(loc[0])) if loc else "config"


def config_from_args(
    args: Sequence[str] | argparse.Namespace | None = None, prog: str = "atropos-grpo"
) -> TrainingConfig:
    """Parse ``args`` (default ``sys.argv[1:]``) into a validated ``TrainingConfig``; an
    ``argparse.Namespace`` (the original's :func:`parse_args`) is taken as parsed.

    Exits with status 2 and a clear message on unknown flags, missing
    ``--model-name`` or values the config rejects.
    """
    parser = build_parser(prog)
    if isinstance(args, argparse.Namespace):
        names = TrainingConfig.model_fields
        values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    else:
        values = vars(parser.parse_args(list(sys.argv[1:] if args is None else args)))
    if "model_name" not in values:
        parser.error("the following arguments are required: --model-name")
    try:
        return TrainingConfig(**values)
    except ValidationError as exc:
        # One line, no usage block: the flags parsed, a value is wrong.
        messages = [
            f"{_field_of(err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        ]
        print(f"{prog}: error: invalid value: " + "; ".join(messages), file=sys.stderr)
        sys.exit(2)


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
    "add_vllm_args",
    "add_wandb_args",
    "build_parser",
    "config_from_args",
    "create_base_parser",
    "create_full_parser",
    "create_unified_parser",
    "parse_args",
]
