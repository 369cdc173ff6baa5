"""``atropos-sft-gen FILEPATH``: collect the best rollouts of each group as an SFT dataset.

Acts as the trainer against a running ``run-api`` (register, poll ``/batch``),
or reads a ``process`` rollouts jsonl with ``--from-file``. Per group: sort by
score, drop scores <= 0 unless ``--allow-negative-scores``, keep those more than
``--minimum-score-diff-max-min`` above the group minimum (when > 0), keep the top
``--save-top-n-per-group``. ``--format trl`` writes ``{"messages"}`` /
``{"prompt","completion"}`` lines that TRL's ``SFTTrainer`` loads as is.

Unlike the original, the API is only wiped with ``--reset-api``.

Example::

    atropos-sft-gen sft.jsonl --from-file data/gsm8k.jsonl --save-messages --format trl --dedupe
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Any

from atroposlib.frontend.api_client import DEFAULT_API_URL
from atroposlib.frontend.dataset_gen import add_common_arguments, main_with, run_generation
from atroposlib.frontend.export import GroupView, select_sft, sft_records
from atroposlib.frontend.trainer_helpers import (
    check_for_batch,
    find_common_prefix,
    grabber_argv,
    sft_group_records,
)
from atroposlib.frontend.trainer_helpers import register_to_api as _register

__all__ = [
    "build_parser",
    "check_for_batch",
    "find_common_prefix",
    "grab_group_data",
    "main",
    "register_to_api",
    "sft_data_grabber",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-sft-gen`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="atropos-sft-gen",
        description="Grab rollouts from the Atropos API (or a process jsonl) and save an SFT dataset.",
    )
    add_common_arguments(parser, min_diff_default=0.0)
    parser.add_argument(
        "--save-top-n-per-group",
        type=int,
        default=3,
        help="keep at most this many rollouts per group (default 3)",
    )
    parser.add_argument(
        "--tasks-per-step",
        type=int,
        default=64,
        help="groups per batch when registering (batch_size = group_size * tasks_per_step)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    def records_for(
        view: GroupView, use_messages: bool, rng: random.Random
    ) -> list[dict[str, Any]]:
        keep = select_sft(
            view.scores,
            args.save_top_n_per_group,
            args.allow_negative_scores,
            args.minimum_score_diff_max_min,
        )
        return sft_records(view, keep, use_messages, args.format)

    return run_generation(
        args,
        records_for,
        batch_size=args.group_size * args.tasks_per_step,
        num_steps=args.num_seqs_to_save,
    )


async def register_to_api(
    group_size: int,
    max_token_len: int,
    api_url: str = DEFAULT_API_URL,
    num_steps: int = 100,
    tasks_per_step: int = 64,
) -> dict[str, Any]:
    """Register as a trainer taking ``group_size * tasks_per_step`` sequences a batch."""
    return await _register(group_size, max_token_len, api_url, num_steps, tasks_per_step)


def grab_group_data(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_top_n_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
) -> list[dict[str, Any]]:
    """The SFT lines of one group: its best rollouts (see the module doc)."""
    return sft_group_records(
        tok,
        datagroup,
        save_messages,
        save_top_n_per_group,
        allow_negative_scores,
        minimum_score_diff_max_min,
    )


async def sft_data_grabber(
    filepath: str,
    api_url: str,
    group_size: int,
    max_token_len: int,
    tokenizer: Any,
    save_messages: bool,
    save_top_n_per_group: int,
    num_seqs_to_save: int,
    allow_negative_scores: bool,
    minimum_score_diff_max_min: float,
    append_to_previous: bool,
    tasks_per_step: int,
) -> int:
    """Run ``atropos-sft-gen`` with these settings (``tokenizer``: a name or a loaded
    tokenizer); returns its exit code."""
    argv = grabber_argv(
        filepath,
        api_url,
        group_size,
        max_token_len,
        tokenizer,
        save_messages,
        num_seqs_to_save,
        allow_negative_scores,
        minimum_score_diff_max_min,
        append_to_previous,
    )
    argv += [
        "--save-top-n-per-group",
        str(save_top_n_per_group),
        "--tasks-per-step",
        str(tasks_per_step),
    ]
    return await asyncio.to_thread(main, argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``atropos-sft-gen``."""
    return main_with(build_parser(), argv, _run)


if __name__ == "__main__":
    sys.exit(main())
