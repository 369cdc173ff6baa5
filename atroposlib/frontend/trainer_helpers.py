"""The original's module-level helpers of the dataset and viewer tools, on our machinery.

``atroposlib.cli.sft``, ``dpo``, ``view_run`` and ``view_run_multimodal`` expose these under the
original's names and signatures, so scripts that imported them keep working:
``register_to_api`` registers as a trainer, ``check_for_batch`` waits for the next batch,
``grab_group_data`` turns one group into output lines, ``find_common_prefix`` splits a group's
texts. The command lines themselves are in those modules.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, List, Sequence

import httpx

from atroposlib.frontend.api_client import DEFAULT_API_URL
from atroposlib.frontend.export import (
    OutputFormat,
    dpo_records,
    group_view,
    pair_dpo,
    select_sft,
    sft_records,
)
from atroposlib.frontend.rollouts import longest_common_prefix
from atroposlib.utils.io import auth_headers

__all__ = [
    "check_for_batch",
    "dpo_group_records",
    "find_common_prefix",
    "register_to_api",
    "sft_group_records",
]

POLL_INTERVAL_S = 1.0


def find_common_prefix(strings: Sequence[str]) -> str:
    """The longest prefix every string of ``strings`` shares ("" for none or no strings)."""
    strings = list(strings)
    if not strings:
        return ""
    return longest_common_prefix(strings)


async def register_to_api(
    group_size: int,
    max_token_len: int,
    api_url: str = DEFAULT_API_URL,
    num_steps: int = 69,
    tasks_per_step: int = 8,
) -> dict[str, Any]:
    """``POST /register`` as a trainer taking batches of ``group_size * tasks_per_step``
    sequences; returns the API's answer. Raises ``httpx.HTTPStatusError`` on a refusal."""
    body = {
        "wandb_group": "test",
        "wandb_project": "test",
        "batch_size": group_size * tasks_per_step,
        "max_token_len": max_token_len,
        "checkpoint_dir": "checkpoints",
        "save_checkpoint_interval": 10,
        "starting_step": 0,
        "num_steps": num_steps,
    }
    async with httpx.AsyncClient(timeout=10.0, headers=auth_headers()) as client:
        response = await client.post(f"{api_url.rstrip('/')}/register", json=body)
        response.raise_for_status()
        return response.json()


async def check_for_batch(
    api_url: str = DEFAULT_API_URL, poll_interval: float = POLL_INTERVAL_S
) -> List[dict[str, Any]]:
    """Poll ``GET /batch`` until a batch is ready and return its groups (acknowledging the
    batch with the next call, as a trainer does)."""
    url = f"{api_url.rstrip('/')}/batch"
    async with httpx.AsyncClient(timeout=30.0, headers=auth_headers()) as client:
        while True:
            response = await client.get(url)
            response.raise_for_status()
            batch = response.json().get("batch")
            if batch:
                return batch
            await asyncio.sleep(poll_interval)


def _decoded(tok: Any, datagroup: dict[str, Any], save_messages: bool) -> List[str] | None:
    if save_messages and datagroup.get("messages") is not None:
        return None
    return [tok.decode(seq) for seq in datagroup.get("tokens") or []]


def sft_group_records(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_top_n_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
    fmt: OutputFormat = "atropos",
) -> List[dict[str, Any]]:
    """The SFT lines of one group (see ``atropos-sft-gen``)."""
    view = group_view(datagroup, _decoded(tok, datagroup, save_messages))
    keep = select_sft(
        view.scores, save_top_n_per_group, allow_negative_scores, minimum_score_diff_max_min
    )
    use_messages = save_messages and view.messages is not None
    return sft_records(view, keep, use_messages, fmt)


def dpo_group_records(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    save_n_pairs_per_group: int,
    allow_negative_scores: bool = False,
    minimum_score_diff_max_min: float = 0.0,
    fmt: OutputFormat = "atropos",
    rng: random.Random | None = None,
) -> List[dict[str, Any]]:
    """The DPO pairs of one group (see ``atropos-dpo-gen``)."""
    view = group_view(datagroup, _decoded(tok, datagroup, save_messages))
    pairs = pair_dpo(
        view.scores,
        save_n_pairs_per_group,
        allow_negative_scores,
        minimum_score_diff_max_min,
        rng or random.Random(),
    )
    use_messages = save_messages and view.messages is not None
    return dpo_records(view, pairs, use_messages, fmt)


def grabber_argv(
    filepath: str,
    api_url: str,
    group_size: int,
    max_token_len: int,
    tokenizer: Any,
    save_messages: bool,
    num_seqs_to_save: int,
    allow_negative_scores: bool,
    minimum_score_diff_max_min: float,
    append_to_previous: bool,
) -> list[str]:
    """The command line of ``atropos-sft-gen`` / ``atropos-dpo-gen`` that the original's
    ``*_data_grabber`` functions stand for."""
    argv = [
        str(filepath),
        "--api-url",
        api_url,
        "--group-size",
        str(group_size),
        "--max-token-len",
        str(max_token_len),
        "--tokenizer",
        tokenizer if isinstance(tokenizer, str) else tokenizer.name_or_path,
        "--num-seqs-to-save",
        str(num_seqs_to_save),
        "--minimum-score-diff-max-min",
        str(minimum_score_diff_max_min),
        "--no-progress",
    ]
    if save_messages:
        argv.append("--save-messages")
    if allow_negative_scores:
        argv.append("--allow-negative-scores")
    if append_to_previous:
        argv.append("--append-to-previous")
    return argv
