"""``atropos-dpo-gen FILEPATH``: pair good and bad rollouts of each group as a DPO dataset.

Acts as the trainer against a running ``run-api`` (register, poll ``/batch``),
or reads a ``process`` rollouts jsonl with ``--from-file``. Pairing (docs/design.md, "Export tools"):
positives by score descending (scores <= 0 dropped unless
``--allow-negative-scores``); the negative pool is the ``--save-n-pairs-per-group``
lowest-scoring rollouts; each top positive takes a random negative scoring below
``positive - --minimum-score-diff-max-min``. ``--format trl`` writes
``{"prompt","chosen","rejected"}`` lines that TRL's ``DPOTrainer`` loads as is
(conversational with ``--save-messages``).

Unlike the original, the API is only wiped with ``--reset-api``.

Example::

    atropos-dpo-gen dpo.jsonl --from-file data/gsm8k.jsonl --save-messages --format trl --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Any

from atroposlib.frontend.api_client import DEFAULT_API_URL
from atroposlib.frontend.dataset_gen import add_common_arguments, main_with, run_generation
from atroposlib.frontend.export import GroupView, dpo_records, pair_dpo
from atroposlib.frontend.trainer_helpers import (
    check_for_batch,
    dpo_group_records,
    find_common_prefix,
    grabber_argv,
)
from atroposlib.frontend.trainer_helpers import register_to_api as _register

__all__ = [
    "build_parser",
    "check_for_batch",
    "dpo_data_grabber",
    "find_common_prefix",
    "grab_group_data",
    "main",
    "register_to_api",
]


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-dpo-gen`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="atropos-dpo-gen",
        description="Grab rollouts from the Atropos API (or a process jsonl) and save DPO preference pairs.",
    )
    add_common_arguments(parser, min_diff_default=0.5)
    parser.add_argument(
        "--save-n-pairs-per-group",
        type=int,
        default=3,
        help="at most this many pairs per group (default 3)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    def records_for(
        view: GroupView, use_messages: bool, rng: random.Random
    ) -> list[dict[str, Any]]:
        pairs = pair_dpo(
            view.scores,
            args.save_n_pairs_per_group,
            args.allow_negative_scores,
            args.minimum_score_diff_max_min,
            rng,
        )
        return dpo_records(view, pairs, use_messages, args.format)

    return run_generation(
        args, records_for, batch_size=args.group_size * 8, num_steps=args.num_seqs_to_save * 2
    )


async def register_to_api(
    group_size: int, max_token_len: int, api_url: str = DEFAULT_API_URL, num_steps: int = 200
) -> dict[str, Any]:
    """Register as a trainer taking ``group_size * 8`` sequences a batch."""
    return await _register(group_size, max_token_len, api_url, num_steps, 8)


def grab_group_data(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_n_pairs_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
) -> list[dict[str, Any]]:
    """The DPO pairs of one group (see the module doc)."""
    return dpo_group_records(
        tok,
        datagroup,
        save_messages,
        save_n_pairs_per_group,
        allow_negative_scores,
        minimum_score_diff_max_min,
    )


async def dpo_data_grabber(
    filepath: str,
    api_url: str,
    group_size: int,
    max_token_len: int,
    tokenizer: Any,
    save_messages: bool,
    save_n_pairs_per_group: int,
    num_seqs_to_save: int,
    allow_negative_scores: bool,
    minimum_score_diff_max_min: float,
    append_to_previous: bool,
) -> int:
    """Run ``atropos-dpo-gen`` with these settings (``tokenizer``: a name or a loaded
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
    argv += ["--save-n-pairs-per-group", str(save_n_pairs_per_group)]
    return await asyncio.to_thread(main, argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``atropos-dpo-gen``."""
    return main_with(build_parser(), argv, _run)


if __name__ == "__main__":
    sys.exit(main())
