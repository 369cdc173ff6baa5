"""The original's module-level helpers of the dataset and viewer tools, on our machinery.

``atroposlib.cli.sft``, ``dpo``, ``view_run`` and ``view_run_multimodal`` expose these under the
original's names and signatures, so scripts that imported them keep working: ``register_trainer``
registers as a trainer (their ``register_to_api``), ``check_for_batch`` waits for the next batch,
``group_records`` turns one group into output lines (their ``grab_group_data``),
``find_common_prefix`` splits a group's texts. The command lines themselves are in
``frontend.generators`` and ``cli.view_run``.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, List, Sequence

import httpx

from atroposlib.frontend.api_client import DEFAULT_API_URL, registration
from atroposlib.frontend.export import Selection, group_view
from atroposlib.frontend.rollouts import longest_common_prefix
from atroposlib.utils.io import auth_headers

__all__ = [
    "check_for_batch",
    "find_common_prefix",
    "group_records",
    "register_trainer",
]

POLL_INTERVAL_S = 1.0


def find_common_prefix(strings: Sequence[str]) -> str:
    """The longest prefix every string of ``strings`` shares ("" for none or no strings)."""
    strings = list(strings)
    if not strings:
        return ""
    return longest_common_prefix(strings)


async def register_trainer(
    api_url: str, batch_size: int, max_token_len: int, num_steps: int
) -> dict[str, Any]:
    """``POST /register`` as a trainer taking batches of ``batch_size`` sequences; returns the
    API's answer. Raises ``httpx.HTTPStatusError`` on a refusal."""
    body = registration(batch_size, max_token_len, num_steps)
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


def group_records(
    tok: Any,
    datagroup: dict[str, Any],
    save_messages: bool,
    selection: Selection,
    rng: random.Random | None = None,
) -> List[dict[str, Any]]:
    """The output lines of one group under ``selection`` (what the original's
    ``grab_group_data`` returns): the group's messages with ``save_messages`` when it has
    them, else its tokens decoded with ``tok``."""
    view = group_view(datagroup, _decoded(tok, datagroup, save_messages))
    use_messages = save_messages and view.messages is not None
    return selection.records(view, use_messages, rng or random.Random())
