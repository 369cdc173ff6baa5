"""The command line of ``atropos-sft-gen`` and ``atropos-dpo-gen``: one parser, two rules.

The two tools share every option but their per-group limit (and SFT's ``--tasks-per-step``);
what sets one apart is written once as a :class:`GeneratorSpec` (:data:`SFT`, :data:`DPO`).
The run itself is :func:`atroposlib.frontend.dataset_gen.run_generation`.

Example::

    from atroposlib.frontend.generators import SFT, main
    main(SFT, ["sft.jsonl", "--from-file", "rollouts.jsonl", "--save-messages"])
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from atroposlib.frontend.api_client import add_trainer_arguments
from atroposlib.frontend.dataset_gen import DEFAULT_TOKENIZER, run_generation
from atroposlib.frontend.export import FORMATS, ExportKind, Selection

__all__ = [
    "DPO",
    "SFT",
    "GeneratorSpec",
    "build_parser",
    "main",
    "options_argv",
    "run",
    "run_with_options",
]


@dataclass(frozen=True)
class GeneratorSpec:
    """What sets one dataset generator apart from the other."""

    prog: str
    description: str
    kind: ExportKind
    #: The per-group limit's argparse destination (its flag is ``--`` + dashes) and help.
    count_dest: str
    count_help: str
    #: ``--minimum-score-diff-max-min``'s default: the original tools' (SFT 0.0, DPO 0.5).
    min_diff_default: float
    #: Groups per registered batch; None: the ``--tasks-per-step`` flag (default 64) sets it.
    tasks_per_step: int | None
    #: Registered ``num_steps`` per line asked for (the original DPO tool asked for twice as many).
    steps_per_line: int


SFT = GeneratorSpec(
    prog="atropos-sft-gen",
    description="Grab rollouts from the Atropos API (or a process jsonl) and save an SFT dataset.",
    kind="sft",
    count_dest="save_top_n_per_group",
    count_help="keep at most this many rollouts per group (default 3)",
    min_diff_default=0.0,
    tasks_per_step=None,
    steps_per_line=1,
)
DPO = GeneratorSpec(
    prog="atropos-dpo-gen",
    description="Grab rollouts from the Atropos API (or a process jsonl) and save DPO preference pairs.",
    kind="dpo",
    count_dest="save_n_pairs_per_group",
    count_help="at most this many pairs per group (default 3)",
    min_diff_default=0.5,
    tasks_per_step=8,
    steps_per_line=2,
)


def build_parser(spec: GeneratorSpec) -> argparse.ArgumentParser:
    """The argument parser of ``spec``'s command (the original's names and defaults, plus
    additions)."""
    parser = argparse.ArgumentParser(prog=spec.prog, description=spec.description)
    parser.add_argument("filepath", help="output jsonl file")
    add_trainer_arguments(
        parser,
        group_size_help="group size used to size the batch (default 2)",
        tokenizer_default=DEFAULT_TOKENIZER,
        tokenizer_help="tokenizer name or local directory used to decode tokens",
    )
    parser.add_argument(
        "--save-messages",
        action="store_true",
        help="save the groups' chat messages instead of decoded prefix/completion text",
    )
    parser.add_argument(
        "--num-seqs-to-save", type=int, default=100, help="stop after this many lines (default 100)"
    )
    parser.add_argument(
        "--allow-negative-scores", action="store_true", help="keep rollouts with score <= 0"
    )
    parser.add_argument(
        "--minimum-score-diff-max-min",
        type=float,
        default=spec.min_diff_default,
        help="minimum score gap (default %(default)s)",
    )
    parser.add_argument(
        "--append-to-previous", action="store_true", help="append to an existing output file"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="atropos",
        help="'atropos': the original line format; 'trl': columns TRL's trainers load as is",
    )
    parser.add_argument(
        "--dedupe",
        action="store_true",
        help="skip lines identical to one already written (including earlier runs when appending)",
    )
    parser.add_argument(
        "--from-file",
        metavar="JSONL",
        default=None,
        help="build the dataset from a `process` rollouts jsonl instead of the live API",
    )
    parser.add_argument(
        "--poll-interval", type=float, default=1.0, help="seconds between /batch polls"
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (DPO negative choice)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(_flag(spec.count_dest), type=int, default=3, help=spec.count_help)
    if spec.tasks_per_step is None:
        parser.add_argument(
            "--tasks-per-step",
            type=int,
            default=64,
            help="groups per batch when registering (batch_size = group_size * tasks_per_step)",
        )
    return parser


def run(spec: GeneratorSpec, args: argparse.Namespace) -> int:
    """Run ``spec``'s command with parsed ``args``; return its exit code."""
    selection = Selection(
        spec.kind,
        getattr(args, spec.count_dest),
        args.allow_negative_scores,
        args.minimum_score_diff_max_min,
        args.format,
    )
    tasks_per_step = args.tasks_per_step if spec.tasks_per_step is None else spec.tasks_per_step
    return run_generation(
        args,
        selection.records,
        batch_size=args.group_size * tasks_per_step,
        num_steps=args.num_seqs_to_save * spec.steps_per_line,
    )


def main(spec: GeneratorSpec, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run ``spec``'s command, with logging set up for a person at a
    terminal; return its exit code."""
    args = build_parser(spec).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    return run(spec, args)


def options_argv(spec: GeneratorSpec, options: Mapping[str, Any]) -> list[str]:
    """The command line (progress bar off) that sets ``options`` for ``spec``'s command.

    ``options`` maps the parser's destinations to values, the way the original's
    ``sft_data_grabber`` / ``dpo_data_grabber`` take their parameters: ``filepath`` is the
    output, ``tokenizer`` a name or a loaded tokenizer, a switch (``save_messages``, ...) is
    given when true, every other option as ``--name value``.
    """
    parser = build_parser(spec)
    rest = dict(options)
    tokenizer = rest.pop("tokenizer")
    argv = [
        str(rest.pop("filepath")),
        "--tokenizer",
        tokenizer if isinstance(tokenizer, str) else tokenizer.name_or_path,
        "--no-progress",
    ]
    for dest, value in rest.items():
        if parser.get_default(dest) is False:  # a store_true switch
            if value:
                argv.append(_flag(dest))
        else:
            argv += [_flag(dest), str(value)]
    return argv


async def run_with_options(spec: GeneratorSpec, options: Mapping[str, Any]) -> int:
    """Run ``spec``'s command with ``options`` (see :func:`options_argv`) in a worker
    thread; return its exit code."""
    return await asyncio.to_thread(main, spec, options_argv(spec, options))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
