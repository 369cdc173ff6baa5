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
import sys
from typing import Any

from atroposlib.frontend import generators
from atroposlib.frontend.api_client import DEFAULT_API_URL
from atroposlib.frontend.export import Selection
from atroposlib.frontend.generators import SFT
from atroposlib.frontend.trainer_helpers import check_for_batch as check_for_batch
from atroposlib.frontend.trainer_helpers import find_common_prefix as find_common_prefix
from atroposlib.frontend.trainer_helpers import group_records, register_trainer


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-sft-gen`` argument parser."""
    return generators.build_parser(SFT)


async def register_to_api(
    group_size: int,
    max_token_len: int,
    api_url: str = DEFAULT_API_URL,
    num_steps: int = 100,
    tasks_per_step: int = 64,
) -> dict[str, Any]:
    """Register as a trainer taking ``group_size * tasks_per_step`` sequences a batch."""
    return await register_trainer(api_url, group_size * tasks_per_step, max_token_len, num_steps)


def grab_group_data(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_top_n_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
) -> list[dict[str, Any]]:
    """The SFT lines of one group: its best rollouts (see the module doc)."""
    rule = Selection("sft", save_top_n_per_group, allow_negative_scores, minimum_score_diff_max_min)
    return group_records(tok, datagroup, save_messages, rule)


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
    # The parameters are named after the command's options, so they are its settings as is.
    return await generators.run_with_options(SFT, dict(locals()))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``atropos-sft-gen``."""
    return generators.main(SFT, argv)


if __name__ == "__main__":
    sys.exit(main())
