"""A small synchronous client of the rollout API for the inspection and export tools.

The tools (``view-run``, ``atropos-sft-gen``, ``atropos-dpo-gen``) act as the
trainer: they register and then pull batches with ``GET /batch``, through
:class:`~atroposlib.http.trainer_client.TrainerAPIClient` (the trainer-side client
the example trainer and the tests' fake trainer use too). Every request has a
timeout, sends ``Authorization: Bearer $ATROPOS_API_KEY`` when that variable is
set, and failures become :class:`ApiError` with a message a person can act on
(never a raw traceback).

Example::

    client = TrainerClient("http://localhost:8000")
    client.check()
    client.register(batch_size=16, max_token_len=2048, num_steps=100)
    batch = client.wait_for_batch(timeout=60)
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any, Callable

import httpx

from atroposlib.http.trainer_client import RolloutAPIError, TrainerAPIClient, registration_body

logger = logging.getLogger(__name__)

DEFAULT_API_URL = "http://localhost:8000"


ApiError = RolloutAPIError
"""The rollout API could not be reached or answered something unusable."""


def registration(batch_size: int, max_token_len: int, num_steps: int) -> dict[str, Any]:
    """The ``POST /register`` body of a tool acting as the trainer; the W&B and checkpoint
    fields are the original tools' placeholders (a tool trains nothing)."""
    return registration_body(
        batch_size,
        max_token_len,
        num_steps,
        wandb_group="test",
        wandb_project="test",
        checkpoint_dir="checkpoints",
        save_checkpoint_interval=10,
    )


def add_trainer_arguments(
    parser: argparse.ArgumentParser,
    group_size_help: str,
    tokenizer_default: str | None,
    tokenizer_help: str,
) -> None:
    """The options of a tool that registers with the API as the trainer (``view-run``,
    ``atropos-sft-gen``, ``atropos-dpo-gen``): where the API is, how to register, how to
    decode tokens, and whether to wipe the API first."""
    parser.add_argument(
        "--api-url", default=DEFAULT_API_URL, help="rollout API URL (default %(default)s)"
    )
    parser.add_argument("--group-size", type=int, default=2, help=group_size_help)
    parser.add_argument(
        "--max-token-len",
        type=int,
        default=2048,
        help="max token length to register (default 2048)",
    )
    parser.add_argument("--tokenizer", default=tokenizer_default, help=tokenizer_help)
    parser.add_argument(
        "--reset-api",
        action="store_true",
        help="wipe the API (GET /reset_data) before registering; never done without this flag",
    )


class TrainerClient(TrainerAPIClient):
    """Talks to ``run-api`` as a trainer does: reset, register, poll ``/batch``."""

    def __init__(
        self,
        api_url: str = DEFAULT_API_URL,
        timeout: float = 10.0,
        client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            api_url,
            timeout=timeout,
            client=client or httpx.Client(timeout=timeout),
            hint="Is run-api running? Point to it with --api-url.",
            ack_pending=True,
        )

    @property
    def api_url(self) -> str:
        """The API's base URL."""
        return self.url

    def close(self) -> None:
        """Close the underlying HTTP connection pool."""
        assert self._client is not None
        self._client.close()

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check(self) -> None:
        """Raise ApiError unless the API answers ``GET /``."""
        self.send("GET", "/")

    def register(  # type: ignore[override]
        self, batch_size: int, max_token_len: int, num_steps: int
    ) -> dict[str, Any]:
        """``POST /register`` as a trainer; returns the API's answer (``{"uuid": ...}``)."""
        return super().register(registration(batch_size, max_token_len, num_steps))

    def wait_for_batch(
        self,
        poll_interval: float = 1.0,
        timeout: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, Any]] | None:
        """Poll ``/batch`` every ``poll_interval`` s until a batch arrives.

        Returns None when ``timeout`` seconds pass or ``should_stop()`` turns true.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.get_batch()
            if batch is not None:
                return batch
            if should_stop is not None and should_stop():
                return None
            if deadline is not None and time.monotonic() + poll_interval > deadline:
                return None
            time.sleep(poll_interval)

    def ensure_registered(
        self, batch_size: int, max_token_len: int, num_steps: int, reset: bool = False
    ) -> None:
        """Optionally reset, then register; warn when an earlier registration wins.

        The API keeps the first trainer's configuration until it is reset, so
        without ``reset`` the batch size may differ from the one asked for.
        """
        if reset:
            logger.warning("resetting the rollout API at %s (--reset-api)", self.api_url)
            self.reset()
        self.register(batch_size=batch_size, max_token_len=max_token_len, num_steps=num_steps)
        info = self.info()
        actual = info.get("batch_size") if isinstance(info, dict) else None
        if actual not in (None, -1, batch_size):
            logger.warning(
                "the API already had a trainer registered with batch_size=%s (asked for %s); "
                "pass --reset-api to start from a clean API",
                actual,
                batch_size,
            )
