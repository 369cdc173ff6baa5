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
import sys
from typing import Any

from atroposlib.frontend import generators
from atroposlib.frontend.api_client import DEFAULT_API_URL
from atroposlib.frontend.export import Selection
from atroposlib.frontend.generators import DPO
from atroposlib.frontend.trainer_helpers import check_for_batch as check_for_batch
from atroposlib.frontend.trainer_helpers import find_common_prefix as find_common_prefix
from atroposlib.frontend.trainer_helpers import group_records, register_trainer


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-dpo-gen`` argument parser."""
    return generators.build_parser(DPO)


async def register_to_api(
    group_size: int, max_token_len: int, api_url: str = DEFAULT_API_URL, num_steps: int = 200
) -> dict[str, Any]:
    """Register as a trainer taking ``group_size * 8`` sequences a batch."""
    return await register_trainer(api_url, group_size * 8, max_token_len, num_steps)


def grab_group_data(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_n_pairs_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
) -> list[dict[str, Any]]:
    """The DPO pairs of one group (see the module doc)."""
    rule = Selection(
        "dpo", save_n_pairs_per_group, allow_negative_scores, minimum_score_diff_max_min
    )
    return group_records(tok, datagroup, save_messages, rule)


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
    # The parameters are named after the command's options, so they are its settings as is.
    return await generators.run_with_options(DPO, dict(locals()))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``atropos-dpo-gen``."""
    return generators.main(DPO, argv)


if __name__ == "__main__":
    sys.exit(main())
