"""Client for the rollout API (``run-api``) as the trainer uses it.

- :func:`check_atropos_api` waits for ``GET /info`` to answer (30 s by default);
- :func:`register_trainer` posts ``/register`` with 5 attempts and exponential
  backoff (2–30 s), checks the HTTP status and requires ``uuid`` in the answer;
- :func:`get_batch` fetches one batch (``None`` when none is ready) and raises on
  ``status == "error"``; :func:`wait_for_batch` polls it (stoppable, and bounded
  when the API stays unreachable). Both go through a
  :class:`BatchClient`, which acknowledges each batch by the next request and
  skips a batch served twice (the API's at-least-once delivery; docs/design.md, "Delivery guarantee").

The requests go through :class:`~atroposlib.http.trainer_client.TrainerAPIClient`, the
trainer-side client the tools and the tests' fake trainer use too: every request has a
timeout and sends ``Authorization: Bearer $ATROPOS_API_KEY`` when that variable is set.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from atroposlib.http.trainer_client import (
    RolloutAPIError,
    RolloutAPIUnreachable,
    TrainerAPIClient,
    check_answer,
    registration_body,
)

from .config import TrainingConfig

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 60.0
# A batch wait gives up once the API has been unreachable this long without a break.
UNREACHABLE_TIMEOUT = 120.0

AtroposAPIError = RolloutAPIError
"""The rollout API answered with an error, or could not be reached."""

_check = check_answer


def check_atropos_api(
    url: str = "http://localhost:8000", timeout: float = 30.0, interval: float = 0.5
) -> Dict[str, Any]:
    """Poll ``GET {url}/info`` until it answers; raise :class:`AtroposAPIError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    client = TrainerAPIClient(url, timeout=5.0)
    last: str | None = None
    while True:
        try:
            return client.info()
        except AtroposAPIError as exc:
            last = str(exc)
        if time.monotonic() >= deadline:
            raise AtroposAPIError(
                f"rollout API at {url} not reachable after {timeout:.0f}s ({last})"
            )
        time.sleep(interval)


def registration_payload(
    config: TrainingConfig, starting_step: int = 0, vocab_size: int | None = None
) -> Dict[str, Any]:
    """The ``/register`` body for ``config`` (the original trainer's fields, and
    ``vocab_size`` when given: the API then refuses groups with ids the model lacks)."""
    extra = {"vocab_size": vocab_size} if vocab_size is not None else {}
    return registration_body(
        config.api_batch_size,
        config.seq_len,
        config.training_steps,
        wandb_group=config.wandb_group or "",
        wandb_project=config.wandb_project or "",
        checkpoint_dir=config.save_path,
        save_checkpoint_interval=config.checkpoint_interval
        if config.checkpoint_interval > 0
        else config.training_steps,
        starting_step=starting_step,
        **extra,
    )


@retry(
    stop=stop_after_attempt(5),
    wait=wait_exponential(multiplier=2, min=2, max=30),
    retry=retry_if_exception_type((httpx.HTTPError, AtroposAPIError)),
    reraise=True,
)
def register_trainer(
    config: TrainingConfig, starting_step: int = 0, vocab_size: int | None = None
) -> Dict[str, Any]:
    """``POST /register``; returns the JSON answer (with ``uuid``)."""
    client = TrainerAPIClient(config.atropos_url, timeout=REQUEST_TIMEOUT)
    data = client.register(registration_payload(config, starting_step, vocab_size))
    logger.info("registered trainer with %s (uuid %s)", config.atropos_url, data["uuid"])
    return data


class BatchClient(TrainerAPIClient):
    """Pulls batches from ``GET /batch`` with the rollout API's delivery guarantee.

    The API keeps a served batch until the trainer acknowledges it. Each call
    of :meth:`get_batch` acknowledges the batch returned by the call before it
    (``?ack=<batch_id>``): call it again only once that batch is trained on.
    A batch lost in transit (the API killed while answering, or this trainer
    restarted before training on it) is served again, and one already
    received is skipped by its ``batch_id``. Resume with ``last_batch_id`` from
    a checkpoint so a restarted trainer does not train twice on a batch it
    had already trained on (the API then consumes that batch).

    Against an API that sends no ``batch_id`` (the original), it behaves as
    the original trainer did.
    """

    def __init__(
        self, url: str, last_batch_id: str | None = None, client: httpx.Client | None = None
    ) -> None:
        super().__init__(url, timeout=REQUEST_TIMEOUT, client=client, last_batch_id=last_batch_id)


_batch_clients: Dict[str, BatchClient] = {}


def batch_client(url: str) -> BatchClient:
    """The process-wide :class:`BatchClient` of ``url`` (it remembers the last batch_id)."""
    found = _batch_clients.get(url)
    if found is None:
        found = _batch_clients[url] = BatchClient(url)
    return found


def get_batch(
    url: str = "http://localhost:8000", client: httpx.Client | None = None
) -> List[Dict[str, Any]] | None:
    """One ``GET /batch``: the list of groups, or ``None`` when no batch is ready.

    Acknowledges the batch the previous call returned (see :class:`BatchClient`).
    """
    bc = batch_client(url)
    bc._client = client
    try:
        return bc.get_batch()
    finally:
        bc._client = None


def wait_for_batch(
    url: str,
    poll_interval: float = 1.0,
    timeout: float = 0.0,
    should_stop: Callable[[], bool] | None = None,
    unreachable_timeout: float = UNREACHABLE_TIMEOUT,
) -> List[Dict[str, Any]]:
    """Poll ``/batch`` until a batch arrives. ``timeout`` 0 waits forever for one.

    Bounded and stoppable: raises :class:`AtroposAPIError` when ``should_stop()``
    turns true (checked between polls), when no batch came within ``timeout`` s, or
    when the API could not be reached for ``unreachable_timeout`` s in a row (it is
    gone, not merely slow). Shorter connection errors are logged and retried; an
    error payload raises. Each call acknowledges the batch the previous call returned.
    """
    start = time.monotonic()
    failing_since: float | None = None
    with httpx.Client() as client:
        while True:
            if should_stop is not None and should_stop():
                raise AtroposAPIError("stopped while waiting for a batch")
            try:
                batch = get_batch(url, client)
                failing_since = None
                if batch:
                    return batch
            except RolloutAPIUnreachable as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= unreachable_timeout:
                    raise AtroposAPIError(
                        f"rollout API at {url} unreachable for {now - failing_since:.0f}s ({exc})"
                    ) from exc
                logger.warning("GET /batch failed (%s); retrying", exc)
            if should_stop is not None and should_stop():
                raise AtroposAPIError("stopped while waiting for a batch")
            if timeout and time.monotonic() - start > timeout:
                raise AtroposAPIError(f"no batch from {url} within {timeout:.0f}s")
            time.sleep(poll_interval)
